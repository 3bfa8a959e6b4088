"""Tests run anywhere: one thread, no hub access, a private RETROGRAD_HOME, tiny models built here."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _threads():
    import torch
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _home(tmp_path_factory, monkeypatch):
    # keep fingerprint caches and converted models out of the user's cache; the real SmolLM2
    # tests override this with a shared folder so the model is fetched once per session
    if "RETROGRAD_TEST_KEEP_HOME" not in os.environ:
        monkeypatch.setenv("RETROGRAD_HOME", str(tmp_path_factory.mktemp("home")))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from tiny import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def pytest_collection_modifyitems(config, items):
    """Longest first: the real-model runs, then the 2-process runs, then the rest as collected. With
    pytest-xdist's `worksteal` scheduling (the test command's `--dist worksteal`) an idle worker takes
    half of the other's queue, so the long runs are spread over both workers and the suite ends on a
    short test. The default `load` scheduling once ran every real-model test on one worker: 1157 s of
    tests there against 763 s on the other."""
    def rank(item) -> int:
        if item.get_closest_marker("slow"):
            return 0
        return 1 if "tests/distributed/" in item.nodeid.replace("\\", "/") else 2
    items.sort(key=rank)  # stable: collection order within each rank
