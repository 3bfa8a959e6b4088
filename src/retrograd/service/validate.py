"""Checks on what a client sends, each failing with a 400 that names the field and what it should be,
so a sloppy client's mistake is never a 500, never labelled a server error, and never reaches the
model (a NaN learning rate would ruin it).
"""
from __future__ import annotations

import math

from retrograd.service.errors import HttpError


def _bad(field: str, want: str, got) -> HttpError:
    shown = repr(got)
    return HttpError(400, f"{field} must be {want}, got {shown[:80]}")


def integer(body: dict, field: str, default=None, *, lo: int | None = None, hi: int | None = None,
            where: str = "") -> int | None:
    v = body.get(field, default)
    name = f"{where}{field}"
    if v is None:
        if default is None and field in body:
            raise _bad(name, "an integer", v)
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _bad(name, "an integer", v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, f"an integer in {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}", v)
    return v


def number(body: dict, field: str, default: float, *, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False, hi_open: bool = False, where: str = "") -> float:
    v = body.get(field, default)
    name = f"{where}{field}"
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
        raise _bad(name, "a finite number", v)
    v = float(v)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise _bad(name, f"{'>' if lo_open else '>='} {lo}", v)
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise _bad(name, f"{'<' if hi_open else '<='} {hi}", v)
    return v


def boolean(body: dict, field: str, default: bool, where: str = "") -> bool:
    v = body.get(field, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"{where}{field}", "true or false", v)
    return v


def string(body: dict, field: str, *, required: bool = True, where: str = "") -> str | None:
    v = body.get(field)
    if v is None and not required:
        return None
    if not isinstance(v, str) or not v:
        raise _bad(f"{where}{field}", "a non-empty string", v)
    return v


def table(body: dict, field: str, where: str = "") -> dict:
    v = body.get(field)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad(f"{where}{field}", "an object", v)
    return v


def token_ids(tokens, field: str, vocab: int) -> list[int]:
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _bad(field, "a list of integer token ids", tokens)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise HttpError(400, f"{field} holds token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")
    return tokens
