import os
from pathlib import Path

import pytest


@pytest.fixture
def real_home(monkeypatch):
    # the built-in model is cached in the user's real cache, so it is fetched once per machine
    home = os.environ.get("RETROGRAD_SLOW_HOME") or str(Path.home() / ".cache" / "retrograd")
    monkeypatch.setenv("RETROGRAD_HOME", home)
    return Path(home)
