"""A dependency-free TensorBoard event-file writer (scalars only).

An event file is a sequence of TFRecords: [len u64][masked crc32c(len) u32][data][masked crc32c(data) u32],
each data being a serialized `tensorflow.Event` protobuf. The few fields we need are encoded by
hand here, so training never imports tensorboard or protobuf; tests read the files back with the
real `tensorboard` package.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_bytes(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, *, file_version: str | None = None, scalars: dict | None = None) -> bytes:
    msg = struct.pack("<Bd", 1 << 3 | 1, wall_time)  # field 1: double wall_time
    msg += _varint(2 << 3 | 0) + _varint(step)  # field 2: int64 step
    if file_version is not None:
        msg += _field_bytes(3, file_version.encode())
    if scalars:
        summary = b""
        for tag, value in scalars.items():
            v = _field_bytes(1, tag.encode()) + struct.pack("<Bf", 2 << 3 | 5, float(value))  # tag, simple_value
            summary += _field_bytes(1, v)
        msg += _field_bytes(5, summary)
    return msg


class EventWriter:
    def __init__(self, logdir: str | Path):
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self._f = open(self.dir / name, "ab")
        self._write(_event(time.time(), 0, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data)))

    def add_scalars(self, step: int, scalars: dict) -> None:
        clean = {k: v for k, v in scalars.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if clean:
            self._write(_event(time.time(), step, scalars=clean))
            self._f.flush()

    def close(self) -> None:
        self._f.close()
