"""Read back a `.wandb` file written by wandb in offline mode (for tests of the importer).

Format (wandb 0.31): a 7-byte header (':W&B', magic 0xBEE1, version), then LevelDB-log framing in
32 KiB blocks: chunks of [crc32c u32][length u16][type u8][data], type 1 full / 2 first / 3 middle /
4 last; each assembled payload is a wandb_internal_pb2.Record.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024


def records(path: Path):
    from wandb.proto import wandb_internal_pb2
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", "not a .wandb file"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(pending)
            yield rec
            pending = b""


def read_run(path: Path) -> dict:
    """{"project", "name", "config", "history": [{key: value}], "summary": {key: value}}"""
    out = {"history": [], "summary": {}, "config": {}}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["project"], out["name"] = rec.run.project, rec.run.display_name
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                out["summary"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out
