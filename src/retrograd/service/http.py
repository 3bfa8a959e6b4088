"""`retrograd serve`'s HTTP layer: a Starlette app served by uvicorn (framing, keep-alive, chunked
bodies, idle timeouts and the connection cap are uvicorn's job), routing, and the checks every
request passes before its body is read.

In order, for every request:
  1. `Host` must name this server (the bound address, or --public-url): a web page that rebinds a
     DNS name to 127.0.0.1 is refused, and signed URLs are built from the public URL, never from
     the Host header;
  2. an `X-API-Key` of the state dir (keys are always required; `retrograd serve` makes one for
     its user on first start) -- except the health check and signed downloads, which carry their
     own signature;
  3. a declared body larger than the route's limit is refused (413) without reading it, and a
     chunked body is cut off as soon as it passes the limit.
Then the route runs the Service method (service/api.py, rest.py) in a worker thread; the
long-polled `retrieve_future` waits without holding one. Every request gets an answer: a client
mistake a 4xx naming what is wrong, a bug a 500 with no internals (the traceback goes to the log).
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from retrograd.service import rest
from retrograd.service.api import HttpError, Service
from retrograd.service.registry import Caller

MAX_JSON_BYTES = 8 << 20  # 8 MiB: a sampling request with a long prompt fits many times over
MAX_PROTO_BYTES = 64 << 20  # forward_backward batches (the SDK cuts its requests into ~5 MB chunks)
POLL_S = 20.0  # how long retrieve_future holds a poll (the SDK's own timeout is 45 s)
KEEP_ALIVE_S = 15  # an idle keep-alive connection is closed after this
MAX_CONNECTIONS = 256  # beyond this many open connections uvicorn answers 503
DRAIN_FACTOR = 4  # an authorised oversized body up to 4x the limit is discarded before the 413
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                 "custom_loss_server_side": True, "sample_join_sampling_session": True}
OPEN_PATHS = re.compile(r"^/api/v1/(healthz|files/[0-9a-f]{32}/[A-Za-z0-9._-]+)$")  # no API key needed

_RUN = r"(?P<run>[^/]+)"
_CKPT = r"(?P<ckpt>(?:weights|sampler_weights|external_weights)/[^/]+)"


def is_loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, port: int, public_url: str | None) -> set[str]:
    """Host header values that name this server: the bound address (and, on loopback, the usual
    loopback spellings), with and without the port, and the public URL's host."""
    names = {host}
    if is_loopback(host) or host in ("0.0.0.0", "::"):
        names |= {"127.0.0.1", "localhost", "[::1]"}
    out = {n for name in names for n in (name, f"{name}:{port}")}
    if public_url:
        netloc = urlsplit(public_url).netloc
        out |= {netloc, netloc.rsplit(":", 1)[0]}
    return {h.lower() for h in out}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message, "detail": message}, status_code=status)


class Gate:
    """ASGI middleware: Host, API key and declared body size, checked on the headers alone."""

    def __init__(self, app, svc: Service, hosts: set[str], log):
        self.app, self.svc, self.hosts, self.log = app, svc, hosts, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        refusal = None
        if headers.get("host", "").lower() not in self.hosts:
            refusal = _error(400, f"Host {headers.get('host', '')!r} does not name this server "
                                  "(start it with --public-url for the address clients use)")
        elif not OPEN_PATHS.match(path):
            key = headers.get("x-api-key", "")
            caller = await run_in_threadpool(self.svc.registry.caller, key) if key else None
            if not key:
                refusal = _error(401, "missing X-API-Key header (set TINKER_API_KEY)")
            elif caller is None:
                refusal = _error(401, "unknown or revoked API key (the server's user finds theirs in the state "
                                      "dir's api-key file; more with: retrograd serve keys create --owner NAME)")
            else:
                import dataclasses
                client = (scope.get("client") or ("", 0))[0]
                scope.setdefault("state", {})["caller"] = dataclasses.replace(caller, local=is_loopback(client or ""))
        if refusal is None:
            limit = MAX_PROTO_BYTES if path == "/api/v1/forward_backward" else MAX_JSON_BYTES
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > limit):
                refusal = _error(413 if length.isdigit() else 400,
                                 f"request body of {length} bytes exceeds the limit of {limit} bytes"
                                 if length.isdigit() else f"invalid Content-Length {length!r}")
                if length.isdigit() and int(length) <= DRAIN_FACTOR * limit:
                    # an authorised client's oversized body is read and thrown away first, so that a
                    # client that closes after its request (Connection: close) still reads the 413
                    await _discard(receive)
        if refusal is not None:  # answered without keeping (or parsing) the body; uvicorn discards the rest
            return await refusal(scope, receive, send)
        return await self.app(scope, receive, send)


async def _discard(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


async def _body(request: Request, limit: int) -> bytes:
    """The body, read up to `limit` bytes (a chunked body is cut off there)."""
    out, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise HttpError(413, f"request body exceeds the limit of {limit} bytes")
        out.append(chunk)
    return b"".join(out)


async def _json(request: Request) -> dict:
    raw = await _body(request, MAX_JSON_BYTES)
    if not raw:
        return {}
    try:
        out = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the request body is not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(out, dict):
        raise HttpError(400, f"the request body must be a JSON object, not a {type(out).__name__}")
    return out


def build_app(svc: Service, hosts: set[str], base_url: str, log=print) -> Gate:
    """The ASGI application: every route of the Tinker API this server answers."""

    def caller_of(request: Request) -> Caller:
        return request.scope["state"]["caller"]

    async def endpoint(request: Request) -> Response:
        method, path = request.method, request.url.path
        try:
            return await _route(request, method, path[len("/api/v1/"):] if path.startswith("/api/v1/") else None)
        except HttpError as e:
            return _error(e.status, str(e))
        except Exception:  # a bug: answer 500 without internals, keep serving
            import traceback
            log(f"{method} {path} failed:\n{traceback.format_exc()}")
            return _error(500, "internal error; the server log has the details")

    async def _route(request: Request, method: str, route: str | None) -> Response:
        if route is None:
            raise HttpError(404, f"no such endpoint: {method} {request.url.path}")
        query = dict(request.query_params)
        if route == "healthz":
            return JSONResponse({"status": "ok"})
        m = re.fullmatch(r"files/(?P<sid>[0-9a-f]{32})/(?P<name>[A-Za-z0-9._-]+)", route)
        if m and method == "GET":  # signed URL: no API key, its signature instead
            f = await run_in_threadpool(rest.download, svc, m["sid"], m["name"], query)
            return FileResponse(f, media_type="application/octet-stream")
        caller = caller_of(request)

        def call(fn, *args):
            return run_in_threadpool(fn, *args)

        if method == "POST":
            if route == "forward_backward":
                body = await _body(request, MAX_PROTO_BYTES)
                return JSONResponse(await call(svc.forward_backward, caller, body))
            static = {"client/config": CLIENT_CONFIG, "client/dynamic_config": {"refresh_interval_sec": 300},
                      "telemetry": {"status": "accepted"}}
            if route in static:  # the body is not read (telemetry is accepted and dropped)
                return JSONResponse(static[route])
            body = await _json(request)
            if route == "retrieve_future":
                return await _retrieve(caller, body)
            ck = svc.checkpoints
            simple = {"create_session": svc.create_session, "session_heartbeat": svc.heartbeat,
                      "create_model": svc.create_model, "get_info": svc.get_info, "optim_step": svc.optim_step,
                      "save_weights": ck.save_weights, "save_weights_for_sampler": ck.save_weights_for_sampler,
                      "save_weights_external": ck.save_weights_external, "load_weights": ck.load_weights,
                      "create_sampling_session": svc.sampling.create_session, "asample": svc.sampling.asample,
                      "create_custom_loss": svc.create_custom_loss, "join_sampling_session": svc.sampling.join,
                      "weights_info": lambda c, b: rest.weights_info(svc, c, b)}
            if route in simple:
                return JSONResponse(await call(simple[route], caller, body))
            if route == "copy_weights":
                return JSONResponse(await call(ck.copy_weights, caller, body))
            m = re.fullmatch(r"sessions/(?P<sid>[^/]+)/finish", route)
            if m:
                return JSONResponse(await call(svc.finish_session, caller, m["sid"]))
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}/publish", route)
            if m:
                return JSONResponse(await call(rest.publish, svc, caller, m["run"], m["ckpt"], True))
        if method == "GET":
            if route == "get_server_capabilities":
                return JSONResponse(await call(rest.capabilities, svc))
            if route == "training_runs":
                return JSONResponse(await call(rest.list_runs, svc, caller, query))
            if route == "checkpoints":
                return JSONResponse(await call(rest.list_checkpoints, svc, caller, query))
            m = re.fullmatch(r"samplers/(?P<sid>[^/]+)", route)
            if m:
                return JSONResponse(await call(svc.sampling.get, caller, m["sid"]))
            m = re.fullmatch(r"sessions/(?P<sid>[^/]+)", route)
            if m:
                s = await call(svc.registry.session, m["sid"], caller.owner)
                if s is None:
                    raise HttpError(404, f"session {m['sid']!r} not found")
                return JSONResponse(s)
            m = re.fullmatch(r"sessions/(?P<sid>[^/]+)/checkpoints", route)
            if m:
                return JSONResponse(await call(lambda: rest.list_checkpoints(svc, caller, query, session_id=m["sid"])))
            m = re.fullmatch(rf"training_runs/{_RUN}", route)
            if m:
                return JSONResponse(await call(rest.get_run, svc, caller, m["run"]))
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints", route)
            if m:
                return JSONResponse(await call(lambda: rest.list_checkpoints(svc, caller, query, run_id=m["run"])))
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}/(?P<what>manifest|external_weights_urls)",
                             route)
            if m:
                fn = rest.manifest if m["what"] == "manifest" else rest.external_urls
                return JSONResponse(await call(fn, svc, caller, m["run"], m["ckpt"], base_url))
        if method == "DELETE":
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}/publish", route)
            if m:
                return JSONResponse(await call(rest.publish, svc, caller, m["run"], m["ckpt"], False))
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}", route)
            if m:
                return JSONResponse(await call(rest.delete_checkpoint, svc, caller, m["run"], m["ckpt"]))
        if method == "PUT":
            m = re.fullmatch(rf"training_runs/{_RUN}/checkpoints/{_CKPT}/ttl", route)
            if m:
                body = await _json(request)
                return JSONResponse(await call(rest.set_ttl, svc, caller, m["run"], m["ckpt"], body))
        raise HttpError(404, f"no such endpoint: {method} {request.url.path}")

    async def _retrieve(caller: Caller, body: dict) -> Response:
        rid = body.get("request_id")
        if not isinstance(rid, str):
            raise HttpError(400, "retrieve_future needs request_id (a string)")
        p = await svc.executor.wait_async(rid, caller.owner, POLL_S)
        if p is None:
            raise HttpError(404, f"request {rid!r} not found (unknown, expired, or another owner's)")
        if not p.done.is_set():
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        if p.error is not None:
            return JSONResponse({"error": p.error[0], "category": p.error[1]})
        if isinstance(p.result, bytes):
            return Response(p.result, media_type="application/x-protobuf")
        return JSONResponse(p.result)

    app = Starlette(routes=[Route("/{path:path}", endpoint, methods=["GET", "POST", "PUT", "DELETE"])])
    return Gate(app, svc, hosts, log)


def _guarded_protocol():
    """uvicorn's h11 protocol, plus: a connection must deliver a whole request head within the
    keep-alive timeout of opening, or of its previous response; a silent or slow one (slowloris) is
    closed. (uvicorn's own keep-alive timer only starts after a response, and any byte cancels it.)"""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm_request_timer()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm_request_timer()

        def _arm_request_timer(self):
            self.loop.call_later(self.timeout_keep_alive, self._request_timeout, self.cycle)

        def _request_timeout(self, armed_cycle):
            if not self.transport.is_closing() and self.cycle is armed_cycle:  # no request began since
                self.transport.close()
    return GuardedH11


class Server:
    """uvicorn serving the app on (host, port); port 0 picks a free one (`.port` after `start`)."""

    def __init__(self, svc: Service, host: str, port: int, public_url: str | None = None, log=print, *,
                 keep_alive_s: float = KEEP_ALIVE_S, max_connections: int = MAX_CONNECTIONS):
        import socket
        import uvicorn
        self.svc, self.host, self.log = svc, host, log
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        self.url = (public_url or f"http://{shown}:{self.port}").rstrip("/")
        app = build_app(svc, allowed_hosts(host, self.port, public_url), self.url, log)
        self.config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=keep_alive_s,
                                     limit_concurrency=max_connections, lifespan="off", server_header=False,
                                     http=_guarded_protocol())
        self.server = uvicorn.Server(self.config)
        self._thread: threading.Thread | None = None

    def serve_forever(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> "Server":
        """Serve in a background thread (tests, examples)."""
        self._thread = threading.Thread(target=self.serve_forever, name="retrograd-serve", daemon=True)
        self._thread.start()
        while not self.server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server stopped while starting")
            self._thread.join(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()
