"""Inference-engine ``/metrics`` pages (vLLM V1, SGLang) served over real HTTP on 127.0.0.1.

The pages are ``testkit/fixtures/rollout`` (built from the engines' source, see its README): a first
scrape and a later one, with the rows expected over the interval between them.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "rollout"
V1_FIRST = (FIXTURES / "vllm-v1-8gpu-tp.prom").read_text()
V1_LATER = (FIXTURES / "vllm-v1-8gpu-tp.later.prom").read_text()
SG_FIRST = (FIXTURES / "sglang-4gpu.prom").read_text()
SG_LATER = (FIXTURES / "sglang-4gpu.later.prom").read_text()
V1_EXP = json.loads((FIXTURES / "vllm-v1-expected.json").read_text())
SG_EXP = json.loads((FIXTURES / "sglang-expected.json").read_text())


class PageServer:
    """Serves ``self.page`` at /metrics on 127.0.0.1 (Prometheus text format 0.0.4).

    With ``hang_elsewhere`` it is an engine that hangs: a request for any other path gets no
    answer until ``released`` is set (or 60 s), then a 503.
    """

    def __init__(
        self,
        page: str = "",
        basic_auth: tuple[str, str] | None = None,
        hang_elsewhere: bool = False,
    ) -> None:
        self.page = page
        #: With ``basic_auth``, a GET without exactly these credentials gets 401.
        self.basic_auth = basic_auth
        self.authorizations: list[str | None] = []
        self.released = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if hang_elsewhere and self.path != "/metrics":
                    owner.released.wait(60)
                    self.send_error(503)
                    return
                given = self.headers.get("Authorization")
                owner.authorizations.append(given)
                if owner.basic_auth is not None:
                    import base64

                    token = base64.b64encode(":".join(owner.basic_auth).encode()).decode()
                    if given != f"Basic {token}":
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", 'Basic realm="metrics"')
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                body = owner.page.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.url = f"{self.base}/metrics"
        # A short poll: shutdown() waits for the serving loop to look (0.5 s by default).
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()
