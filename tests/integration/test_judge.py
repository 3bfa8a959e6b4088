"""LLM judges end to end, against a real OpenAI-compatible server: llama.cpp's own (xllamacpp)
serving a tiny GGUF written here, its replies held to the verdict's JSON schema by llama.cpp's
grammar. GRPO and PPO train with the judge's verdicts in their rewards (metrics, a private cache
that a second run reads); `retrograd judge eval` reports agreement and self-consistency; a dead
server stops the run with the documented error instead of hanging."""
import json
import os
import socket
import time

import pytest

from judge_util import llama_server
from llamacpp_util import write_tiny_llama_gguf
from tiny import write_grpo_run, write_jsonl, write_ppo_run


@pytest.fixture(scope="module")
def judge_url(tmp_path_factory):
    from tiny import make_model_dir
    root = tmp_path_factory.mktemp("judge")
    # a judge request is ~600 byte-level tokens: the model's context must hold it and the reply
    gguf = write_tiny_llama_gguf(make_model_dir(root / "judge-model", seed=5, max_positions=4096), root / "judge.gguf")
    server, url = llama_server(gguf)
    yield url
    del server


def judge_table(url, table="grpo", **kw):
    keys = {"base_url": json.dumps(url), "model": '"tiny-judge"', "max_tokens": 400, "timeout_seconds": 60, **kw}
    return f"[{table}]\njudge_weight = 1.0\n[{table}.judge]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())


def metrics(folder, name):
    return [json.loads(x) for x in (folder / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_grpo_trains_on_the_judges_verdicts_and_caches_them(tmp_path, tiny_model, judge_url, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, judge_table(judge_url), updates=2)
    cli("train", cfg, check=0)
    rows = [r for r in metrics(tmp_path, "grpo") if "reward/mean" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["judge/requests"] == 8 and r["judge/failed_requests"] == 0  # 2 prompts x 4 completions
        assert r["judge/dropped_group_fraction"] == 0.0 and 0.0 <= r["reward/judge/mean"] <= 1.0
        assert r["judge/latency_seconds_mean"] > 0
    completions = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "completions.jsonl").read_text().splitlines()]
    lower = [sum("a" <= ch <= "z" for ch in c["completion"]) / max(1, len(c["completion"])) for c in completions]
    judged = [c["reward"] - low for c, low in zip(completions, lower)]  # reward = lowercase share + 1.0 x verdict
    assert all(-1e-6 <= v <= 1 + 1e-6 and abs(v * 10 - round(v * 10)) < 1e-6 for v in judged)  # k / 10
    cache = tmp_path / "runs" / "grpo" / "judge-cache.jsonl"
    assert os.stat(cache).st_mode & 0o777 == 0o600 and len(cache.read_text().splitlines()) > 0

    # the same run again, fresh folders: every verdict comes from the cache
    (tmp_path / "runs" / "grpo" / "metrics.jsonl").unlink()
    cli("train", cfg, check=0)
    again = [r for r in metrics(tmp_path, "grpo") if "reward/mean" in r]
    assert again[0]["judge/cache_hit_fraction"] == 1.0


def test_ppo_with_a_pointwise_judge(tmp_path, tiny_model, judge_url, cli):
    cfg = write_ppo_run(tmp_path, tiny_model, judge_table(judge_url, "ppo"), updates=1)
    cli("train", cfg, check=0)
    row = [r for r in metrics(tmp_path, "ppo") if "reward/mean" in r][0]
    assert row["judge/requests"] == 8 and "reward/judge/mean" in row
    cfg.write_text(cfg.read_text().replace('[ppo.judge]\n', '[ppo.judge]\nmode = "pairwise"\n'))
    r = cli("train", cfg)
    assert r.returncode == 2 and 'use mode = "pointwise"' in r.stderr


@pytest.mark.parametrize("mode", ["listwise", "pairwise"])
def test_judge_eval_reports_agreement_and_self_consistency(tmp_path, tiny_model, judge_url, cli, mode):
    cfg = write_grpo_run(tmp_path, tiny_model, judge_table(judge_url, mode=json.dumps(mode)), updates=1)
    write_jsonl(tmp_path / "fixtures.jsonl", [
        {"prompt": "Name a colour.", "completions": ["red", "the sky", "blue"], "labels": [2, 0, 2]},
        {"prompt": [{"role": "user", "content": "Say hi."}], "completions": ["hi", "bye"], "labels": [1, 0],
         "rubric": "Greets the user."}])
    out = json.loads(cli("judge", "eval", cfg, "--fixtures", "fixtures.jsonl", "--json", check=0).stdout)
    assert out["rows"] == 2 and out["failed_rows"] == 0 and out["mode"] == mode, out["errors"]
    for key in ("kendall_tau", "spearman_rho", "self_kendall_tau", "self_exact_agreement"):
        assert key in out
    text = cli("judge", "eval", cfg, "--fixtures", "fixtures.jsonl", check=0).stdout
    assert "Kendall tau" in text and "pass 1 vs pass 2" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "completions": ["a", "b"], "labels": [1]}\n')
    r = cli("judge", "eval", cfg, "--fixtures", bad)
    assert r.returncode == 2 and "bad.jsonl:1" in r.stderr and "'labels' must be 2 numbers" in r.stderr


def test_a_dead_judge_stops_the_run_with_the_reason_not_a_hang(tmp_path, tiny_model, cli):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    s.close()
    cfg = write_grpo_run(tmp_path, tiny_model, judge_table(url, max_retries=1, timeout_seconds=2), updates=2)
    t0 = time.monotonic()
    r = cli("train", cfg)
    assert r.returncode == 2 and time.monotonic() - t0 < 60
    assert "max_judge_dropped_fraction = 0.5" in r.stderr and "ConnectionRefusedError" in r.stderr
    cfg.write_text(cfg.read_text().replace("judge_weight = 1.0", 'judge_weight = 1.0\njudge_failure = "fail"'))
    r = cli("train", cfg)
    assert r.returncode == 2 and 'judge_failure = "fail"' in r.stderr and "prompts.jsonl" in r.stderr


@pytest.mark.parametrize("extra, message", [
    ("[grpo]\njudge_weight = 0.5\n", "add a [grpo.judge] table"),
    ('[grpo.judge]\nbase_url = "http://x/v1"\nmodel = "m"\n', "needs grpo.judge_weight"),
    ('[grpo]\njudge_weight = 1.0\n[grpo.judge]\nbase_url = "ftp://x"\nmodel = "m"\n', "must start with http://"),
    ('[grpo]\njudge_weight = 1.0\n[grpo.judge]\nbase_url = "http://x/v1"\nmodel = "m"\napi_key = "sk-1"\n', "api_key"),
])
def test_judge_configs_that_cannot_work_are_refused(tmp_path, tiny_model, cli, extra, message):
    r = cli("train", write_grpo_run(tmp_path, tiny_model, extra, updates=1))
    assert r.returncode == 2 and message in r.stderr, r.stderr
