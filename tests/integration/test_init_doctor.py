"""`retrograd init` writes starter files that load as written (and stay the shipped examples, byte for
byte); `retrograd doctor` reports the machine and exits 0 when the basics work."""
import json
from pathlib import Path

import pytest

from retrograd.cli.init import TEMPLATES, template_text

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_are_the_examples(name):
    assert template_text(name) == (EXAMPLES / TEMPLATES[name][1]).read_text(encoding="utf-8"), (
        f"src/retrograd/templates/{TEMPLATES[name][0]} differs from examples/{TEMPLATES[name][1]}: copy one over the other")


@pytest.mark.parametrize("name", ["sft", "dpo", "grpo", "ppo", "distill"])
def test_init_writes_a_config_that_loads(tmp_path, cli, name):
    out = cli("init", "--template", name, "--out", "mine.toml", check=0).stdout
    assert "retrograd train mine.toml" in out
    from retrograd.config import load_config
    cfg = load_config(tmp_path / "mine.toml")
    assert cfg.run.algorithm == {"sft": "sft", "dpo": "preference"}.get(name, name)
    assert "retrograd train mine.toml" in (tmp_path / "mine.toml").read_text().splitlines()[0]


def test_init_refuses_to_overwrite_and_writes_the_service_client(tmp_path, cli):
    cli("init", check=0)
    r = cli("init")
    assert r.returncode == 2 and "run.toml exists" in r.stderr and "--force" in r.stderr
    cli("init", "--force", check=0)
    cli("init", "--template", "service", check=0)
    assert "import tinker" in (tmp_path / "train_sft.py").read_text() or "tinker" in (tmp_path / "train_sft.py").read_text()


def test_doctor(cli):
    d = json.loads(cli("doctor", "--json", check=0).stdout)
    assert d["ok"] is True and d["torch"] and d["matmul_fp32_gflops"] > 0
    from retrograd.models.cpu_gemm import fp32_gemm_library
    assert d["fp32_gemm_library"] == fp32_gemm_library()  # the machine's choice, as training makes it
    assert set(d["extras"]) >= {"service", "plot", "semantic"}
    assert all("pip install 'retrograd[" in e["install"] for e in d["extras"].values())
    text = cli("doctor", check=0).stdout
    assert "the basics work" in text and "optional extras:" in text
