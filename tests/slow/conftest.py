import os
from pathlib import Path

import pytest


@pytest.fixture
def real_home(monkeypatch):
    # the built-in model is cached in the user's real cache, so it is fetched once per machine
    home = os.environ.get("RETROGRAD_SLOW_HOME") or str(Path.home() / ".cache" / "retrograd")
    monkeypatch.setenv("RETROGRAD_HOME", home)
    return Path(home)


@pytest.fixture
def threads() -> str:
    """Threads for a run of the real model: the cores shared out among pytest-xdist's workers. Two 2-thread
    runs on 2 cores spin-wait on each other (OpenMP): the pair took 19 minutes instead of ~2 each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return str(max(1, (os.cpu_count() or 1) // workers))
