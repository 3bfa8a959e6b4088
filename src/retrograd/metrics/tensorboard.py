"""TensorBoard scalars through tensorboardX (a maintained writer: protobuf framing, CRC32C, flushing).

`EventWriter(logdir, resume_step)`: on a fresh run (resume_step 0) an earlier run's event files in
`logdir` are moved aside to `<logdir>-<time>` (TensorBoard would otherwise draw two runs as one, as
metrics.jsonl's earlier file is moved aside); on a resume, the points the interrupted run logged
after the checkpoint it resumes from are purged (tensorboardX's purge_step), so a resumed run reads
as one run there too.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


class EventWriter:
    def __init__(self, logdir: str | Path, resume_step: int = 0):
        from tensorboardX import SummaryWriter
        self.dir = Path(logdir)
        if resume_step == 0 and self.dir.is_dir() and any(self.dir.glob("events.out.tfevents.*")):
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.dir.stat().st_mtime))
            self.dir.rename(self.dir.with_name(f"{self.dir.name}-{stamp}"))
        self.dir.mkdir(parents=True, exist_ok=True)
        # purge_step T drops every earlier point at step >= T: the resumed run logs T on again
        # tensorboardX names files by the second: a suffix keeps two writers of one second apart
        self._w = SummaryWriter(str(self.dir), purge_step=resume_step + 1 if resume_step else None, flush_secs=10,
                                filename_suffix=f".{os.getpid()}.{time.time_ns()}")

    def add_scalars(self, step: int, scalars: dict) -> None:
        for tag, value in scalars.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._w.add_scalar(tag, float(value), global_step=step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()
