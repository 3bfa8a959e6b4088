"""run.toml loading: strict keys with close matches, types, ranges, overrides, paths."""
from pathlib import Path

import pytest

from retrograd.config.load import load_config, parse_override, trajectory_settings
from retrograd.errors import ConfigError

BASE = """
[run]
algorithm = "sft"
[model]
path = "smollm2-135m-instruct"
[output]
path = "out/adapter"
[training]
lr = 2e-4
[sft]
data = "train.jsonl"
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.toml"
    p.write_text(text)
    return p


def error_of(tmp_path, text, overrides=None) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), overrides)
    return str(e.value)


def test_valid_config_resolves_paths_and_defaults(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.training.lr == 2e-4
    assert cfg.training.trainable == "lora" and cfg.lora.rank == 8  # absent [lora] = defaults
    assert cfg.sft.data == str(tmp_path / "train.jsonl")
    assert cfg.output.path == str(tmp_path / "out" / "adapter")
    assert cfg.model.path == "smollm2-135m-instruct"  # an alias stays an alias
    assert cfg.run.name == "run" and cfg.run.directory == str(tmp_path / "runs" / "run")


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_malformed_toml_names_the_line(tmp_path):
    msg = error_of(tmp_path, BASE + "\nbroken = = 1\n")
    assert "run.toml:13:" in msg and "malformed TOML" in msg and "broken = = 1" in msg


def test_unknown_key_suggests_the_closest(tmp_path):
    msg = error_of(tmp_path, BASE.replace("lr = 2e-4", "learning_rat = 2e-4"))
    assert "unknown key 'learning_rat' in [training]" in msg
    msg = error_of(tmp_path, BASE.replace("lr = 2e-4", "warmup_step = 3"))
    assert "did you mean 'warmup_steps'" in msg


def test_unknown_table_suggests_the_closest(tmp_path):
    msg = error_of(tmp_path, BASE + "\n[trainig]\nlr = 1\n")
    assert "unknown table [trainig]" in msg and "did you mean 'training'" in msg


def test_wrong_type_and_range(tmp_path):
    assert "training.lr: expected a number, got 'fast'" in error_of(tmp_path, BASE.replace("2e-4", '"fast"'))
    assert "out of range (must be > 0" in error_of(tmp_path, BASE.replace("2e-4", "-1.0"))
    assert "expected an integer" in error_of(tmp_path, BASE + "\n[lora]\nrank = 2.5\n")
    msg = error_of(tmp_path, BASE.replace("lr = 2e-4", 'lr_scheduler = "cosin"'))
    assert "'cosin' is not one of" in msg and "did you mean 'cosine'" in msg


def test_required_keys_and_tables(tmp_path):
    assert "missing the required key 'data'" in error_of(tmp_path, BASE.replace('data = "train.jsonl"', "shuffle = true"))
    assert "missing table [output]" in error_of(tmp_path, BASE.replace("[output]\npath = \"out/adapter\"", ""))


def test_algorithm_tables_must_match(tmp_path):
    msg = error_of(tmp_path, BASE + '\n[grpo]\nupdates = 3\n')
    assert "[grpo] does not apply to run.algorithm = 'sft'" in msg
    assert "not available in this version" in error_of(tmp_path, BASE.replace('"sft"', '"agent_grpo"'))
    assert "needs a [grpo] table" in error_of(tmp_path, BASE.replace('"sft"', '"grpo"').split('[sft]')[0])


def test_checkpoint_cross_checks(tmp_path):
    msg = error_of(tmp_path, BASE + '\n[checkpoint]\ndirectory = "c"\nmode = "steps"\n')
    assert "needs checkpoint.every_steps" in msg
    msg = error_of(tmp_path, BASE + '\n[checkpoint]\ndirectory = "c"\nmode = "best_eval"\n')
    assert "needs an [evaluation] table" in msg


def test_foreign_retrograd_rs_key_gets_a_hint(tmp_path):
    msg = error_of(tmp_path, BASE.replace("lr = 2e-4", "chunked_cross_entropy = true"))
    assert "training.chunked_cross_entropy" in msg and "remove the key" in msg
    msg = error_of(tmp_path, BASE + '\n[lora]\ninit_adapter = "a.gguf"\nrank = 4\n')
    assert "lora.rank cannot be set together with lora.init_adapter" in msg


def test_overrides(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["training.lr=1e-5", "training.lr_scheduler=cosine",
                                              "lora.targets=['q', 'v']", "sft.shuffle=false"])
    assert cfg.training.lr == 1e-5 and cfg.training.lr_scheduler == "cosine"
    assert cfg.lora.targets == ["q", "v"] and cfg.sft.shuffle is False
    assert "did you mean 'lr'" in error_of(tmp_path, BASE, ["training.lrr=1"])
    assert parse_override("a.b=3") == (["a", "b"], 3)
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("training.lr")


def test_trajectory_settings_leave_out_bookkeeping(tmp_path):
    a = trajectory_settings(load_config(write(tmp_path, BASE)))
    b = trajectory_settings(load_config(write(tmp_path, BASE + '\n[metrics]\ntensorboard_dir = "tb"\n'),
                                        ["training.threads=3", "run.directory=elsewhere"]))
    assert a == b
    c = trajectory_settings(load_config(write(tmp_path, BASE), ["training.lr=1e-3"]))
    assert c["training.lr"] == 1e-3 and a != c


def test_gguf_output_and_full_with_lora_are_refused_clearly(tmp_path):
    cfg = load_config(write(tmp_path, BASE.replace('"out/adapter"', '"out/a.gguf"')))
    from retrograd.config.load import output_kind
    assert output_kind(cfg) == "adapter"
    full_gguf = BASE.replace('"out/adapter"', '"out/a.gguf"').replace("lr = 2e-4", 'trainable = "full"')
    assert output_kind(load_config(write(tmp_path, full_gguf))) == "model"  # built-in base: a GGUF model
    hf_base = load_config(write(tmp_path, full_gguf.replace('"smollm2-135m-instruct"', '"/some/hf-folder"')))
    assert output_kind(hf_base) == "model"  # written from the folder's config + tokenizer
    msg = error_of(tmp_path, full_gguf.replace("[output]", '[output]\nkind = "adapter"'))
    assert "output.kind = 'adapter' needs training.trainable = 'lora'" in msg
    msg = error_of(tmp_path, BASE.replace("lr = 2e-4", 'trainable = "full"') + "\n[lora]\nrank = 4\n")
    assert "[lora] does not apply to training.trainable = 'full'" in msg


def test_json_schema_lists_every_table_and_key():
    from retrograd.config.load import json_schema
    s = json_schema()
    assert set(s["properties"]) == {"run", "model", "output", "lora", "training", "sft", "preference", "grpo", "ppo", "distill", "reference", "backpressure",
                                    "evaluation", "checkpoint", "metrics", "distributed"}
    assert s["properties"]["preference"]["properties"]["loss"]["enum"] == ["dpo", "ipo", "simpo", "orpo"]
    lr = s["properties"]["training"]["properties"]["lr"]
    assert lr["type"] == "number" and lr["exclusiveMinimum"] == 0
    assert s["properties"]["sft"]["required"] == ["data"]
    assert s["properties"]["distributed"]["properties"]["strategy"]["enum"] == ["auto", "none", "ddp", "fsdp2"]


def test_export_refuses_an_existing_target_and_a_full_disk(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    from retrograd.export.from_checkpoint import _check_target
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError, match="already exists; pass --force"):
        _check_target(tmp_path / "exists", False, 10)
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100, 90, 10))
    with pytest.raises(ConfigError, match="not enough disk space"):
        _check_target(tmp_path / "new", False, 10_000_000)


GRPO = """
[run]
algorithm = "grpo"
[model]
path = "smollm2-135m-instruct"
[output]
path = "out/adapter"
[grpo]
prompts = "builtin:arithmetic"
rewards = [{ type = "match" }]
"""


@pytest.mark.parametrize("transform", ["none", "gtpo", "gtpo_hicra", "gtpo_sepa", "gtpo_sepa_amp_c", "entropy_mask",
                                       "delight", "delight_sepa", "hard_delight"])
def test_resolved_grpo_config_round_trips(tmp_path, transform):
    """The run folder's config.toml (the resolved config) loads back to the same resolved settings,
    sub-tables with unset (None) keys included."""
    from retrograd.config.load import dump_toml
    cfg = load_config(write(tmp_path, GRPO), [f"grpo.transform_mode={transform}", "grpo.advantage_mode=maxrl"])
    again = load_config(write(tmp_path, dump_toml(cfg)))
    assert trajectory_settings(again) == trajectory_settings(cfg)
    assert again.grpo.transform_mode == transform and again.grpo.advantage_mode == "maxrl"


def test_grpo_synonyms_and_recipes_resolve_to_modes(tmp_path):
    g = lambda *o: load_config(write(tmp_path, GRPO), list(o)).grpo  # noqa: E731
    assert (g().advantage_mode, g().transform_mode, g().uncertainty_kind) == ("grpo", "none", None)
    assert g('grpo.baseline="rloo"').advantage_mode == "rloo"
    assert g('grpo.scale_rewards="std"').advantage_mode == "grpo_std"
    r = g('grpo.algorithm_mode="maxrl_gtpo_sepa"')
    assert (r.advantage_mode, r.transform_mode) == ("maxrl", "gtpo_sepa")
    assert r.sepa == {"steps": 500, "schedule": "linear", "delay_steps": 50, "correct_rate_gate": 0.1}
    assert r.gtpo == {"beta": 0.1} and r.hicra is None and r.planning["detector"] == "regex"
    assert g('grpo.importance_sampling_level="sequence"').policy_loss == "gspo"
    assert g('grpo.policy_loss="ppo"').policy_loss == "clip"  # an alias, stored by its name
    assert g('grpo.policy_loss="sapo"').policy_loss_params == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert g('grpo.uncertainty_kind="entropy"', 'grpo.transform_mode="gtpo"').uncertainty_kind == "shannon_entropy"


def test_every_example_config_loads():
    """The examples are what users copy first: each must pass the config checks as shipped."""
    from pathlib import Path

    from retrograd.config import load_config
    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert {"quickstart.toml", "grpo.toml", "dpo.toml", "ppo.toml", "distill.toml", "distill-topk.toml", "grpo-judge.toml"} <= {
        p.name for p in examples}
    for path in examples:
        cfg = load_config(path)
        assert cfg.run.algorithm in ("sft", "preference", "grpo", "ppo", "distill"), path
