"""The C allocator's process-wide settings: `keep_freed_memory`, applied once when the CLI starts.

Kept free of torch so that `retrograd`'s entry point can apply it before anything large is allocated.
"""
from __future__ import annotations

import ctypes
import os
import sys

# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it accepts on 64-bit (HEAP_MAX_SIZE / 2)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
MMAP_THRESHOLD_BYTES = 32 << 20
NEVER_TRIM_BYTES = 2 ** 31 - 1
NO_MMAPPED_BLOCKS = 0
KEEP_FREED_MEMORY_ENV = "RETROGRAD_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Have glibc keep the memory a pass frees for the next pass instead of handing it back to the kernel.

    By default glibc trims the top of its heap once more than twice its (adaptive) mmap threshold is
    free there, and serves blocks above that threshold with fresh mmaps: a forward's activations then
    often arrive as new pages, each a page fault on first touch. On a 2-core AMD EPYC VM of this
    machine kind a fault cost 3.1-3.6 us; a 30-layer MLP chain at GRPO's training shapes took 75k of
    them a pass, and its SiLU and product ran 2.5-4x slower than on reused pages. With a fixed 32 MiB
    mmap threshold and no trimming, later passes reuse the same pages (0 faults there). Blocks above
    the largest threshold glibc accepts (32 MiB) would still be fresh mmaps every time: the LM head's
    [256, 49152] logits chunk (12.3k faults a DPO or SFT step), a full fine-tune's 113 MB embedding
    gradient and its neighbours (~100k faults a step, ~0.4 s of ~8). So no block is mmap'd at all
    (M_MMAP_MAX = 0): every block comes from the heap and is reused, and those steps fault 0 times.
    (Should the heap be unable to grow, glibc still falls back to mmap.) Peak RSS did not rise for
    LoRA (1.84 GB either way) and rose 4 % for a full fine-tune (3.61 -> 3.75 GB: the heap holds its
    fragments); the process does not shrink after its peak. Values are unaffected. Set before the
    process allocates much (the CLI's first step): set later, glibc's heap is already laid out by
    the model's loading and the gain did not show in an A/B.

    RETROGRAD_KEEP_FREED_MEMORY=0 keeps glibc's defaults. -> whether it was set (False off Linux/glibc)."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already uses
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM_BYTES))
            and bool(mallopt(M_MMAP_MAX, NO_MMAPPED_BLOCKS)))
