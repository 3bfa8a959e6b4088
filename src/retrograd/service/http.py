"""`retrograd serve`: the HTTP layer (stdlib ThreadingHTTPServer, HTTP/1.1 keep-alive), routing,
API-key authentication, request size limits and the long-polled `retrieve_future`.

Authentication: every /api/v1 request carries `X-API-Key`. When the state dir holds keys
(`retrograd serve keys create`), only those are accepted and each maps to its owner and policy.
With no keys at all the server accepts any key as owner "local" -- allowed only on a loopback
address, so an open server is never reachable from another machine.
"""
from __future__ import annotations

import ipaddress
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, unquote, urlsplit

from retrograd.errors import ConfigError
from retrograd.service import rest
from retrograd.service.api import HttpError, Service
from retrograd.service.registry import Caller

MAX_JSON_BYTES = 8 << 20  # 8 MiB: a sampling request with a long prompt fits many times over
MAX_PROTO_BYTES = 256 << 20  # forward_backward batches (the SDK chunks above ~5 MB anyway)
POLL_S = 20.0  # how long retrieve_future holds a poll (the SDK's own timeout is 45 s)
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": False, "sample_join_sampling_session": False}

_RUN = r"(?P<run>[^/]+)"
_CKPT = r"(?P<ckpt>(?:weights|sampler_weights|external_weights)/[^/]+)"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "retrograd-serve"
    svc: Service = None
    open_access = False
    log_fn = print

    def log_message(self, fmt, *args):  # quiet: one line per error only (see _send)
        pass

    # ---- plumbing ------------------------------------------------------------------------------
    def _send(self, status: int, payload, content_type: str = "application/json") -> None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _body(self, limit: int) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None:
            if self.command in ("GET", "DELETE"):
                return b""
            raise HttpError(411, "a Content-Length header is required")
        n = int(length)
        if n > limit:
            raise HttpError(413, f"request body of {n} bytes exceeds the limit of {limit} bytes")
        return self.rfile.read(n)

    def _json(self) -> dict:
        raw = self._body(MAX_JSON_BYTES)
        if not raw:
            return {}
        try:
            out = json.loads(raw)
        except ValueError as e:
            raise HttpError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(out, dict):
            raise HttpError(400, "the request body must be a JSON object")
        return out

    def _caller(self) -> Caller:
        key = self.headers.get("X-API-Key") or ""
        if not key:
            raise HttpError(401, "missing X-API-Key header (set TINKER_API_KEY)")
        caller = self.svc.registry.caller(key)
        if caller is not None:
            return caller
        if self.open_access and not self.svc.registry.has_keys():
            return Caller("local", "rollout-enabled")
        raise HttpError(401, "unknown API key (create one with: retrograd serve keys create --owner NAME)")

    def _base_url(self) -> str:
        return f"http://{self.headers.get('Host') or '%s:%d' % self.server.server_address[:2]}"

    def _dispatch(self) -> None:
        self._body_read = False  # one handler serves every request of a keep-alive connection
        url = urlsplit(self.path)
        path, query = unquote(url.path), dict(parse_qsl(url.query))
        try:
            status, payload, ctype = self._route(self.command, path, query)
            self._send(status, payload, ctype)
        except HttpError as e:
            self._drain()
            self._send(e.status, {"error": str(e), "detail": str(e)})
        except Exception as e:  # a bug: answer 500 and keep serving
            import traceback
            self.log_fn(f"{self.command} {path} failed:\n{traceback.format_exc()}")
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    def _drain(self) -> None:
        """Read an unread body so the keep-alive connection stays in step."""
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if 0 < n <= MAX_PROTO_BYTES and not getattr(self, "_body_read", False):
                self.rfile.read(n)
        except (ValueError, OSError):
            pass

    do_GET = do_POST = do_PUT = do_DELETE = _dispatch

    # ---- routes --------------------------------------------------------------------------------
    def _route(self, method: str, path: str, query: dict):
        svc = self.svc
        if path == "/api/v1/healthz":
            return 200, {"status": "ok"}, "application/json"
        m = re.fullmatch(r"/api/v1/files/(?P<sid>[0-9a-f]{32})/(?P<name>[A-Za-z0-9._-]+)", path)
        if m and method == "GET":  # signed URL: no API key needed
            f = rest.download(svc, m["sid"], m["name"], query)
            return 200, f.read_bytes(), "application/octet-stream"
        if not path.startswith("/api/v1/"):
            raise HttpError(404, f"no such endpoint: {method} {path}")
        caller = self._caller()
        route = path[len("/api/v1/"):]
        if method == "POST":
            if route == "forward_backward":
                body = self._body(MAX_PROTO_BYTES)
                self._body_read = True
                return 200, svc.forward_backward(caller, body), "application/json"
            body = self._json()
            self._body_read = True
            simple = {"client/config": lambda: CLIENT_CONFIG, "client/dynamic_config": lambda: {"refresh_interval_sec": 300},
                      "telemetry": lambda: {"status": "accepted"},
                      "create_session": lambda: svc.create_session(caller, body),
                      "session_heartbeat": lambda: svc.heartbeat(caller, body),
                      "create_model": lambda: svc.create_model(caller, body),
                      "get_info": lambda: svc.get_info(caller, body),
                      "optim_step": lambda: svc.optim_step(caller, body),
                      "save_weights": lambda: svc.save_weights(caller, body),
                      "save_weights_for_sampler": lambda: svc.save_weights_for_sampler(caller, body),
                      "save_weights_external": lambda: svc.save_weights_external(caller, body),
                      "load_weights": lambda: svc.load_weights(caller, body),
                      "create_sampling_session": lambda: svc.create_sampling_session(caller, body),
                      "asample": lambda: svc.asample(caller, body),
                      "weights_info": lambda: rest.weights_info(svc, caller, body)}
            if route in simple:
                return 200, simple[route](), "application/json"
            if route == "retrieve_future":
                return self._retrieve(caller, body)
            m = re.fullmatch(r"sessions/(?P<sid>[^/]+)/finish", route)
            if m:
                return 200, svc.finish_session(caller, m["sid"]), "application/json"
        if method == "GET":
            if route == "get_server_capabilities":
                return 200, rest.capabilities(svc), "application/json"
            if route == "training_runs":
                return 200, rest.list_runs(svc, caller, query), "application/json"
            if route == "checkpoints":
                return 200, rest.list_checkpoints(svc, caller, query), "application/json"
            m = re.fullmatch(r"samplers/(?P<sid>[^/]+)", route)
            if m:
                return 200, svc.get_sampler(caller, m["sid"]), "application/json"
            m = re.fullmatch(r"sessions/(?P<sid>[^/]+)", route)
            if m:
                s = svc.registry.session(m["sid"], caller.owner)
                if s is None:
                    raise HttpError(404, f"session {m['sid']!r} not found")
                return 200, s, "application/json"
            m = re.fullmatch(r"sessions/(?P<sid>[^/]+)/checkpoints", route)
            if m:
                return 200, rest.list_checkpoints(svc, caller, query, session_id=m["sid"]), "application/json"
            m = re.fullmatch(rf"training_runs/{_RUN}", route)
            if m:
                return 200, rest.get_run(svc, caller, m["run"]), "application/json"
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints", route)
            if m:
                return 200, rest.list_checkpoints(svc, caller, query, run_id=m["run"]), "application/json"
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}/(?P<what>manifest|external_weights_urls)", route)
            if m:
                fn = rest.manifest if m["what"] == "manifest" else rest.external_urls
                return 200, fn(svc, caller, m["run"], m["ckpt"], self._base_url()), "application/json"
        if method == "DELETE":
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}", route)
            if m:
                return 200, rest.delete_checkpoint(svc, caller, m["run"], m["ckpt"]), "application/json"
        if method == "PUT":
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}/ttl", route)
            if m:
                return 200, rest.set_ttl(svc, caller, m["run"], m["ckpt"], self._json()), "application/json"
        raise HttpError(404, f"no such endpoint: {method} {path}")

    def _retrieve(self, caller: Caller, body: dict):
        rid = body.get("request_id")
        p = self.svc.executor.wait(str(rid), caller.owner, POLL_S)
        if p is None:
            raise HttpError(404, f"request {rid!r} not found (unknown, expired, or another owner's)")
        if not p.done.is_set():
            return 200, {"type": "try_again", "request_id": rid, "queue_state": "active"}, "application/json"
        if p.error is not None:
            return 200, {"error": p.error[0], "category": p.error[1]}, "application/json"
        if isinstance(p.result, bytes):
            return 200, p.result, "application/x-protobuf"
        return 200, p.result, "application/json"


def make_server(svc: Service, host: str, port: int, log=print) -> ThreadingHTTPServer:
    open_access = is_loopback(host)
    if not open_access and not svc.registry.has_keys():
        raise ConfigError(f"--host {host} is not a loopback address: create an API key first "
                          "(retrograd serve keys create --owner NAME --state-dir DIR) so the server is not open")
    handler = type("BoundHandler", (Handler,), {"svc": svc, "open_access": open_access, "log_fn": staticmethod(log)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    t = threading.Thread(target=server.serve_forever, name="retrograd-serve", daemon=True)
    t.start()
    return t
