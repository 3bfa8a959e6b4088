"""`retrograd campaign` on a tiny campaign (2 conditions x 2 seeds, 2 at a time): every run in its own
folder with its own output, a manifest, a summary with mean +- std per condition, squeeze of the first
finished adapter; a campaign killed mid-way and resumed finishes without redoing finished runs;
config mistakes refused before any run starts."""
import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tiny import write_run

CAMPAIGN = """
[campaign]
seeds = [1, 2]
max_steps = 6
parallel = true
max_workers = 2
metrics = ["train/loss", "eval/loss"]
[[campaign.conditions]]
label = "slow"
set = { "training.lr" = 0.001 }
[[campaign.conditions]]
label = "fast"
set = { "training.lr" = 0.03 }
[squeeze]
target_ranks = [1, 2, 4]
"""
BASE_EXTRA = ('[evaluation]\ndata = "eval.jsonl"\nevery_steps = 3\n'
              '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 3\n')


def make(tmp_path, tiny_model, extra=CAMPAIGN):
    cfg = write_run(tmp_path, tiny_model, BASE_EXTRA, name="base.toml")
    (tmp_path / "camp.toml").write_text(cfg.read_text() + extra)
    return tmp_path / "camp.toml"


def test_campaign_runs_every_condition_and_seed_apart(tmp_path, tiny_model, cli):
    out = cli("campaign", make(tmp_path, tiny_model), check=0).stdout
    folder = tmp_path / "campaigns" / "camp"
    m = json.loads((folder / "manifest.json").read_text())
    assert [(r["name"], r["state"]) for r in m["runs"]] == [("slow_s1", "finished"), ("fast_s1", "finished"),
                                                            ("slow_s2", "finished"), ("fast_s2", "finished")]
    for r in m["runs"]:
        rdir = folder / r["folder"]
        assert (rdir / "output" / "adapter_model.safetensors").exists()  # its own output, never a shared path
        assert (rdir / "checkpoints" / "step-000000000006.state").exists()
        cfg = (rdir / "run.toml").read_text()
        assert f"seed = {r['seed']}" in cfg and str(rdir) in cfg
    assert m["squeeze"]["recommended_rank"] in (1, 2, 4)
    rows = list(csv.DictReader(open(folder / "summary.csv")))
    assert [r["condition"] for r in rows] == ["slow", "fast"] and all(r["runs"] == "2" for r in rows)
    fast, slow = float(rows[1]["train/loss mean"]), float(rows[0]["train/loss mean"])
    assert fast < slow  # lr 0.03 learns the tiny task faster than 0.001
    assert "mean ±" in out and "fast" in out and "slow" in out
    again = cli("campaign", tmp_path / "camp.toml")
    assert again.returncode == 2 and "--resume" in again.stderr
    status = json.loads(cli("status", "campaigns", "--json", check=0).stdout)
    assert len(status) == 4 and {s["state"] for s in status} == {"finished"}
    d = json.loads(cli("diff", folder, "slow", "fast", "--json", check=0).stdout)
    assert d["config"]["training.lr"] == [0.001, 0.03]
    plot = json.loads(cli("plot", folder, "--out", "c.png", "--json", check=0).stdout)
    assert sorted(plot["groups"]) == ["fast", "slow"]


def test_a_killed_campaign_resumes_and_keeps_finished_runs(tmp_path, tiny_model, cli):
    path = make(tmp_path, tiny_model, CAMPAIGN.replace("max_steps = 6", "max_steps = 12").replace(
        "max_workers = 2", "max_workers = 1"))
    folder = tmp_path / "campaigns" / "camp"
    proc = subprocess.Popen([sys.executable, "-m", "retrograd", "campaign", str(path)], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:  # wait for one finished run and a checkpoint of the next
        time.sleep(0.5)
        try:
            m = json.loads((folder / "manifest.json").read_text())
        except (OSError, ValueError):
            continue
        states = [r["state"] for r in m["runs"]]
        if "finished" in states and any(any((folder / r["folder"] / "checkpoints").glob("step-*.state"))
                                        for r in m["runs"] if r["state"] == "running"):
            break
    os.killpg(proc.pid, signal.SIGKILL)  # the runner and its runs, mid-way
    proc.wait()
    before = json.loads((folder / "manifest.json").read_text())
    done = [r for r in before["runs"] if r["state"] == "finished"]
    assert done and any(r["state"] == "running" for r in before["runs"])
    cli("campaign", path, "--resume", check=0, timeout=600)
    after = json.loads((folder / "manifest.json").read_text())
    assert all(r["state"] == "finished" for r in after["runs"])
    for r in done:  # not run again
        assert next(a for a in after["runs"] if a["name"] == r["name"])["started"] == r["started"]
    resumed = next(r for r in before["runs"] if r["state"] == "running")
    log = (folder / resumed["folder"] / "stdout.log").read_text()
    assert "resumed from" in log


@pytest.mark.parametrize("extra, message", [
    ("[campaign]\nseeds = []\n[[campaign.conditions]]\nlabel = \"a\"\n", "campaign.seeds"),
    ("[campaign]\nseeds = [1]\n", "[[campaign.conditions]]"),
    ("[campaign]\nseeds = [1]\n[[campaign.conditions]]\nlabel = \"a\"\nset = { \"training.lrr\" = 1 }\n", "lrr"),
    ("[campaign]\nseeds = [1]\nmax_stepz = 3\n[[campaign.conditions]]\nlabel = \"a\"\n", "campaign.max_stepz"),
])
def test_campaign_mistakes_are_refused_before_any_run(tmp_path, tiny_model, cli, extra, message):
    r = cli("campaign", make(tmp_path, tiny_model, extra))
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not list((tmp_path / "campaigns").glob("camp/runs/*/stdout.log"))
