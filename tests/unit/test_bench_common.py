"""The benchmarks' pure helpers (benchmarks/common.py, benchmarks/report.py), without a model:
statistics, run order, the loss check, the step FLOP count against a hand computation, result
files and the README tables rendered from them."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import common  # noqa: E402
import report  # noqa: E402


def test_stats_median_min_max_spread():
    s = common.stats([3.0, 1.0, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert s["spread"] == pytest.approx(1.0)  # (3 - 1) / 2
    assert common.stats([1, 2, 3, 4])["median"] == 2.5
    assert common.stats([5.0])["spread"] == 0.0


def test_summarize_and_ratios():
    runs = {"a": [{"x": 2.0}, {"x": 4.0}, {"x": 3.0}], "b": [{"x": 1.0}, {"x": 1.5}, {"x": 2.0}]}
    summary = {k: common.summarize(v, {"x": lambda r: r["x"]}) for k, v in runs.items()}
    assert summary["a"]["x"]["median"] == 3.0
    assert common.ratios(summary, "a", "b") == {"x": 2.0}
    assert common.steady([9.0, 1.0, 2.0]) == [1.0, 2.0]


def test_interleave_alternates_sides():
    assert common.interleave(["a", "b"], 3) == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert common.interleave(["a", "b", "c"], 1) == [("a", 0), ("b", 0), ("c", 0)]


def test_run_interleaved_records_order_and_load_and_checks_after_each():
    calls, seen = [], []
    runs, loads = common.run_interleaved(["a", "b"], 2, lambda side, i: calls.append((side, i)) or {"i": i},
                                         after_each=lambda rs: seen.append(sum(len(v) for v in rs.values())))
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert [r["i"] for r in runs["a"]] == [0, 1] and len(runs["b"]) == 2
    assert seen == [1, 2, 3, 4]
    assert [(x["side"], x["repeat"]) for x in loads] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    assert all(len(x["load_average"]) == 3 for x in loads)


def test_loss_check_passes_within_tolerance_and_reports_the_largest_difference():
    out = common.check_losses("bench", {"ref": [[2.0, 1.5], [2.0, 1.5]], "other": [[2.0 + 1e-4, 1.5]]}, "ref", 1e-3)
    assert out["max_abs_diff_vs_reference"]["other"] == pytest.approx(1e-4)
    assert out["max_abs_diff_across_repeats"]["ref"] == 0.0


def test_loss_check_fails_naming_step_and_values():
    with pytest.raises(common.CheckFailed, match=r"step 2: other run 1 has 1.6, ref run 1 has 1.5"):
        common.check_losses("bench", {"ref": [[2.0, 1.5]], "other": [[2.0, 1.6]]}, "ref", 1e-3)
    # the same side's repeats are held to their own tolerance
    with pytest.raises(SystemExit, match="other run 1"):
        common.check_losses("bench", {"ref": [[2.0]], "other": [[2.0], [2.0 + 1e-4]]}, "ref", 1e-3, repeat_tol=1e-6)
    with pytest.raises(SystemExit, match="step 2"):  # a run that logged fewer steps
        common.check_losses("bench", {"ref": [[2.0, 1.5]], "other": [[2.0]]}, "ref", 1e-3)
    assert common.loss_mismatch([float("nan")], [1.0], 1e-3) is not None
    assert common.loss_mismatch([10.001], [10.0], 2e-4) is None  # relative above |b| = 1


TINY = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10, "tie_word_embeddings": True}


def test_model_shape():
    assert common.model_shape(TINY) == {"hidden": 8, "intermediate": 16, "layers": 2, "heads": 2, "kv_heads": 1,
                                        "head_dim": 4, "vocab": 10, "tied": True}


def test_step_flops_lora_by_hand():
    # batch 1 x seq 3 (n = 3 tokens), LoRA rank 2 on q, k, v, o. Products 2 * n * in * out:
    #   q 8x8: 384, k and v 8x4: 192, o 8x8: 384, gate / up 8x16: 768, down 16x8: 768
    # layer 0: nothing trainable upstream, so q/k/v are forward only; o, gate, up, down also need
    #   their input gradient (2x): 384 + 192 + 192 + 768 + 3 * 1536 = 6144
    # layer 1: every projection 2x: 768 + 384 + 384 + 768 + 3 * 1536 = 6912
    # LoRA A (in x 2) and B (2 x out): trained, 3x, except layer 0's q/k/v A (no input gradient, 2x):
    #   layer 0: q 96*2 + 96*3, k 96*2 + 48*3, v the same, o 96*3 + 96*3 = 480 + 336 + 336 + 576 = 1728
    #   layer 1: q 576, k 432, v 432, o 576 = 2016
    # attention: QK^T and AV each 2 * 1 * 2 heads * 3 * 3 * 4 = 144, forward + 2 input gradients: 864 per layer
    # head: 2 * 3 * 8 * 10 = 480, forward + input gradient (frozen): 960
    f = common.step_matmul_flops(common.model_shape(TINY), 1, 3, "lora", 2, ["q", "k", "v", "o"])
    assert (f["projections"], f["lora"], f["attention"], f["lm_head"]) == (13056, 3744, 1728, 960)
    assert f["total"] == 13056 + 3744 + 1728 + 960 and f["tokens"] == 3
    assert common.step_matmul_flops(common.model_shape(TINY), 1, 3, "lora", 2, ["q_proj", "k_proj", "v_proj",
                                                                                 "o_proj"]) == f


def test_step_flops_full_by_hand():
    # every weight trained and every input needs a gradient: 3x forward. Forward per layer
    # 2 * 3 * (64 + 32 + 32 + 64 + 128 + 128 + 128) = 3456; head 480; no LoRA
    f = common.step_matmul_flops(common.model_shape(TINY), 1, 3, "full")
    assert (f["projections"], f["lora"], f["attention"], f["lm_head"]) == (2 * 3 * 3456, 0, 1728, 3 * 480)
    with pytest.raises(ValueError):
        common.step_matmul_flops(common.model_shape(TINY), 1, 3, "qlora")


def test_write_result_names_and_records(tmp_path):
    path = common.write_result("sft_lora", {"summary": {}, "machine": {"cpu": "X"}}, tmp_path)
    assert report.newest("sft_lora", tmp_path) == path
    r = json.loads(path.read_text())
    assert r["benchmark"] == "sft_lora" and r["smoke"] is False and r["machine"] == {"cpu": "X"}
    assert r["date"].endswith("+00:00") and r["command"] and "torch" in r["versions"]
    assert len(r["load_average"]["end"]) == 3
    smoke = common.write_result("sft_lora", {}, tmp_path, smoke=True)
    assert "_smoke_" in smoke.name and report.newest("sft_lora", tmp_path) == path  # smoke runs never reported


def synthetic_sft(tps_rg=200.0, tps_trl=100.0) -> dict:
    def st(med, lo, hi):
        return {"median": med, "min": lo, "max": hi, "spread": (hi - lo) / med, "n": 3}
    return {
        "benchmark": "sft_lora", "smoke": False, "date": "2026-12-01T10:00:00+00:00",
        "machine": {"cpu": "Test CPU", "cpus": 2, "threads": 2, "flags": {"avx512_bf16": True, "amx_bf16": False},
                    "matmul_gflops": {"fp32": 180.0, "bf16": 400.0}},
        "versions": {"torch": "2.13.0", "trl": "1.16.0"}, "settings": {"repeats": 3},
        "load_average": {"before_runs": [{"side": "retrograd", "repeat": 1, "load_average": [0.5, 0, 0]},
                                         {"side": "trl", "repeat": 1, "load_average": [1.25, 0, 0]}]},
        "summary": {"retrograd": {"tokens_per_s": st(tps_rg, tps_rg - 5, tps_rg + 5), "machine_share": st(0.6, 0.6, 0.6)},
                    "trl": {"tokens_per_s": st(tps_trl, tps_trl - 2, tps_trl + 1), "machine_share": st(0.3, 0.25, 0.31)}},
        "flops_per_step": {"total": 6.05e11, "tokens": 1024, "counting": "2mnk"},
        "checks": {"loss": {"tolerance": "|a - b| <= 0.002 * max(1, |b|)", "max_abs_diff_vs_reference": {"retrograd": 3e-5}}},
        "loss": {"first": 2.0779, "last": 1.6401},
    }


def test_render_table_from_a_result():
    text = report.render(synthetic_sft())
    assert "Test CPU" in text and "matmul fp32 180 / bf16 400 GFLOP/s" in text and "avx512_bf16" in text
    assert "| tokens/s, steps 2+ | 200.0 (195.0–205.0) | 100.0 (98.0–101.0) | 2.00× |" in text
    assert "| % of the fp32 matmul peak | 60 % | 30 (25–31) % | 2.00× |" in text
    assert "load average 0.5–1.2 before runs" in text
    assert "605.0 GFLOP" in text and "2.0779 → 1.6401" in text
    assert "seconds per step" not in text  # rows without data are left out


def test_write_sections_replaces_only_between_markers(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "sft_lora_20261201_100000.json").write_text(json.dumps(synthetic_sft(150.0)))
    (results / "sft_lora_20261202_100000.json").write_text(json.dumps(synthetic_sft(300.0)))  # the newest
    (results / "sft_lora_smoke_20261203_100000.json").write_text(json.dumps(synthetic_sft(1.0)))
    readme = tmp_path / "README.md"
    readme.write_text("# B\n\n### Results\n<!-- report:sft_lora -->\nold table\n<!-- /report:sft_lora -->\n"
                      "history stays\n<!-- report:dpo -->\n<!-- /report:dpo -->\nend\n")
    assert report.write_sections(readme, results) == ["sft_lora", "dpo"]
    text = readme.read_text()
    assert "old table" not in text and "| 300.0 (295.0–305.0)" in text and "150.0" not in text
    assert text.startswith("# B\n\n### Results\n<!-- report:sft_lora -->\n") and "history stays\n" in text
    assert "<!-- report:dpo -->\nNo result yet" in text and text.endswith("<!-- /report:dpo -->\nend\n")
    again = readme.read_text()
    report.write_sections(readme, results)  # idempotent
    assert readme.read_text() == again


def test_summary_table_takes_each_benchmarks_headline(tmp_path):
    r = synthetic_sft(250.0, 100.0)
    r["summary"]["retrograd"]["peak_rss_mb"] = {"median": 1500.0}
    r["summary"]["trl"]["peak_rss_mb"] = {"median": 3000.0}
    (tmp_path / "sft_lora_20261201_100000.json").write_text(json.dumps(r))
    text = report.render_kind("summary", tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("| SFT LoRA"))
    assert "| 250.0 | 100.0 | **2.50×** | 0.50× | Test CPU (no AVX2, bf16), 180 GFLOP/s | `sft_lora_20261201_100000.json` |" in line
    assert "| DPO LoRA, pairs/s per step | - | - | - | - | - | no result yet |" in text


def test_summary_keeps_the_newest_result_of_each_cpu(tmp_path):
    """Two CPUs of one model name (AVX-512 + bf16, AVX2 only): a row each, the newest of each; an older
    file of the same CPU is left out, and so is one without the sides of the row."""
    def result(tps, flags, stamp):
        r = synthetic_sft(tps, 100.0)
        r["machine"]["cpu"], r["machine"]["flags"] = "AMD EPYC", flags
        (tmp_path / f"sft_lora_{stamp}.json").write_text(json.dumps(r))
        return r
    wide = {"avx2": True, "avx512f": True, "avx512_bf16": True}
    result(210.0, wide, "20261201_100000")  # older, same CPU: not shown
    result(220.0, wide, "20261201_110000")
    result(150.0, {"avx2": True}, "20261202_090000")
    lone = synthetic_sft(999.0, 100.0)
    del lone["summary"]["trl"]  # the row needs both sides
    lone["machine"]["flags"] = {"avx2": True}
    (tmp_path / "sft_lora_20261202_100000.json").write_text(json.dumps(lone))
    bf16 = synthetic_sft(300.0, 100.0)  # --dtype bfloat16's file: its own row, never an fp32 one
    bf16["machine"]["flags"] = wide
    (tmp_path / "sft_lora_bf16_20261203_000000.json").write_text(json.dumps(bf16))
    summary = report.render_kind("summary", tmp_path).splitlines()
    rows = [x for x in summary if x.startswith("| SFT LoRA, ")]
    assert len(rows) == 2
    assert [x for x in summary if x.startswith("| SFT LoRA bf16, ")] == [
        x for x in summary if "sft_lora_bf16_20261203_000000.json" in x and "| 300.0 | 100.0 | **3.00×** |" in x]
    assert "% of the bf16 matmul peak" in report.render_kind("sft_lora_bf16", tmp_path)
    assert "| 150.0 |" in rows[0] and "AMD EPYC (AVX2), 180 GFLOP/s" in rows[0] and "20261202_090000" in rows[0]
    assert "| 220.0 |" in rows[1] and "AMD EPYC (AVX-512, bf16)" in rows[1] and "20261201_110000" in rows[1]


def test_a_result_without_flags_stays_until_a_flagged_one_names_its_cpu(tmp_path):
    """Old files recorded no CPU flags: an "AMD EPYC" one keeps its row beside a newer Xeon result (a
    different CPU), and gives it up once a flagged EPYC result exists (it cannot say which EPYC it was)."""
    def result(tps, name, flags, stamp):
        r = synthetic_sft(tps, 100.0)
        r["machine"]["cpu"], r["machine"]["flags"] = name, flags
        (tmp_path / f"sft_lora_{stamp}.json").write_text(json.dumps(r))

    def rows():
        return [x for x in report.render_kind("summary", tmp_path).splitlines() if x.startswith("| SFT LoRA, ")]
    result(111.0, "AMD EPYC", {}, "20261201_100000")
    result(222.0, "Intel(R) Xeon(R) Processor", {"avx2": True, "avx512f": True, "amx_bf16": True}, "20261202_100000")
    got = rows()
    assert len(got) == 2 and "| 222.0 |" in got[0] and "| 111.0 |" in got[1] and "| AMD EPYC, 180 GFLOP/s |" in got[1]
    result(333.0, "AMD EPYC", {"avx2": True}, "20261203_100000")
    got = rows()
    assert len(got) == 2 and "| 333.0 |" in got[0] and "| 222.0 |" in got[1] and not any("| 111.0 |" in x for x in got)


def test_grpo_notes_take_a_check_stated_in_words():
    r = synthetic_sft()
    r["checks"] = {"loss": "every update's loss equals its objective", "trained_completions": {"retrograd": [16]}}
    text = "\n".join(report.notes("grpo", r))
    assert "Loss check passed: every update's loss equals its objective." in text
    assert "retrograd [16]" in text


def test_cpu_label_names_the_vector_unit_and_how_bf16_is_computed():
    def label(flags, name="Intel(R) Xeon(R) Processor"):
        return report.cpu_label({"machine": {"cpu": name, "flags": flags}})
    assert label({"avx2": True, "avx512f": True, "avx512_bf16": True, "amx_bf16": True}) == \
        "Intel Xeon Processor (AVX-512, AMX bf16)"
    assert label({"avx2": True, "avx512f": True}) == "Intel Xeon Processor (AVX-512)"  # the Xeon without bf16
    assert label({"avx2": True, "avx512f": True, "avx512_bf16": True}, "AMD EPYC") == "AMD EPYC (AVX-512, bf16)"
    assert label({}, "AMD EPYC") == "AMD EPYC"  # an old result without flags


def test_compile_ab_check_reports_differences_and_stops_beyond_tolerance():
    import torch
    import ab_compile
    grads = {"a": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    eager = (1.0, 100.0, grads)
    close = (1.0, 100.0 + 1e-4, {"a": torch.tensor([1.0, -2.0 + 1e-3], dtype=torch.float64)})
    loss, grad = ab_compile.check_same("pass 0", eager, close)
    assert loss == pytest.approx(1e-6, rel=1e-3) and grad == pytest.approx(5e-4, rel=1e-3)  # 1e-3 of the largest, 2
    with pytest.raises(SystemExit, match="gradients by 5.00e-03"):
        ab_compile.check_same("pass 1", eager, (1.0, 100.0, {"a": torch.tensor([1.0, -1.99], dtype=torch.float64)}))
    with pytest.raises(SystemExit, match="loss by 1.00e-04"):
        ab_compile.check_same("pass 2", eager, (1.0, 100.01, grads))


def test_scoring_layout_ab_shapes_and_check():
    import torch
    import ab_scoring_layout as ab
    from retrograd.models.layout import shared_prefix_length
    prompts, completions, owner = ab.batch("dpo", 40, 1000)
    assert len(prompts) == 2 and owner == [0, 0, 1, 1] and [len(c) for c in completions] == [74, 71, 73, 70]
    assert shared_prefix_length(prompts, 1) == 40  # the common prefix is exactly the system prompt
    prompts, completions, owner = ab.batch("grpo", 10, 1000)
    assert len(prompts) == 4 and len(completions) == 16 and owner == [i // 4 for i in range(16)]
    assert shared_prefix_length(prompts, 1) == 10
    sft = ab.sft_rows(1000)  # right-padded rows of different lengths, every real token labelled
    real = sft["attention_mask"].bool()
    assert real.sum(1).tolist() == [86, 71, 53, 80, 40, 65] and not real[:, 0].logical_not().any()
    assert torch.equal(sft["labels"] != -100, real) and (sft["input_ids"][real] >= 100).all()
    grads = {"a": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    a = (1.0, torch.tensor([-100.0, -0.5], dtype=torch.float64), grads)
    close = (1.0, torch.tensor([-100.001, -0.50001], dtype=torch.float64), grads)
    sums, grad = ab.check_same("pair 0", a, close)
    assert sums == pytest.approx(1e-5, rel=1e-3) and grad == 0.0  # relative to |sum|, at least 1
    with pytest.raises(SystemExit, match="sums by 1.00e-03"):
        ab.check_same("pair 1", a, (1.0, torch.tensor([-100.0, -0.501], dtype=torch.float64), grads))
    with pytest.raises(SystemExit, match="gradients by 5.00e-03"):
        ab.check_same("pair 2", a, (1.0, a[1], {"a": torch.tensor([1.0, -1.99], dtype=torch.float64)}))
