"""A pod's process for the process-node tests: an HTTP server on $POD_IP:$PORT.

GET /healthz -> 200; GET /ready -> 200 once POST /make-ready was called, else 503;
GET /env -> the environment as JSON; GET /pid -> this process's pid.
With IGNORE_SIGTERM=1 it reports SIGTERM and keeps running (so only SIGKILL ends it)."""

import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ready = False


def on_sigterm(signum: int, frame: object) -> None:
    print(f"got SIGTERM at {time.time():.6f}", flush=True)
    if os.environ.get("IGNORE_SIGTERM") != "1":
        sys.exit(0)


class Handler(BaseHTTPRequestHandler):
    def reply(self, code: int, body: bytes, kind: str = "text/plain") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self.reply(200, b"ok")
        elif self.path == "/ready":
            self.reply(200 if ready else 503, b"ready" if ready else b"not ready")
        elif self.path == "/env":
            self.reply(200, json.dumps(dict(os.environ)).encode(), "application/json")
        elif self.path == "/pid":
            self.reply(200, str(os.getpid()).encode())
        else:
            self.reply(404, b"no such path")

    def do_POST(self) -> None:
        global ready
        if self.path == "/make-ready":
            ready = True
            self.reply(200, b"ok")
        else:
            self.reply(404, b"no such path")

    def log_message(self, format: str, *args: object) -> None:
        pass


signal.signal(signal.SIGTERM, on_sigterm)
server = ThreadingHTTPServer((os.environ["POD_IP"], int(os.environ.get("PORT", "8080"))), Handler)
print(f"start pid={os.getpid()} time={time.time():.3f} addr={server.server_address}", flush=True)
server.serve_forever()
