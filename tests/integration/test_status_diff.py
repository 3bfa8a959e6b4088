"""`retrograd status` and `retrograd diff` on real run folders of tiny runs, and on damaged ones: a
killed run shows as failed, NaN (null), half-written lines and a truncated status.json never crash
the views; diff shows config differences, last values with winner marks, and curves."""
import json
import os

from tiny import write_run


def test_status_and_diff_of_two_runs(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, "[evaluation]\ndata = \"eval.jsonl\"\nevery_steps = 4\n", steps=8)
    cli("train", cfg, "--set", 'run.name="a"', check=0)
    cli("train", cfg, "--set", 'run.name="b"', "--set", "training.lr=0.0001", "--set", 'output.path="out/b"', check=0)
    runs = json.loads(cli("status", "runs", "--json", check=0).stdout)
    assert {r["name"]: (r["state"], r["step"], r["total"]) for r in runs} == {"a": ("finished", 8, 8),
                                                                             "b": ("finished", 8, 8)}
    assert "eval/loss" in runs[0]["last"]
    text = cli("status", "runs", check=0).stdout
    assert "finished" in text and "8/8" in text

    d = json.loads(cli("diff", "runs/a", "runs/b", "--json", check=0).stdout)
    assert d["config"]["training.lr"] == [0.01, 0.0001]
    m = d["metrics"]["eval/loss"]
    assert m["winner"] == ("a" if m["a"] < m["b"] else "b") and len(m["spark_a"]) > 0
    assert "run.name" not in d["config"]
    text = cli("diff", "runs/a", "runs/b", check=0).stdout
    assert "training.lr" in text and ("◀ A" in text or "B ▶" in text)
    r = cli("diff", "runs/a", "nowhere")
    assert r.returncode == 2 and "not a run folder" in r.stderr


def test_status_survives_damaged_and_killed_runs(tmp_path, cli):
    run = tmp_path / "runs" / "broken"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "train/loss": null}\n'
                                       '{"step": 2, "time": 2.0, "train/loss": NaN}\n{"step": 3, "tra')
    (run / "status.json").write_text('{"state": "running", "pid": 99999999, "host": "')  # cut mid-write
    dead = tmp_path / "runs" / "killed"
    dead.mkdir()
    (dead / "metrics.jsonl").write_text('{"step": 5, "time": 1.0, "train/loss": 0.5}\n')
    (dead / "status.json").write_text(json.dumps({"state": "running", "pid": 99999999, "host": os.uname().nodename,
                                                  "total_steps": 10}))
    runs = {r["name"]: r for r in json.loads(cli("status", "runs", "--json", check=0).stdout)}
    assert runs["broken"]["state"] == "unknown" and runs["broken"]["step"] == 2
    assert runs["killed"]["state"] == "failed" and runs["killed"]["step"] == 5
    assert "failed" in cli("status", "runs", check=0).stdout
    r = cli("status", "nowhere")
    assert r.returncode == 2 and "no such folder" in r.stderr
