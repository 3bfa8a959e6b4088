"""[backpressure] in a GRPO run: the warm-up sweep of batch sizes, the controller's metrics, its state in
the checkpoint for --resume; refused for algorithms it does not size."""
import json

from tiny import write_grpo_run, write_ppo_run

EXTRA = ('[backpressure]\nenabled = true\nwarmup_steps = 3\nmax_batch_size = 4\n'
         '[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\nevery_steps = 3\n')


def test_grpo_sizes_its_updates_and_checkpoints_the_controller(tmp_path, tiny_model, cli):
    cfg = write_grpo_run(tmp_path, tiny_model, EXTRA, updates=6)
    cli("train", cfg, check=0)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "backpressure/batch_size" in r]
    assert [r["backpressure/batch_size"] for r in steps[:3]] == [1, 2, 4]  # the warm-up sweep
    assert len(steps) == 6 and all(1 <= r["backpressure/batch_size"] <= 4 for r in steps)
    assert steps[-1]["backpressure/throughput"] > 0 and "backpressure/fitted" in steps[-1]
    assert all("backpressure/p_star" in r for r in steps if r["backpressure/fitted"])
    progress = json.loads((tmp_path / "ckpt" / "step-000000000003.state" / "progress.json").read_text())
    assert progress["task"]["backpressure"]["step"] == 3 and len(progress["task"]["backpressure"]["points"]) == 3
    (tmp_path / "out").rename(tmp_path / "out-straight")
    cli("train", cfg, "--resume", str(tmp_path / "ckpt" / "step-000000000003.state"), check=0)
    resumed = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed if "backpressure/batch_size" in r] == [1, 2, 3, 4, 5, 6]


def test_backpressure_is_refused_where_it_does_not_apply(tmp_path, tiny_model, cli):
    r = cli("train", write_ppo_run(tmp_path, tiny_model, "[backpressure]\nenabled = true\n"))
    assert r.returncode == 2 and "[backpressure] sizes GRPO's updates" in r.stderr
