"""The C allocator's process-wide settings, applied when the CLI starts: `restart_with_reusable_blocks`
(glibc tunables, which only a new process image reads) and then `keep_freed_memory` (mallopt).

Kept free of torch so that `retrograd`'s entry point can apply them before anything large is allocated.
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
# glibc 2.38 made memalign reuse freed blocks (its bug 14581), which is what these tunables work around
REUSABLE_BLOCKS_TUNABLES = ("glibc.malloc.tcache_count=0", "glibc.malloc.mxfast=0")
MEMALIGN_REUSE_FIXED = (2, 38)


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        return (int(version.split(".")[0]), int(version.split(".")[1])) if name == "glibc" else None
    except (AttributeError, ValueError, OSError, IndexError):
        return None


def reusable_blocks_tunables(environ=os.environ, glibc: tuple[int, int] | None = None) -> str | None:
    """The GLIBC_TUNABLES value this process should run under so that a freed tensor's block serves the
    next tensor of its size, or None where nothing is to change (already set, opted out, not glibc, or a
    glibc whose memalign reuses blocks by itself).

    PyTorch allocates every CPU tensor with posix_memalign(64, n). Before 2.38, glibc's memalign asks its
    malloc for n + 64 + 32 bytes, cuts the block to n and frees the slivers around it into the
    thread cache and the fast bins, where no free block is merged with its neighbours. A freed tensor then
    leaves a hole of exactly n: too small for the next posix_memalign(64, n), so each same-sized tensor of the
    next layer or pass is carved elsewhere and the heap grows around holes. An SFT LoRA pass of SmolLM2
    ([2, 256], fp32) used at most ~595 MB of heap at a time while the heap grew to ~895 MB, 201 free
    blocks of one [512, 576] activation each and 102 of one [512, 192] among them (malloc_info at the end of
    a forward). With the thread cache and the fast bins off, the slivers are merged as they are freed,
    a freed tensor's block is large enough for its successor, and the heap stays near what is in use:
    peak RSS of that run 1.67-1.70 GB -> 1.39-1.48 GB (interleaved processes; losses bit for bit equal).
    Python's own small objects do not go through either (pymalloc)."""
    if environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return None
    glibc = glibc if glibc is not None else _glibc_version()
    if glibc is None or glibc >= MEMALIGN_REUSE_FIXED:
        return None
    current = environ.get("GLIBC_TUNABLES", "")
    if any(t.split("=")[0] in current for t in REUSABLE_BLOCKS_TUNABLES):
        return None  # ours, from the restart, or the user's own choice: theirs wins
    return ":".join([t for t in current.split(":") if t] + list(REUSABLE_BLOCKS_TUNABLES))


def restart_with_reusable_blocks() -> None:
    """Re-execute this process (same pid, arguments and environment) under `reusable_blocks_tunables`,
    where that changes anything. glibc reads its tunables only when a process image starts, so the CLI's
    entry point calls this first, before torch is imported: the restart costs one interpreter start-up.
    Returns only when nothing is to change (or the exec failed, when the process goes on as it was)."""
    tunables = reusable_blocks_tunables()
    argv = getattr(sys, "orig_argv", None)
    if tunables is None or not argv or not sys.executable or sys.flags.interactive:
        return
    os.environ["GLIBC_TUNABLES"] = tunables
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execv(sys.executable, argv)
    except OSError:
        return


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

    RETROGRAD_KEEP_FREED_MEMORY=0 keeps glibc's defaults, here and in `reusable_blocks_tunables`. -> whether it
    was set (False off Linux/glibc)."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already uses
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM_BYTES))
            and bool(mallopt(M_MMAP_MAX, NO_MMAPPED_BLOCKS)))
