"""OpenAI-compatible judge servers for tests: a real llama.cpp server (xllamacpp) on a tiny GGUF
written in the test, and a scripted one whose replies, delays and failures the test chooses."""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def llama_server(gguf: Path, parallel: int = 2):
    """A llama.cpp server in this process on a free port; returns (server, base_url ending in /v1).
    The server stops when the object is garbage-collected."""
    import xllamacpp as xlc
    p = xlc.CommonParams()
    p.model.path = str(gguf)
    p.n_ctx = 4096
    p.n_parallel = parallel
    p.cpuparams.n_threads = 1
    p.warmup = False
    p.port = 0
    server = xlc.Server(p)
    return server, server.listening_address + "/v1"


class ScriptedJudge:
    """A chat-completions server whose reply to each request is `reply(user_text, n)` (n: the request's
    number, from 1), a str (the message content), an int (an HTTP status with an error body), or
    ("drip", seconds) to send the headers and then one byte per second. Records every request body."""

    def __init__(self, reply):
        self.reply, self.requests, self.lock = reply, [], threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with outer.lock:
                    outer.requests.append({"body": body, "headers": dict(self.headers), "path": self.path})
                    n = len(outer.requests)
                r = outer.reply(body["messages"][-1]["content"], n)
                if isinstance(r, int):
                    data = b'{"error": {"message": "scripted failure"}}'
                    self.send_response(r)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if isinstance(r, tuple) and r[0] == "drip":
                    self.send_response(200)
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    end = time.monotonic() + r[1]
                    try:
                        while time.monotonic() < end:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                            time.sleep(0.2)
                    except OSError:
                        pass
                    return
                data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": r}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def shown(user_text: str, tag: str) -> str:
    """The text inside <tag>...</tag> of a judge request."""
    m = re.search(rf"<{tag}>\n(.*?)\n</{tag}>", user_text, re.DOTALL)
    return m.group(1) if m else ""
