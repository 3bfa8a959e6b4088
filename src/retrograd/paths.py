"""Where retrograd keeps its cache (`$RETROGRAD_HOME`, default ~/.cache/retrograd)."""
from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    p = Path(os.environ.get("RETROGRAD_HOME") or Path.home() / ".cache" / "retrograd")
    p.mkdir(parents=True, exist_ok=True)
    return p
