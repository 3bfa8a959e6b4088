"""Command-line side of the service: `retrograd serve`, `retrograd serve keys create|list|revoke` and
`retrograd checkpoint list` (registered checkpoint metadata through the server, no download).

Keys are always required. On its first start `retrograd serve` creates a key for the user who
started it and writes it to STATE_DIR/api-key (readable by that user only), as Jupyter does with its
token; `export TINKER_API_KEY=$(cat STATE_DIR/api-key)` and the SDK is in."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import urllib.error
import urllib.request
from pathlib import Path

from retrograd.errors import ConfigError, ModelError, RetrogradError
from retrograd.paths import home

POLICY_CHOICES = ("rollout-enabled", "actor-only")


def default_state_dir() -> Path:
    return home() / "serve"


def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="run a Tinker-compatible training service (tinker SDK / tinker-cookbook)",
                       description="Serve LoRA training and sampling over the Tinker API. Point the unmodified tinker "
                                   "SDK at it with TINKER_BASE_URL=http://HOST:PORT and TINKER_API_KEY.")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (8000)")
    s.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="registry database, keys and checkpoints ($RETROGRAD_HOME/serve)")
    s.add_argument("--models", nargs="+", default=None, metavar="ALIAS_OR_PATH",
                   help="base models clients may train: built-in aliases, HF folders or .gguf files "
                        "(default: the built-in smollm2-135m-instruct)")
    s.add_argument("--policy", action="append", default=[], metavar="MODEL=POLICY",
                   help="per-model sampling policy: rollout-enabled (default) or actor-only (repeatable)")
    s.add_argument("--lora-alpha", type=float, default=32.0, metavar="A",
                   help="LoRA alpha of new training clients (Tinker's LoRA config has none); scale = A / rank (32)")
    s.add_argument("--threads", type=int, metavar="N", help="torch CPU threads")
    s.add_argument("--public-url", metavar="URL",
                   help="the address clients use when it is not the bound one (a proxy, a DNS name): requests "
                        "must name it in their Host header, and download URLs are built from it")
    s.add_argument("--max-models-per-owner", type=int, default=8, metavar="N", help="live training clients (8)")
    s.add_argument("--max-disk-gb-per-owner", type=float, default=50.0, metavar="GB", help="checkpoints (50)")
    s.add_argument("--max-sample-tokens", type=int, default=1 << 16, metavar="N",
                   help="num_samples x max_tokens of one sampling request (65536)")
    s.add_argument("--max-batch-tokens", type=int, default=1 << 17, metavar="N",
                   help="input tokens of one forward_backward request (131072)")
    s.add_argument("--pass-tokens", type=int, default=None, metavar="N",
                   help="tokens per forward/backward pass: a request's datums are computed in passes of at "
                        "most N tokens (a longer datum gets a pass of its own); fewer tokens, less activation "
                        "memory (4096)")
    ks = s.add_subparsers(dest="serve_command", metavar="SUBCOMMAND")
    keys = ks.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", metavar="ACTION",
                                                                     required=True)
    kc = keys.add_parser("create", help="create an API key for an owner and print it")
    kc.add_argument("--owner", required=True, help="who the key's checkpoints belong to")
    kc.add_argument("--policy", default="rollout-enabled", choices=POLICY_CHOICES,
                    help="rollout-enabled: may sample; actor-only: training and checkpoints only")
    kc.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help="as for retrograd serve")
    kl = keys.add_parser("list", help="list the keys (id, owner, policy, created; never the key itself)")
    kl.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help="as for retrograd serve")
    kl.add_argument("--json", action="store_true", help="print JSON")
    kr = keys.add_parser("revoke", help="revoke a key by its id (from keys list): its requests and signed URLs stop")
    kr.add_argument("key_id", help="the key's id, or a unique prefix of it (6+ hex digits)")
    kr.add_argument("--state-dir", type=Path, default=None, metavar="DIR", help="as for retrograd serve")

    c = sub.add_parser("checkpoint", help="query a running service's checkpoint registry")
    cs = c.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    cl = cs.add_parser("list", help="list registered checkpoints of a session (metadata only, no download)")
    cl.add_argument("--session-id", required=True, metavar="ID")
    cl.add_argument("--limit", type=int, default=25, help="at most this many (25)")
    cl.add_argument("--base-url", default=None, help="the server ($TINKER_BASE_URL, else http://127.0.0.1:8000)")
    cl.add_argument("--api-key", default=None, help="$TINKER_API_KEY")
    cl.add_argument("--json", action="store_true", help="print JSON")


def _parse_policies(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        model, _, policy = item.rpartition("=")
        if not model or policy not in POLICY_CHOICES:
            raise ConfigError(f"--policy {item!r}: expected MODEL=rollout-enabled or MODEL=actor-only")
        out[model] = policy
    return out


def _keys(args, state_dir: Path) -> int:
    import time
    from retrograd.service.api import make_private
    from retrograd.service.registry import Registry
    make_private(state_dir)
    registry = Registry(state_dir / "registry.sqlite3")
    if args.keys_command == "create":
        key = registry.create_key(args.owner, args.policy)
        print(key)
        print(f"(owner {args.owner}, policy {args.policy}; stored as a SHA-256 digest in {state_dir}; "
              "this is the only time the key is shown)", file=sys.stderr)
    elif args.keys_command == "list":
        rows = registry.keys()
        if args.json:
            print(json.dumps(rows, indent=2))
        for r in [] if args.json else rows:
            print(f"{r['key_id']}  {r['owner']:<16} {r['policy']:<16} "
                  f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(r['created']))}")
        if not rows and not args.json:
            print("no keys (retrograd serve makes one for its user at its first start)")
    else:
        row = registry.revoke_key(args.key_id)
        if row is None:
            raise ConfigError(f"no single key has the id {args.key_id!r}; see: retrograd serve keys list")
        print(f"revoked {row['key_id']} (owner {row['owner']}): its requests and download URLs are refused from now on")
    return 0


def first_key(state_dir: Path, registry, log) -> None:
    """No key yet: make one for the user who started the server, in STATE_DIR/api-key (0600)."""
    import getpass
    if registry.has_keys():
        return
    owner = getpass.getuser()
    key = registry.create_key(owner, "rollout-enabled")
    path = state_dir / "api-key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
    log(f"created an API key for {owner} in {path} (readable by you only): export TINKER_API_KEY=$(cat {path})")


def run_serve(args) -> int:
    state_dir = args.state_dir or default_state_dir()
    if args.serve_command == "keys":
        return _keys(args, state_dir)
    try:
        import starlette  # noqa: F401
        import tinker  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"retrograd serve needs its HTTP stack and the tinker wire format ({e.name} is missing): "
                          "pip install 'retrograd[service]'") from None
    from retrograd.device import configure_torch
    from retrograd.models.builtin import DEFAULT_MODEL
    from retrograd.service.api import Limits, Service
    from retrograd.service.engine import read_base
    from retrograd.service.http import Server

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.public_url and not args.public_url.startswith(("http://", "https://")):
        raise ConfigError(f"--public-url {args.public_url!r} must start with http:// or https://")
    configure_torch(args.threads)
    if args.pass_tokens is not None:
        if args.pass_tokens < 1:
            raise ConfigError(f"--pass-tokens {args.pass_tokens}: must be at least 1")
        from retrograd.service import engine
        engine.PASS_TOKENS = args.pass_tokens
        log(f"passes of at most {args.pass_tokens} tokens")
    policies = _parse_policies(args.policy)
    names = args.models or [DEFAULT_MODEL]
    unknown = sorted(set(policies) - set(names))
    if unknown:
        raise ConfigError(f"--policy names {unknown}, which are not in --models {names}")
    limits = Limits(models_per_owner=args.max_models_per_owner, disk_bytes_per_owner=int(args.max_disk_gb_per_owner * 1e9),
                    sample_tokens=args.max_sample_tokens, batch_tokens=args.max_batch_tokens)
    bases = {}
    for name in names:
        log(f"loading {name} ...")
        try:
            bases[name] = read_base(name, name, log)
        except ModelError as e:
            raise ModelError(f"--models {name}: {str(e).replace('model.path ', '', 1)}") from None
    svc = Service(state_dir, bases, policies, log, lora_alpha=args.lora_alpha, limits=limits)
    first_key(state_dir, svc.registry, log)
    server = Server(svc, args.host, args.port, args.public_url, log)
    log(f"retrograd serve: {server.url}  models: {', '.join(names)}  state: {state_dir}  keys: "
        f"{len(svc.registry.keys())} (retrograd serve keys list)")
    log(f"  export TINKER_BASE_URL={server.url}")
    signal.signal(signal.SIGTERM, lambda *_: setattr(server.server, "should_exit", True))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        log("shutting down")
        svc.executor.close()
    return 0


def run_checkpoint(args) -> int:
    base = (args.base_url or os.environ.get("TINKER_BASE_URL") or "http://127.0.0.1:8000").rstrip("/")
    key = args.api_key or os.environ.get("TINKER_API_KEY")
    if not key:
        raise ConfigError("no API key: pass --api-key or set TINKER_API_KEY")
    url = f"{base}/api/v1/sessions/{args.session_id}/checkpoints?limit={args.limit}"
    req = urllib.request.Request(url, headers={"X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            data = json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail).get("error", detail)
        except ValueError:
            pass
        raise RetrogradError(f"{url}: HTTP {e.code}: {detail}") from None
    except urllib.error.URLError as e:
        raise RetrogradError(f"cannot reach the server at {base}: {e.reason}") from None
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = data["checkpoints"]
    if not rows:
        print(f"no registered checkpoints in session {args.session_id}")
        return 0
    w = max(len(c["tinker_path"]) for c in rows)
    print(f"{'path':<{w}} {'type':<8} {'step':>6} {'bytes':>11}  {'created':<20} expires")
    for c in rows:
        print(f"{c['tinker_path']:<{w}} {c['checkpoint_type']:<8} {c['step']:>6} {c['size_bytes']:>11}  "
              f"{c['time']:<20} {c['expires_at'] or 'never'}")
    total = data["cursor"]["total_count"]
    if total > len(rows):
        print(f"({len(rows)} of {total}; raise --limit for more)")
    return 0


def main_for(args: argparse.Namespace) -> int:
    return run_serve(args) if args.command == "serve" else run_checkpoint(args)
