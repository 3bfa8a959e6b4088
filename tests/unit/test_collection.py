"""The test command collects every test file: a folder pytest skips by default (`dist`, `build`, ...)
once kept the 2-process tests out of CI without a word. And it queues the longest tests first."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def collected() -> list[str]:
    """The node ids the default command collects, in its order (one collection for both tests)."""
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return [line for line in p.stdout.splitlines() if line.startswith("tests/") and "::" in line]


def test_the_default_command_collects_every_test_file(collected):
    files = {line.split("::")[0] for line in collected}
    on_disk = {str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")}
    assert on_disk == files, sorted(on_disk ^ files)


def test_the_longest_tests_are_queued_first(collected):
    """conftest's ordering: real-model runs, then 2-process runs, then the rest (see its docstring)."""
    folders = [line.split("/")[1] for line in collected]
    firsts = [f for i, f in enumerate(folders) if i == 0 or folders[i - 1] != f]
    assert firsts[:2] == ["slow", "distributed"] and "slow" not in firsts[2:] and "distributed" not in firsts[2:], firsts[:6]
