"""Helpers for the service tests: an in-process `retrograd serve` on a tiny model, and a
`retrograd serve` subprocess (for kill / restart tests)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")


KEYS: dict[str, str] = {}  # base URL -> the API key of owner "local" on the service there (running_service)


@contextmanager
def running_service(state_dir: Path, models: dict[str, Path], policies: dict | None = None, limits=None,
                    **server_options):
    """(service, base_url) of a server on a free loopback port, stopped afterwards; its owner
    "local" has a key (KEYS[base_url]), which `client` and `rest` use by default."""
    from retrograd.service.api import Limits, Service
    from retrograd.service.engine import read_base
    from retrograd.service.http import Server
    bases = {name: read_base(name, str(path), log=lambda *_: None) for name, path in models.items()}
    svc = Service(state_dir, bases, policies, log=lambda *_: None, limits=limits or Limits())
    server = Server(svc, "127.0.0.1", 0, log=lambda *_: None, **server_options).start()
    KEYS[server.url] = svc.registry.create_key("local", "rollout-enabled")
    try:
        yield svc, server.url
    finally:
        server.stop()
        svc.executor.close()


def client(base_url: str, key: str | None = None):
    import tinker
    return tinker.ServiceClient(base_url=base_url, api_key=key or KEYS[base_url])


def rest(base_url: str, key: str | None = None):
    import tinker
    return tinker.RestClient(base_url=base_url, api_key=key or KEYS[base_url])


def datum(tokens: list[int], weights: list[float] | None = None, **extra):
    """Next-token datum over `tokens`: input tokens[:-1], targets tokens[1:]."""
    from tinker import types
    inputs = {"target_tokens": tokens[1:], "weights": weights if weights is not None else [1.0] * (len(tokens) - 1)}
    inputs.update(extra)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


class ServeProcess:
    """`retrograd serve` in a subprocess on a free port (read from its startup line)."""

    def __init__(self, state_dir: Path, model: Path, env: dict | None = None, extra: list[str] = ()):
        cmd = [sys.executable, "-m", "retrograd", "serve", "--port", "0", "--state-dir", str(state_dir),
               "--models", str(model), "--threads", "1", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        deadline = time.time() + 120
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("retrograd serve exited:\n" + "".join(self.lines))
            self.lines.append(line)
            m = re.search(r"retrograd serve: (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self.key = (state_dir / "api-key").read_text().strip()
                return
        raise RuntimeError("retrograd serve did not start:\n" + "".join(self.lines))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
