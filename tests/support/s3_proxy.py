"""A fault-injecting HTTP proxy in front of an S3 endpoint (moto in the tests): faults at the HTTP layer, where
a real object store's show up, not by patching cnrstore.

    proxy = FaultProxy("http://127.0.0.1:PORT")   # the real endpoint
    proxy.drop_puts(1)        # the next PUT (an object or a multipart part) is cut off mid-body
    proxy.cut_gets("segments/", 3)  # the next 3 GETs of keys containing it: headers, half the body, cut
    proxy.slow_down(3)        # the next 3 requests answer 503 SlowDown (slow_down(3, "segments/"): of those keys)
    proxy.hide("segments/")   # GET/HEAD of any key containing it answer 404 NoSuchKey
    proxy.fail_puts(5)        # the next 5 PUTs answer 500 InternalError
    proxy.hang("PUT")         # every PUT (or request whose path holds the text) waits, unanswered, until heal()
    proxy.url                 # what the client uses as endpoint_url

Everything else is forwarded as is (the request's Host header too: moto does not check signatures).
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
from urllib.parse import urlsplit

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")
_NO_SUCH_KEY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code>'
                b"<Message>The specified key does not exist.</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "trailer", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str):
        up = urlsplit(upstream)
        self.upstream = (up.hostname, up.port)
        self._lock = threading.Lock()
        self._drops = 0
        self._slow = 0
        self._slow_only = ""
        self._hidden: list[str] = []
        self._fail_puts = 0
        self._cut_gets: list[str] = []
        self._cuts = 0
        self._hang: list[str] = []
        self._healed = threading.Event()
        #: what was done: ("drop" | "cut" | "503" | "404" | "500" | "hang" | "put", path) per request
        self.log: list[tuple[str, str]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _cut(self) -> None:
                self.close_connection = True
                try:
                    self.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

            def _handle(self) -> None:
                method, path = self.command, self.path
                fault = proxy._fault(method, path)
                if fault == "drop":  # read part of the body, then cut the connection: no response at all
                    length = int(self.headers.get("Content-Length") or 2)
                    self.rfile.read(max(1, length // 2))
                    return self._cut()
                body = self._body()
                if fault == "hang":  # no answer until healed (at most a minute), then the connection is cut
                    proxy._healed.wait(60)
                    return self._cut()
                if fault in ("503", "404", "500"):
                    payload = {"503": _SLOW_DOWN, "404": _NO_SUCH_KEY, "500": _INTERNAL}[fault]
                    self.send_response(int(fault))
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", "0" if method == "HEAD" else str(len(payload)))
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    if body or method in ("PUT", "POST"):
                        headers["Content-Length"] = str(len(body))
                    conn.request(method, path, body=body or None, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    if fault == "cut":  # the whole length announced, half the body sent, the connection cut
                        self.send_response(resp.status, resp.reason)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                        return self._cut()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP and k.lower() != "content-length":
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if method == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    if method != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _fault(self, method: str, path: str) -> str | None:
        with self._lock:
            key = path.split("?", 1)[0]
            if any(h == method or h in key for h in self._hang):
                self.log.append(("hang", path))
                return "hang"
            if method in ("GET", "HEAD") and any(h in key for h in self._hidden):
                self.log.append(("404", path))
                return "404"
            if method == "GET" and self._cuts and any(h in key for h in self._cut_gets):
                self._cuts -= 1
                self.log.append(("cut", path))
                return "cut"
            if self._slow and self._slow_only in key:
                self._slow -= 1
                self.log.append(("503", path))
                return "503"
            if method == "PUT" and "?" not in path.split("/")[-1] or (method == "PUT" and "partNumber=" in path):
                if self._drops:
                    self._drops -= 1
                    self.log.append(("drop", path))
                    return "drop"
                if self._fail_puts:
                    self._fail_puts -= 1
                    self.log.append(("500", path))
                    return "500"
                self.log.append(("put", path))
            return None

    def drop_puts(self, n: int = 1) -> None:
        """Cut off the next ``n`` PUTs of object data mid-body."""
        with self._lock:
            self._drops = n

    def cut_gets(self, fragment: str, n: int) -> None:
        """Cut off the next ``n`` GETs of keys containing ``fragment`` mid-body (the full Content-Length is sent)."""
        with self._lock:
            self._cut_gets.append(fragment)
            self._cuts = n

    def slow_down(self, n: int, only: str = "") -> None:
        """Answer the next ``n`` requests (of keys containing ``only``, if given) with 503 SlowDown."""
        with self._lock:
            self._slow = n
            self._slow_only = only

    def hide(self, fragment: str) -> None:
        """Answer 404 to GET/HEAD of every key containing ``fragment``."""
        with self._lock:
            self._hidden.append(fragment)

    def fail_puts(self, n: int) -> None:
        """Answer the next ``n`` PUTs of object data with 500 InternalError."""
        with self._lock:
            self._fail_puts = n

    def hang(self, what: str) -> None:
        """Leave unanswered (until ``heal``) every request of method ``what`` or whose path contains it."""
        with self._lock:
            self._healed.clear()
            self._hang.append(what)

    def heal(self) -> None:
        """No more faults (hung requests are let go)."""
        with self._lock:
            self._drops = self._slow = self._fail_puts = self._cuts = 0
            self._slow_only = ""
            self._hidden = []
            self._cut_gets = []
            self._hang = []
            self._healed.set()

    def close(self) -> None:
        self._healed.set()
        self._server.shutdown()
        self._server.server_close()
