"""A local /metrics endpoint serving scripted Prometheus texts, one per scrape, for tests that
read handed /metrics cases through the real scraper."""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def counters_zeroed(text: str) -> str:
    """The same series with every counter (``_total``) at 0: the scrape before the case's."""
    return "\n".join(re.sub(r"\S+$", "0.0", line) if re.match(r"[^#\s{]+_total[{ ]", line) else line
                     for line in text.splitlines()) + "\n"


def histograms_zeroed(text: str) -> str:
    """The same series with every counter and histogram ``_count`` / ``_sum`` at 0."""
    return "\n".join(re.sub(r"\S+$", "0.0", line) if re.match(r"[^#\s{]+(_total|_count|_sum)[{ ]", line) else line
                     for line in text.splitlines()) + "\n"


class MetricsEndpoint:
    """Serves /metrics from a list of texts, one per GET (the last one repeats); ``/version``
    answers vLLM's ``{"version": ...}`` when ``version`` is given, else 404."""

    def __init__(self, texts: list[str], version: str | None = None):
        self.texts = list(texts)
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/version":
                    self.send_response(200 if version else 404)
                    body = json.dumps({"version": version}).encode() if version else b"{}"
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                body = (endpoint.texts.pop(0) if len(endpoint.texts) > 1 else endpoint.texts[0]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
