"""Run under torchrun by tests/distributed/test_fsdp2.py: rank 0 reads the model, every other rank only builds it
on the meta device; after dist.shard_model each rank's weights, buffers (RoPE's inv_freq is not in the
state dict) and forward equal the model read from disk. Prints META-LOAD-OK <rank> when they do."""
from __future__ import annotations

import sys

import torch

from retrograd import dist
from retrograd.models.load import load_model


def main(model_dir: str) -> None:
    torch.set_num_threads(1)
    world = dist.init("fsdp2", "full", "sft", "cpu", "meta_load_worker")
    model = load_model(model_dir, weights=world.main, log=lambda *_: None).model
    on_meta = [p.is_meta for p in model.parameters()] + [b.is_meta for b in model.buffers()]
    assert all(on_meta) if not world.main else not any(on_meta), f"rank {world.rank}: {on_meta}"
    dist.shard_model(model, torch.device("cpu"))
    disk = load_model(model_dir, log=lambda *_: None).model  # read here only to check against
    for (name, p), (disk_name, q) in zip(model.named_parameters(), disk.named_parameters(), strict=True):
        assert name == disk_name and torch.equal(p.full_tensor(), q), name  # full_tensor: a collective
    buffers = dict(disk.named_buffers())
    assert buffers, "the model has no buffer to check"
    for name, b in model.named_buffers():
        assert torch.equal(b, buffers[name]), name
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, disk(input_ids=ids).logits)
    print(f"META-LOAD-OK {world.rank}", flush=True)
    del model, disk
    dist.teardown()


if __name__ == "__main__":
    main(sys.argv[1])
