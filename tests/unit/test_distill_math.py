"""Distillation's numbers: the fused top-k forward KL against a dense re-implementation (value and
gradients, finite differences too), its zero at a matching student and the tail bucket; the on-policy
advantage and the teacher's scores against two separate full-logit forwards; Scorer.compare against
the textbook KL; the completions log surviving a U+2028 in a completion."""
import json
import math

import pytest
import torch

from retrograd.models.fused_head import linear_topk_kl_sum, log1mexp, topk_bucket_kl


def dense_topk_kl(hidden, weight, ids, teacher_logp):
    """Straightforward: per position, the k + 1 bucket probabilities of both sides, then sum p log p/q."""
    student = torch.softmax(hidden @ weight.t(), -1)
    total = hidden.new_zeros(())
    for i in range(hidden.shape[0]):
        p_k, q_k = teacher_logp[i].exp(), student[i, ids[i]]
        p = torch.cat([p_k, (1 - p_k.sum())[None]])
        q = torch.cat([q_k, (1 - q_k.sum())[None]])
        total = total + (p * (p.log() - q.log())).sum()
    return total


def _case(n=9, h=6, v=13, k=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=dtype, requires_grad=True)
    teacher = torch.log_softmax(2 * torch.randn(n, v, generator=g, dtype=dtype), -1)
    logp, ids = teacher.topk(k, -1)
    return hidden, weight, ids, logp


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_fused_topk_kl_matches_the_dense_version_and_its_gradients(chunk):
    hidden, weight, ids, logp = _case()
    fused = linear_topk_kl_sum(hidden, weight, ids, logp, chunk_size=chunk)
    dense = dense_topk_kl(hidden, weight, ids, logp)
    assert torch.allclose(fused, dense, atol=1e-10)
    g_fused = torch.autograd.grad(fused * 3.0, (hidden, weight))  # backward scales by the incoming gradient
    g_dense = torch.autograd.grad(dense * 3.0, (hidden, weight))
    for a, b in zip(g_fused, g_dense):
        assert torch.allclose(a, b, atol=1e-10)


def test_fused_topk_kl_gradient_by_finite_differences():
    hidden, weight, ids, logp = _case(n=3, h=4, v=7, k=2, seed=1)
    loss = linear_topk_kl_sum(hidden, weight, ids, logp, chunk_size=2)
    (g_h,) = torch.autograd.grad(loss, hidden)
    eps = 1e-6
    for i, j in [(0, 0), (1, 3), (2, 1)]:
        plus, minus = hidden.detach().clone(), hidden.detach().clone()
        plus[i, j] += eps
        minus[i, j] -= eps
        numeric = (linear_topk_kl_sum(plus, weight.detach(), ids, logp) -
                   linear_topk_kl_sum(minus, weight.detach(), ids, logp)) / (2 * eps)
        assert abs(float(numeric) - float(g_h[i, j])) < 1e-6


def test_topk_kl_is_zero_when_the_student_is_the_teacher_and_counts_the_tail():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0, -2.0]], dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)
    top, ids = logp.topk(2, -1)
    assert float(topk_bucket_kl(logp, ids, top)) == pytest.approx(0.0, abs=1e-12)
    # a student with the teacher's top-2 in the same ratio but more tail mass is not zero: the tail counts
    p = logp.exp()[0]
    student = torch.tensor([[p[0] * 0.5, p[1] * 0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    student[0, 2:] = (1 - student[0, :2].sum()) / 3
    by_hand = (p[0] * math.log(2) + p[1] * math.log(2)
               + (1 - p[0] - p[1]) * math.log((1 - p[0] - p[1]) / (1 - 0.5 * (p[0] + p[1]))))
    assert float(topk_bucket_kl(student.log(), ids, top)) == pytest.approx(float(by_hand), rel=1e-9)


def test_a_top_k_holding_all_the_mass_stays_finite():
    logp = torch.log_softmax(torch.tensor([[50.0, 0.0, -50.0]]), -1)
    top, ids = logp.topk(3, -1)
    hidden = torch.randn(1, 2, requires_grad=True)
    weight = torch.randn(3, 2, requires_grad=True)
    loss = linear_topk_kl_sum(hidden, weight, ids, top)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()


def test_log1mexp_is_accurate_at_both_ends():
    x = torch.tensor([-1e-10, -0.1, -0.7, -5.0, -40.0], dtype=torch.float64)
    exact = torch.tensor([math.log(-math.expm1(v)) for v in x.tolist()], dtype=torch.float64)
    assert torch.allclose(log1mexp(x), exact, rtol=1e-12)


def _tiny_pair(tmp_path):
    from tiny import make_model_dir, make_teacher_dir
    from transformers import AutoModelForCausalLM
    student = make_model_dir(tmp_path / "s", seed=0)
    s = AutoModelForCausalLM.from_pretrained(student).eval()
    t = AutoModelForCausalLM.from_pretrained(make_teacher_dir(tmp_path / "t", make_model_dir(tmp_path / "r", seed=1),
                                                              sharpen=20.0)).eval()
    return s, t


def test_teacher_scores_and_compare_match_two_full_forwards(tmp_path):
    """The on-policy advantage's parts (the teacher's log-prob of each sampled token, top-1) and the
    evaluation's KL, from the batched code, against each model's own full logits, row by row."""
    from retrograd.models.logprobs import Scorer
    from retrograd.train.distill import teacher_scores
    from retrograd.train.policy_update import build_batch, collate
    student, teacher = _tiny_pair(tmp_path)
    seqs = [([5, 6, 7], [8, 9, 10, 11]), ([12, 13], [14, 15]), ([5, 6, 7, 1], [20])]
    batch = build_batch(seqs, None, torch.zeros(3, 4, dtype=torch.float64), [[0.0] * len(c) for _, c in seqs],
                        6, "token", 8, 0, "cpu")  # a budget of 6 tokens: several passes
    assert len(batch.passes) > 1
    lp, top1 = teacher_scores(Scorer(teacher), batch)
    kl, agree = Scorer(student).compare(Scorer(teacher), collate(seqs, 0))
    flat_kl = []
    for r, (p, c) in enumerate(seqs):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(ids).logits[0].double(), -1)
            s_logp = torch.log_softmax(student(ids).logits[0].double(), -1)
        for j, tok in enumerate(c):
            pos = len(p) - 1 + j  # the position that predicts completion token j
            assert float(lp[r, j]) == pytest.approx(float(t_logp[pos, tok]), abs=1e-5)
            assert bool(top1[r, j]) == (int(t_logp[pos].argmax()) == tok)
            flat_kl.append(float((s_logp[pos].exp() * (s_logp[pos] - t_logp[pos])).sum()))
        assert float(lp[r, len(c):].abs().sum()) == 0.0
    assert torch.allclose(kl.double(), torch.tensor(flat_kl, dtype=torch.float64), atol=1e-5)
    assert agree.shape == kl.shape


def test_on_policy_advantage_is_the_clamped_log_ratio():
    from retrograd.train.distill import distill_metrics
    gap = torch.tensor([-7.0, -1.0, 0.5, 6.0])  # log p_T - log p_S of four sampled tokens
    m = distill_metrics(gap, 5.0)
    assert m["distill/teacher_kl_mean"] == pytest.approx(float(-gap.mean()))
    assert m["distill/advantage_clipped_fraction"] == pytest.approx(0.5)
    assert m["distill/teacher_kl_p95"] == pytest.approx(float(torch.quantile(-gap.double(), 0.95)))


def test_completions_log_keeps_rows_with_unicode_line_separators(tmp_path):
    from retrograd.train.rollouts import CompletionsLog
    rows = [{"step": s, "completion": "a\u2028b\x85c\u2029"} for s in (1, 2, 3)]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                                encoding="utf-8")
    CompletionsLog(tmp_path, 2, 1).close()  # a resume at step 2 drops step 3
    kept = (tmp_path / "completions.jsonl").read_text(encoding="utf-8").split("\n")
    assert [json.loads(x)["step"] for x in kept if x] == [1, 2]
