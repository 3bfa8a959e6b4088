import os
import subprocess
import sys
from pathlib import Path

import pytest


class CLI:
    def __init__(self, cwd: Path):
        self.cwd = cwd

    def __call__(self, *args, env=None, check=None, timeout=300):
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "retrograd", *map(str, args)], cwd=self.cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc


@pytest.fixture
def cli(tmp_path):
    return CLI(tmp_path)
