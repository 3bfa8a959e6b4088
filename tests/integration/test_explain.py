"""`retrograd explain`: where each value came from, data and steps, an estimate, warnings; no weights loaded."""
import json

from tiny import write_grpo_run, write_run


def test_explain_sources_steps_and_warnings(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, steps=None)
    e = json.loads(cli("explain", cfg, "--set", "training.lr=0.5", "--json", check=0).stdout)
    v = e["values"]
    assert v["training.lr"] == {"value": 0.5, "source": "--set"}
    assert v["training.batch_size"]["source"] == "file" and v["training.seed"]["source"] == "default"
    assert e["data"]["rows"] == 24 and e["steps"] == 6  # 24 rows / (2 x 2 accumulation), one epoch
    assert e["model"]["params"] > 0 and e["estimate"]["seconds_per_step"] > 0
    assert any("[checkpoint]" in w for w in e["warnings"]) and any("[evaluation]" in w for w in e["warnings"])
    text = cli("explain", cfg, check=0).stdout
    assert "resolved config" in text and "estimate on this machine" in text
    r = cli("explain", cfg, "--set", "training.lr=nan")
    assert r.returncode == 2 and "training.lr" in r.stderr


def test_explain_a_grpo_run(tmp_path, tiny_model, cli):
    e = json.loads(cli("explain", write_grpo_run(tmp_path, tiny_model, updates=5), "--json", check=0).stdout)
    assert e["steps"] == 5 and e["sampled_tokens_per_step"] == 2 * 4 * 8  # prompts x group x max_new_tokens
