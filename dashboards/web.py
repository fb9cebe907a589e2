"""``loraplane dashboard``: a small loopback web server for the live charts.

Standard library only (``http.server``) and self-contained assets in ``dashboards/static``
(no CDN: the machines have no internet). The page polls a tiny JSON API,
``GET /api/query/<name>?since=1h&adapter_id=...``, which runs one query of the pack
(``loraplane.metrics.queries``) with bound parameters; unknown names and bad durations are
400s, a ClickHouse failure is a 503 with the reason, so the page can show it.
"""

from __future__ import annotations

import json
import logging
import mimetypes
from functools import partial
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from loraplane.kernel.config import LOOPBACK
from loraplane.metrics import queries
from loraplane.metrics.clickhouse import connect

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings

STATIC = Path(__file__).resolve().parent / "static"
FILTERS = ("base_model", "tenant_id", "adapter_id", "adapter_version")
log = logging.getLogger("loraplane.dashboard")


class DashboardHandler(BaseHTTPRequestHandler):
    server_version = "loraplane-dashboard"

    def __init__(self, *args: Any, settings: Settings, refresh_s: float, **kwargs: Any) -> None:
        self.settings = settings
        self.refresh_s = refresh_s
        super().__init__(*args, **kwargs)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path in ("/", "/index.html"):
            html = (STATIC / "index.html").read_text()
            self._send(HTTPStatus.OK, html.replace("{{REFRESH_MS}}", str(int(self.refresh_s *
                                                                              1000))).encode(),
                       "text/html; charset=utf-8")
        elif url.path.startswith("/static/"):
            self._static(url.path.removeprefix("/static/"))
        elif url.path.startswith("/api/query/"):
            self._query(url.path.removeprefix("/api/query/"), parse_qs(url.query))
        elif url.path == "/api/queries":
            self._json(HTTPStatus.OK, [{"name": n, "summary": queries.load(n).summary}
                                       for n in queries.names()])
        else:
            self._json(HTTPStatus.NOT_FOUND, {"error": f"no such page {url.path}"})

    def _static(self, name: str) -> None:
        path = (STATIC / name).resolve()
        if STATIC not in path.parents or not path.is_file():
            self._json(HTTPStatus.NOT_FOUND, {"error": "not found"})
            return
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        self._send(HTTPStatus.OK, path.read_bytes(), kind)

    def _query(self, name: str, args: dict[str, list[str]]) -> None:
        one = {k: v[-1] for k, v in args.items()}
        try:
            queries.load(name)
            params = queries.window(one.get("since", "1h"), now=None,
                                    limit=int(one.get("limit", 5000)),
                                    **{k: one.get(k, "") for k in FILTERS})
        except (KeyError, ValueError) as exc:
            self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        try:
            client = connect(self.settings)
            try:
                rows = queries.run(client, name, params)
            finally:
                client.disconnect()
        except Exception as exc:  # ClickHouse down or failing: tell the page why
            reason = " ".join(str(exc).splitlines()[:2]) or repr(exc)
            self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"ClickHouse: {reason}"})
            return
        self._json(HTTPStatus.OK, {"query": name, "rows": rows})

    def _json(self, status: HTTPStatus, body: Any) -> None:
        self._send(status, json.dumps(body).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)


def make_server(settings: Settings, port: int, refresh_s: float = 5.0) -> ThreadingHTTPServer:
    """Bound to loopback only; port 0 picks a free port (``server.server_address``)."""
    handler = partial(DashboardHandler, settings=settings, refresh_s=refresh_s)
    return ThreadingHTTPServer((LOOPBACK, port), handler)


def serve(settings: Settings, port: int, refresh_s: float = 5.0) -> None:
    server = make_server(settings, port, refresh_s)
    print(f"loraplane dashboard on http://{LOOPBACK}:{server.server_port}/ (Ctrl-C to stop)",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
