"""What a new user hit (issue 16), run as they would: output paths that cannot work are refused before
the model loads, naming the key; non-finite numbers are config errors; evaluation and RL progress
reach the terminal; every_iterations counts updates in GRPO; `eval --adapter MISSING` names the
flag; [run] verbose prints every metric."""
import json

import pytest

from tiny import write_grpo_run, write_run


@pytest.mark.parametrize("extra, key", [
    ('[metrics]\ntensorboard_dir = "tb-file"\n', "metrics.tensorboard_dir"),
    ('[metrics]\nwandb_export_dir = "tb-file"\n', "metrics.wandb_export_dir"),
    ('[run]\ndirectory = "tb-file"\n', "run.directory"),
    ('[checkpoint]\ndirectory = "tb-file"\nmode = "steps"\nevery_steps = 2\n', "checkpoint.directory"),
    ('[output]\npath = "tb-file"\n', "output.path"),
    ('[output]\npath = "a-folder.gguf"\n', "output.path"),
])
def test_output_paths_are_checked_before_the_model_loads(tmp_path, tiny_model, cli, extra, key):
    (tmp_path / "tb-file").write_text("not a folder")
    (tmp_path / "a-folder.gguf").mkdir()
    r = cli("train", write_run(tmp_path, tiny_model, extra))
    assert r.returncode == 2 and key in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "parameters" not in r.stdout  # refused before the model loaded


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_config_errors(tmp_path, tiny_model, cli, value):
    r = cli("train", write_run(tmp_path, tiny_model, f"[training]\nlr = {value}\n"))
    assert r.returncode == 2 and "training.lr" in r.stderr and "not a finite number" in r.stderr


def test_grpo_progress_and_evaluation_reach_the_terminal(tmp_path, tiny_model, cli):
    extra = ('[evaluation]\ndata = "prompts.jsonl"\nevery_iterations = 2\nmax_examples = 4\n'
             '[grpo]\nrewards = [{ type = "match", extract = "exact", weight = 0.0 }, '
             '{ type = "python", function = "tiny_rewards:share_of_lowercase" }]\n[run]\nverbose = true\n')
    out = cli("train", write_grpo_run(tmp_path, tiny_model, extra, updates=4), check=0).stdout
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all(" reward " in s and " acc " in s for s in steps)
    evals = [line for line in out.splitlines() if line.startswith("eval  step")]
    assert [e.split()[2] for e in evals] == ["0/4", "2/4", "4/4"]  # every_iterations = 2 counts updates
    assert all("eval/mean_reward" in e for e in evals) and "(best" in evals[-1]
    assert "  policy/loss " in out  # [run] verbose: every metric
    rows = [json.loads(x) for x in (tmp_path / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/mean_reward" in r] == [0, 2, 4]


def test_eval_with_a_missing_adapter_names_the_flag(tmp_path, tiny_model, cli):
    r = cli("eval", write_run(tmp_path, tiny_model), "--adapter", "no/such/adapter")
    assert r.returncode == 2 and "--adapter no/such/adapter: no such file or folder" in r.stderr
    assert "init_adapter" not in r.stderr


def test_config_schema_has_defaults_and_only_the_algorithms_that_run(tmp_path, cli):
    schema = json.loads(cli("config-schema", check=0).stdout)
    assert schema["properties"]["training"]["properties"]["lr"]["default"] == 1e-4
    assert schema["properties"]["grpo"]["properties"]["group_size"]["default"] == 8
    assert "agent_grpo" not in schema["properties"]["run"]["properties"]["algorithm"]["enum"]
    assert schema["properties"]["grpo"]["properties"]["judge"]["properties"]["mode"]["default"] == "pointwise"
