"""Registries of the RL maths, picked by name from the config (as verl's `core_algos.py` does):
policy losses, episode advantages, token transforms and uncertainty signals.

A built-in registers itself where it is defined:

    @POLICY_LOSSES.register("cispo", defaults={...}, help="...")
    def cispo(logp, old_logp, advantages, mask, params): ...

A config may instead name a user's function by dotted path, `"my_module:my_fn"` (or
`"my_module.my_fn"`): it is imported with the TOML's folder on `sys.path` and must have the
registry's signature (each registry states it). `retrograd plugins` lists every registry.

This module holds the mechanism only; each registry lives beside its functions
(algorithms/policy_losses.py, algorithms/advantages.py, algorithms/transforms.py).
"""
from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


class PluginError(ValueError):
    """A name that is neither registered nor an importable `module:function` (the config layer
    turns it into a ConfigError naming the key)."""


def is_dotted(name: str) -> bool:
    """`module:function` or `package.module.function` names a user's function, not a built-in."""
    return ":" in name or "." in name


def import_object(spec: str, search_path: Path | str | None = None, what: str = "function") -> Callable:
    """Import `module:name` (or `module.name`) with `search_path` (the TOML's folder) first on
    sys.path; the object must be callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{spec!r} must be 'module:name' or 'module.name'")
    if search_path is not None and str(search_path) not in sys.path:
        sys.path.insert(0, str(search_path))
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        where = f"; the TOML's folder {search_path} is on the import path" if search_path is not None else ""
        raise PluginError(f"cannot import {spec!r} ({e}){where}") from None
    if not callable(obj):
        raise PluginError(f"{spec!r} is not a callable {what}")
    return obj


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    help: str
    defaults: dict = field(default_factory=dict)  # parameters the function reads, with defaults
    tables: tuple = ()  # config sub-tables it reads (e.g. ("gtpo", "sepa")); refused when not read
    builtin: bool = True


class Registry:
    """Name -> function. `signature` documents what a plugin must accept and return."""

    def __init__(self, kind: str, signature: str):
        self.kind, self.signature = kind, signature
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *, help: str = "", defaults: dict | None = None, tables: tuple = (),
                 aliases: tuple = ()):
        def add(fn: Callable) -> Callable:
            if name in self._entries or name in self._aliases:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            doc = help or (inspect.getdoc(fn) or "").split("\n")[0]
            self._entries[name] = Entry(name, fn, doc, dict(defaults or {}), tuple(tables))
            for a in aliases:
                self._aliases[a] = name
            return fn
        return add

    def names(self) -> list[str]:
        return list(self._entries)

    def aliases(self) -> dict[str, str]:
        return dict(self._aliases)

    def canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def __contains__(self, name: str) -> bool:
        return self.canonical(name) in self._entries

    def entry(self, name: str, search_path: Path | str | None = None) -> Entry:
        """The built-in called `name` (or an alias of it), else the imported `module:function`."""
        name = self.canonical(name)
        if name in self._entries:
            return self._entries[name]
        if not is_dotted(name):
            raise PluginError(f"unknown {self.kind} {name!r}; built in: {', '.join(self._entries)} "
                              f"(or a function of your own as 'module:function', {self.signature})")
        fn = import_object(name, search_path, self.kind)
        return Entry(name, fn, (inspect.getdoc(fn) or "").split("\n")[0], {}, (), builtin=False)

    def get(self, name: str, search_path: Path | str | None = None) -> Callable:
        return self.entry(name, search_path).fn

    def describe(self) -> list[dict]:
        inverse: dict[str, list[str]] = {}
        for a, n in self._aliases.items():
            inverse.setdefault(n, []).append(a)
        return [{"name": e.name, "help": e.help, "defaults": e.defaults, "tables": list(e.tables),
                 "aliases": inverse.get(e.name, [])} for e in self._entries.values()]


def merged_params(entry: Entry, given: dict | None, where: str) -> dict:
    """A built-in's defaults overlaid with the user's values; keys it does not read are refused.
    A plugin gets the user's table as written."""
    given = dict(given or {})
    if not entry.builtin:
        return given
    unknown = sorted(set(given) - set(entry.defaults))
    if unknown:
        reads = ", ".join(entry.defaults) or "no parameters"
        raise PluginError(f"{where}: {unknown} not read by {entry.name!r} (it reads {reads})")
    return {**entry.defaults, **given}
