"""A throttling HTTP proxy for tests/test_s3.py: in front of an S3 server, it refuses every fourth request with
503 SlowDown, as S3 does when a prefix exceeds its request rate, and relays the others unchanged."""

from __future__ import annotations

import http.client
import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Flaky:
    """An HTTP proxy in front of the S3 server that answers every `every`-th request with 503 SlowDown (throttling;
    every=1: a store that never stops throttling)."""

    def __init__(self, endpoint: str, every: int = 4) -> None:
        host, port = endpoint.removeprefix("http://").split(":")
        counter, self.refused = itertools.count(), 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # answers `Expect: 100-continue`, which uploads send

            def log_message(self, *args):
                pass

            def relay(self):
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if next(counter) % every == every - 1:
                    outer.refused += 1
                    error = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("content-length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(b"" if self.command == "HEAD" else error)
                    return
                conn = http.client.HTTPConnection(host, int(port))
                conn.request(self.command, self.path, body or None, headers=dict(self.headers))
                reply = conn.getresponse()
                data = reply.read()
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                head = self.command == "HEAD"  # the object's length, without its body
                self.send_header("content-length", reply.getheader("content-length", "0") if head else str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
