"""`retrograd squeeze` on the three adapter formats a run writes (PEFT folder, llama.cpp GGUF adapter,
.state checkpoint) of a tiny SFT run: the report, the compressed adapter in the same format with
alpha / r kept, equal to the original at full rank (logits of the adapted model) and losing exactly
the reported variance below it; bad input refused by name."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tiny import write_run


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    from tiny import CLI
    tmp = tmp_path_factory.mktemp("squeeze")
    cfg = write_run(tmp, tiny_model, '[training]\nlr = 0.05\n[checkpoint]\ndirectory = "ckpt"\nmode = "steps"\n'
                                     'every_steps = 8\n', steps=8)
    CLI(tmp)("train", cfg, check=0)
    CLI(tmp)("train", cfg, "--set", 'output.path="out/adapter.gguf"', "--set", 'checkpoint.directory="ckpt2"', check=0)
    return tmp


def product(tensors, a_tag, b_tag):
    return {k: tensors[k.replace(a_tag, b_tag)].double() @ v.double() for k, v in tensors.items() if a_tag in k}


def test_peft_report_and_compression(trained, cli):
    out = json.loads(cli("squeeze", trained / "out" / "adapter", "--json", check=0).stdout)
    assert out["format"] == "peft" and out["source_rank"] == 4 and out["target_ranks"] == [1, 2, 4]
    assert out["layers"] == 14 and out["mean_retained"]["4"] == pytest.approx(1.0)
    assert 0 < out["mean_retained"]["1"] < out["mean_retained"]["2"] < 1.0
    full = cli("squeeze", trained / "out" / "adapter", "--rank", "4", "--out", trained / "sq4", check=0)
    assert "alpha / r kept" in full.stdout
    before = product(load_file(trained / "out" / "adapter" / "adapter_model.safetensors"), "lora_A", "lora_B")
    after4 = product(load_file(trained / "sq4" / "adapter_model.safetensors"), "lora_A", "lora_B")
    assert all(torch.allclose(before[k], after4[k], atol=1e-5) for k in before)
    cli("squeeze", trained / "out" / "adapter", "--rank", "2", "--out", trained / "sq2", check=0)
    cfg = json.loads((trained / "sq2" / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["lora_alpha"] == pytest.approx(8 * 2 / 4)  # alpha / r = 2 kept
    after2 = product(load_file(trained / "sq2" / "adapter_model.safetensors"), "lora_A", "lora_B")
    lost = sum(float(((before[k] - after2[k]) ** 2).sum()) for k in before)
    norm = {k: float((before[k] ** 2).sum()) for k in before}
    per_layer = out["per_layer"]
    expected = sum((1 - per_layer[k.replace(".lora_A", "")]["2"]) * norm[k] for k in before)
    assert lost == pytest.approx(expected, rel=1e-4)
    # the compressed adapter loads where adapters load: `retrograd eval --adapter`
    r = json.loads(cli("eval", trained / "run.toml", "--adapter", trained / "sq2", "--data", trained / "eval.jsonl",
                       "--json", check=0).stdout)
    assert r["trained_from"].endswith("sq2") and r["trained/loss"] > 0


def test_gguf_and_state_adapters(trained, cli):
    g = json.loads(cli("squeeze", trained / "out" / "adapter.gguf", "--rank", "2", "--out", trained / "sq.gguf",
                       "--json", check=0).stdout)
    assert g["format"] == "gguf" and g["compressed_alpha"] == pytest.approx(4.0)
    import gguf
    reader = gguf.GGUFReader(str(trained / "sq.gguf"))
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["adapter.type"] == "lora" and fields["adapter.lora.alpha"] == pytest.approx(4.0)
    assert {int(t.shape[1]) for t in reader.tensors if t.name.endswith(".lora_a")} == {2}  # ggml ne = [in, r]
    state = sorted((trained / "ckpt").glob("step-*.state"))[-1]
    s = json.loads(cli("squeeze", state, "--rank", "4", "--out", trained / "from-state", "--json", check=0).stdout)
    assert s["format"] == "state" and (trained / "from-state" / "adapter_config.json").exists()
    a = product({k.replace(".default", ""): v for k, v in load_file(state / "weights.safetensors").items()},
                "lora_A", "lora_B")
    b = product(load_file(trained / "from-state" / "adapter_model.safetensors"), "lora_A", "lora_B")
    assert set(a) == set(b) and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_bad_input_is_refused_by_name(trained, cli):
    r = cli("squeeze", trained / "nothing")
    assert r.returncode == 2 and "no such file or folder" in r.stderr
    r = cli("squeeze", trained / "out" / "adapter", "--target-ranks", "1,9")
    assert r.returncode == 2 and "outside 1..4" in r.stderr
    r = cli("squeeze", trained / "out" / "adapter", "--target-ranks", "two")
    assert r.returncode == 2 and "--target-ranks" in r.stderr
    r = cli("squeeze", trained / "train.jsonl")
    assert r.returncode == 2 and "expected a PEFT adapter folder" in r.stderr
