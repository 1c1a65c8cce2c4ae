"""A small HTTP proxy that adds a bearer token (and the tenant's Host) to every request it forwards, for
clients that send none, such as the MCP conformance suite. A request naming another Host keeps it, so a
DNS-rebinding probe reaches Klique as sent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}


@contextmanager
def bearer_proxy(*, upstream: str, host: str, token: str) -> Iterator[str]:
    """Serve on a free loopback port while the block runs; yields the proxy's base address."""
    client = httpx.Client(base_url=upstream, timeout=60)

    class Forward(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _forward(self) -> None:
            body = self._body()
            headers = {k.lower(): v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
            if headers.get("host", "").split(":")[0] in ("127.0.0.1", "localhost"):
                headers["host"] = host
            headers["authorization"] = f"Bearer {token}"
            answer = client.request(self.command, self.path, headers=headers, content=body)
            self.send_response(answer.status_code)
            for key, value in answer.headers.items():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        def _body(self) -> bytes:
            if "chunked" not in self.headers.get("Transfer-Encoding", "").lower():
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""
            parts = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                parts.append(self.rfile.read(size))
                self.rfile.readline()  # the CRLF after each chunk
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers, then the blank line
                pass
            return b"".join(parts)

        do_GET = do_POST = do_DELETE = do_PUT = _forward  # noqa: N815 -- http.server's names

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        client.close()
