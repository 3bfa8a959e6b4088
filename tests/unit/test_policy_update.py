"""The forward/backward of an RL update (train/policy_update.py): it trains exactly the rows of the
groups with a learning signal, its gradient equals a straightforward per-row re-implementation, and
splitting the update into passes (or sharing prompts) gives the gradient of one pass."""
import pytest
import torch

from retrograd.algorithms.policy_losses import POLICY_LOSSES
from retrograd.models.load import load_model
from retrograd.models.logprobs import Scorer
from retrograd.models.lora import attach_lora
from retrograd.train.policy_update import build_batch, epoch_backward, trainable_rows

PARAMS = {"clip_low": 0.2, "clip_high": 0.28, "clip_ratio_c": 3.0}
G = 3


@pytest.fixture(scope="module")
def setup(tiny_model):
    loaded = load_model(str(tiny_model), log=lambda *_: None)
    # float64, so that "equal" means the same maths: float32 sums in another order differ by ~1e-6
    model, _ = attach_lora(loaded.model.double(), 4, 8, ["auto"], 0.0, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    tok = loaded.tokenizer
    prompts = [tok(w)["input_ids"] for w in ("hello there", "hi", "good morning friend")]
    completions = [[10, 20, 30, 40], [50, 60], [70], [5, 6, 7], [8, 9, 10, 11, 12], [13],
                   [14, 15], [16, 17, 18], [19]]
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.0, 1.0, 1.0], dtype=torch.float64)  # group 1: no signal
    return model, tok, prompts, completions, rewards


def grads(model) -> dict:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def run_update(model, tok, seqs, prompt_of, adv, budget, normalisation="token"):
    batch = build_batch(seqs, prompt_of, adv, [[0.0] * len(c) for _, c in seqs], budget, normalisation, 8,
                        tok.pad_token_id, "cpu")
    loss, _ = epoch_backward(Scorer(model), batch, POLICY_LOSSES.get("clip"), PARAMS)
    return loss, grads(model), batch


def test_trainable_rows_drop_groups_without_signal_and_truncated_rows():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0, 0.0, 1.0, 1.0])
    assert trainable_rows(rewards, 3, [False] * 9, False) == [0, 1, 2, 6, 7, 8]
    assert trainable_rows(rewards, 3, [False, True] + [False] * 7, True) == [0, 2, 6, 7, 8]
    assert trainable_rows(rewards, 3, [False, True] + [False] * 7, False) == [0, 1, 2, 6, 7, 8]
    assert trainable_rows(torch.ones(6), 3, [False] * 6, False) == []


@pytest.mark.parametrize("normalisation", ["token", "sequence", "constant"])
def test_gradient_is_the_surviving_rows_policy_gradient(setup, normalisation):
    """At ratio 1 the clipped loss's gradient is -A dlp: re-implemented row by row with the model's
    full logits, on the surviving rows only, divided by the whole update's count."""
    model, tok, prompts, completions, rewards = setup
    live = trainable_rows(rewards, G, [False] * 9, False)
    adv = (rewards.view(-1, G) - rewards.view(-1, G).mean(1, keepdim=True)).reshape(-1)
    seqs = [(prompts[i // G], completions[i]) for i in live]
    token_adv = adv[live][:, None].expand(-1, 5).contiguous()
    _, got, _ = run_update(model, tok, seqs, None, token_adv, None, normalisation)

    total = torch.zeros((), dtype=torch.float64)
    n_tok = sum(len(c) for _, c in seqs)
    for (p, c), a in zip(seqs, adv[live]):
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
        row = -(float(a) * lp).sum()
        total = total + {"token": row / n_tok, "sequence": row / len(c) / len(seqs),
                         "constant": row / (len(seqs) * 8)}[normalisation]
    total.backward()
    want = grads(model)
    assert got.keys() == want.keys()
    for n in want:
        assert (got[n] - want[n]).norm() <= 1e-10 * want[n].norm(), n


@pytest.mark.parametrize("shared", [False, True], ids=["own_prompts", "shared_prompts"])
def test_an_update_split_into_passes_equals_one_pass(setup, shared):
    model, tok, prompts, completions, rewards = setup
    live = trainable_rows(rewards, G, [False] * 9, False)
    seqs = [(prompts[i // G], completions[i]) for i in live]
    prompt_of = [i // G for i in live] if shared else None
    torch.manual_seed(1)
    token_adv = torch.randn(len(live), 5, dtype=torch.float64)
    loss_one, one, batch_one = run_update(model, tok, seqs, prompt_of, token_adv, None)
    loss_many, many, batch_many = run_update(model, tok, seqs, prompt_of, token_adv, 12)
    assert len(batch_one.passes) == 1 and len(batch_many.passes) >= 2
    assert loss_many == pytest.approx(loss_one, abs=1e-12)
    for n in one:
        assert (many[n] - one[n]).norm() <= 1e-10 * one[n].norm(), n


def test_second_epoch_is_off_policy_and_the_first_is_not(setup):
    model, tok, prompts, completions, rewards = setup
    seqs = [(prompts[0], completions[0]), (prompts[0], completions[1])]
    batch = build_batch(seqs, None, torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=torch.float64), [[0.0] * 4, [0.0] * 2],
                        None, "token", 8, tok.pad_token_id, "cpu")
    _, st = epoch_backward(Scorer(model), batch, POLICY_LOSSES.get("clip"), PARAMS)
    assert float(st[0]["ratio_mean"]) == 1.0 and float(st[0]["clip_fraction"]) == 0.0
    grads(model)
    with torch.no_grad():  # move the policy, then the same batch's ratio leaves 1
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.05)
    _, st = epoch_backward(Scorer(model), batch, POLICY_LOSSES.get("clip"), PARAMS)
    assert float(st[0]["ratio_mean"]) != 1.0
    grads(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.sub_(0.05)
