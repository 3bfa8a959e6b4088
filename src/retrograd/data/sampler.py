"""The order in which rows are visited: a pure function of (seed, epoch), so resuming needs only
the epoch and the cursor (rows already consumed in that epoch), never a saved iterator."""
from __future__ import annotations

import numpy as np


def epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Row indices for one epoch. Shuffled with a generator seeded by (seed, epoch)."""
    if not shuffle:
        return list(range(n_rows))
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFF, epoch]))
    return rng.permutation(n_rows).tolist()


def steps_per_epoch(n_rows: int, rows_per_step: int) -> int:
    """Optimizer steps in one epoch; the last step of an epoch may take fewer rows."""
    return -(-n_rows // rows_per_step)


def evenly_spaced(n_rows: int, k: int | None) -> list[int]:
    """At most k row indices spread evenly over the data (for evaluation.max_examples)."""
    if k is None or k >= n_rows:
        return list(range(n_rows))
    return [int(i * n_rows / k) for i in range(k)]
