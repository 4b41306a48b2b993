"""A local HTTP/1.1 stub server that replays scripted byte fragments at scripted times.

Each fragment is sent as one HTTP chunk (``Transfer-Encoding: chunked``) at ``at_s`` seconds after
the request body has arrived, with real sleeps to absolute deadlines (no drift) and TCP_NODELAY,
so what the client measures can be compared with the script. Binds 127.0.0.1 only.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


@dataclass
class Script:
    """What the stub answers: status, headers, ``(at_s, bytes)`` fragments and how it ends.

    ``end``: ``"done"`` (terminating chunk), ``"drop"`` (close the socket mid-body), or
    ``"hang"`` (send nothing more for ``hang_s`` seconds, then close).
    """

    fragments: list[tuple[float, bytes]] = field(default_factory=list)
    status: int = 200
    headers: dict[str, str] = field(default_factory=lambda: {"Content-Type": "text/event-stream"})
    end: str = "done"
    hang_s: float = 5.0
    headers_at_s: float = 0.0


def events_script(events: list[dict]) -> Script:
    """A Script from a handed SSE case's ``events`` (``raw`` sent at ``at_ms``)."""
    return Script(fragments=[(e["at_ms"] / 1000.0, e["raw"].encode("utf-8")) for e in events])


class StubServer:
    """Threaded stub on 127.0.0.1 with a free port; ``script`` may be replaced between requests."""

    def __init__(self, script: Script | None = None):
        self.script = script or Script()
        self.requests: list[dict] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n)
                t0 = time.perf_counter()
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = raw
                sent: list[float] = []  # actual send offsets (s after arrival), one per fragment
                stub.requests.append({"path": self.path, "headers": dict(self.headers), "body": body,
                                      "arrived_at": t0, "sent_s": sent, "script": stub.script})
                s = stub.script
                self._sleep_until(t0 + s.headers_at_s)
                self.send_response(s.status)
                for k, v in s.headers.items():
                    self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.flush()
                for at_s, data in s.fragments:
                    self._sleep_until(t0 + at_s)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                    sent.append(time.perf_counter() - t0)
                if s.end == "done":
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                elif s.end == "hang":
                    time.sleep(s.hang_s)
                self.close_connection = True
                if s.end == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)

            do_GET = do_POST

            @staticmethod
            def _sleep_until(deadline: float) -> None:
                while (d := deadline - time.perf_counter()) > 0:
                    time.sleep(d)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def lateness_s(self, i: int = -1) -> float:
        """How late (seconds) the stub actually sent request i's fragments, at worst, vs. its script.

        The stub's own record, independent of the client: on a loaded machine the stub's sleeps
        overrun, and a timing check can only be as exact as the bytes were on time.
        """
        req = self.requests[i]
        late = [a - at for a, (at, _) in zip(req["sent_s"], req["script"].fragments, strict=False)]
        return max(late, default=0.0)

    def arrived_at(self, i: int = -1) -> float:
        """``time.perf_counter()`` when request i's body had arrived (the script's time zero)."""
        return self.requests[i]["arrived_at"]

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
