"""malloc.keep_freed_memory: glibc keeps what a pass frees, so the next passes touch no fresh pages.

Each case runs in its own interpreter, since malloc settings are process-wide and cannot be undone.
A "pass" allocates 60 tensors of 0.3-48 MiB (48 is above the largest mmap threshold glibc accepts,
as an LM head's logits chunk or a full fine-tune's embedding gradient is), freeing every third one
on the way as a forward's temporaries go, then frees the rest, as the backward does; five passes
with the same seeded sizes.
Counted: the minor page faults of passes 3 and 4, against the pages they touch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = r"""
import random, resource, torch
from retrograd.malloc import keep_freed_memory
print("set", keep_freed_memory())
rng, faults, pages = random.Random(0), 0, 0
for round in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    sizes = [rng.choice([0.3, 1, 2.8, 6, 12, 24, 48]) for _ in range(60)]  # MiB
    blocks = []
    for i, mib in enumerate(sizes):
        blocks.append(torch.ones(int(mib * 262144)))
        if i % 3 == 2:
            blocks.pop(rng.randrange(len(blocks)))
    del blocks
    if round in (2, 3):
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        pages += int(sum(sizes) * 256)
print("faults", faults)
print("pages", pages)
"""
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc setting")


def probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RETROGRAD_KEEP_FREED_MEMORY"}
    if env_value is not None:
        env["RETROGRAD_KEEP_FREED_MEMORY"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True).stdout
    fields = dict(line.split(" ", 1) for line in out.splitlines())
    return {"set": fields["set"] == "True", "faults": int(fields["faults"]), "pages": int(fields["pages"])}


@linux_only
def test_later_passes_reuse_freed_memory_instead_of_faulting_in_fresh_pages():
    kept, default = probe(None), probe("0")
    assert kept["set"] and not default["set"]  # RETROGRAD_KEEP_FREED_MEMORY=0 opts out
    assert kept["pages"] == default["pages"]  # the same work on both sides
    assert kept["faults"] < kept["pages"] // 20, kept
    # measured 0 kept; 89k with the mmap threshold and no trimming alone (the 48 MiB blocks mapped fresh each
    # time); glibc's defaults trim and re-map: 270k (of 407k pages)
    assert default["faults"] > 5 * max(kept["faults"], 1000), (kept, default)


def test_the_cli_applies_it_before_torch_is_imported():
    script = ("import sys; import retrograd.malloc as m; calls = []\n"
              "m.keep_freed_memory = lambda: calls.append('torch' in sys.modules) or True\n"
              "from retrograd.cli.main import main\n"
              "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
              "print(calls)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[False]", out
