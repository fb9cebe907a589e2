"""``loraplane dashboard``: a small loopback web server for the live charts.

Self-contained assets in ``dashboards/static`` (no CDN: the machines have no internet). The
page polls a tiny JSON API, ``GET /api/query/<name>?since=1h&adapter_id=...``, which runs one
query of the pack (``loraplane.metrics.queries``) with bound parameters. Every parameter is
checked before a query runs (``query_params``): an unknown name, a bad or out-of-range
``since`` (longer than ``queries.MAX_WINDOW``) or ``limit`` (1 to ``queries.MAX_LIMIT``), and
a filter that is not an id (a version for ``adapter_version``) are 400s with the reason; a
ClickHouse failure is a 503 with the reason, so the page can show it.

The fleet panel is ``GET /api/fleet``: ``router.fleet_view`` (the view ``loraplane fleet
status`` prints) of the compacted worker-state topic, read from Kafka, not ClickHouse: the
latest heartbeat per worker is state, not history, so it gets no table. One read serves every
page for ``refresh_s / 2``; a broker that does not answer is a 503 with the reason.

An aiohttp app behind the shared connection bounds (``loraplane.kernel.http_server``); queries
run on a pool of ``QUERY_THREADS``. Only a loopback ``Host`` is served (DNS rebinding:
docs/security.md). Every answer carries ``SECURITY_HEADERS`` (no inline script, no frames).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import mimetypes
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from loraplane.kernel.config import LOOPBACK
from loraplane.kernel.http_server import ANSWER_HEADERS, bound_port, start_site
from loraplane.kernel.worker_states import latest_fleet_states
from loraplane.metrics import queries
from loraplane.metrics.clickhouse import connect
from loraplane.router.fleet_view import fleet_view

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings

__all__ = [
    "DEFAULT_LIMIT",
    "FILTERS",
    "FLEET_READ_TIMEOUT_S",
    "QUERY_THREADS",
    "SECURITY_HEADERS",
    "STATIC",
    "Dashboard",
    "query_params",
    "serve",
    "start",
]

STATIC = Path(__file__).resolve().parent / "static"
FILTERS = queries.FILTERS
QUERY_THREADS = 4
FLEET_READ_TIMEOUT_S = 4.0  # with live workers beating the read never idles: bounded
DEFAULT_LIMIT = "5000"
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}
"""On every answer of the dashboard's server (``kernel.http_server.ANSWER_HEADERS``): its
page, files, API, errors and refusals, and the connection-level ones (aiohttp's 400 for a
head it cannot parse, the 431 for one too large). A script injected into the page (a value
the page shows) would not run, and no other site may frame it (clickjacking) or learn its
URL (its filters) from a link."""


log = logging.getLogger("loraplane.dashboard")


def query_params(given: dict[str, str]) -> queries.Params:
    """The pack's parameters from a page's query string; ValueError naming the parameter
    and the reason for anything out of range. A filter is '' (all) or what the column can
    hold (``queries.check_filters``): no query runs for a value that can match nothing."""
    return queries.window(
        given.get("since", "1h"),
        now=None,
        limit=queries.parse_limit(given.get("limit", DEFAULT_LIMIT)),
        **{k: given.get(k, "") for k in FILTERS},
    )


def _loopback_host(host: str | None) -> bool:
    """``host`` (a Host header: name or address, maybe a port) names this machine's
    loopback: ``localhost`` or a loopback address, never another name."""
    if host is None:
        return False
    name = host.rpartition("]")[0].removeprefix("[") if host.startswith("[") else host
    if not host.startswith("["):
        name = host.partition(":")[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _json(status: HTTPStatus, body: Any) -> web.Response:
    return _send(status, json.dumps(body).encode(), "application/json")


def _send(status: HTTPStatus, body: bytes, content_type: str) -> web.Response:
    return web.Response(
        status=status,
        body=body,
        headers={"Content-Type": content_type, "Cache-Control": "no-store"},
    )


class Dashboard:
    def __init__(self, settings: Settings, refresh_s: float = 5.0) -> None:
        self.settings = settings
        self.refresh_s = refresh_s
        self._pool = ThreadPoolExecutor(QUERY_THREADS, thread_name_prefix="dashboard-query")
        self._fleet_lock = asyncio.Lock()
        self._fleet_cache: tuple[float, dict[str, Any]] | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1024)  # GET only: no body to speak of
        app.router.add_get("/{tail:.*}", self.get)
        app[ANSWER_HEADERS] = SECURITY_HEADERS  # on every answer of its server
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _: web.Application) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def get(self, request: web.Request) -> web.Response:
        if not _loopback_host(request.headers.get("Host")):
            return _json(HTTPStatus.FORBIDDEN, {"error": "the dashboard answers loopback only"})
        path = request.path
        if path in ("/", "/index.html"):
            html = (STATIC / "index.html").read_text()
            return _send(
                HTTPStatus.OK,
                html.replace("{{REFRESH_MS}}", str(int(self.refresh_s * 1000))).encode(),
                "text/html; charset=utf-8",
            )
        if path.startswith("/static/"):
            return self._static(path.removeprefix("/static/"))
        if path.startswith("/api/query/"):
            return await self._query(
                path.removeprefix("/api/query/"),
                {k: request.query.getall(k)[-1] for k in request.query},
            )
        if path == "/api/fleet":
            return await self._fleet()
        if path == "/api/queries":
            return _json(
                HTTPStatus.OK,
                [{"name": n, "summary": queries.load(n).summary} for n in queries.names()],
            )
        return _json(HTTPStatus.NOT_FOUND, {"error": f"no such page {path}"})

    @staticmethod
    def _static(name: str) -> web.Response:
        """One of the files the dashboard ships, looked up among them: a client's name is
        never opened as it was spelled (a NUL byte, ``..`` or an over-long name is just no
        such file)."""
        shipped = {p.name: p for p in STATIC.iterdir() if p.is_file()}
        path = shipped.get(name)
        if path is None:
            return _json(HTTPStatus.NOT_FOUND, {"error": "not found"})
        kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        return _send(HTTPStatus.OK, path.read_bytes(), kind)

    async def _query(self, name: str, one: dict[str, str]) -> web.Response:
        try:
            queries.load(name)
            params = query_params(one)
        except (KeyError, ValueError) as exc:
            return _json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
        try:
            rows = await asyncio.get_running_loop().run_in_executor(
                self._pool, self._run, name, params
            )
        except Exception as exc:  # ClickHouse down or failing: tell the page why
            reason = " ".join(str(exc).splitlines()[:2]) or repr(exc)
            return _json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"ClickHouse: {reason}"})
        return _json(HTTPStatus.OK, {"query": name, "rows": rows})

    async def _fleet(self) -> web.Response:
        async with self._fleet_lock:  # concurrent pages share one read of the topic
            cached = self._fleet_cache
            if cached is None or time.monotonic() - cached[0] > self.refresh_s / 2:
                try:
                    body = await asyncio.get_running_loop().run_in_executor(
                        self._pool, self._read_fleet
                    )
                except Exception as exc:  # the broker away: tell the page why
                    reason = " ".join(str(exc).splitlines()[:2]) or repr(exc)
                    return _json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"Kafka: {reason}"})
                cached = self._fleet_cache = (time.monotonic(), body)
        return _json(HTTPStatus.OK, cached[1])

    def _read_fleet(self) -> dict[str, Any]:
        latest = latest_fleet_states(self.settings, timeout_s=FLEET_READ_TIMEOUT_S)
        heartbeat_s = self.settings.policy.worker_heartbeat_s
        view = fleet_view(
            latest.workers.values(), time.time(), heartbeat_s, latest.routers.values()
        )
        return {
            **view.as_json(),
            "malformed_states": latest.malformed,
            "complete": latest.complete,
            "heartbeat_s": heartbeat_s,
        }

    def _run(self, name: str, params: queries.Params) -> Any:
        client = connect(self.settings, reader=True)
        try:
            return queries.run(client, name, params)
        finally:
            client.disconnect()


async def start(settings: Settings, port: int, refresh_s: float = 5.0) -> web.AppRunner:
    """Bound to loopback only, within ``settings.http``; port 0 picks a free port
    (``loraplane.kernel.http_server.bound_port``)."""
    runner, _ = await start_site(
        Dashboard(settings, refresh_s).app(), LOOPBACK, port, settings.http, name="dashboard"
    )
    return runner


def serve(settings: Settings, port: int, refresh_s: float = 5.0) -> None:
    async def main() -> None:
        runner = await start(settings, port, refresh_s)
        print(
            f"loraplane dashboard on http://{LOOPBACK}:{bound_port(runner)}/ (Ctrl-C to stop)",
            flush=True,
        )
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
