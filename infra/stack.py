"""``stack up | down | status``: the three services, in order, with progress and health waits.

``up`` is idempotent: a service whose PID file points at our live process is left alone.
Everything is started first and waited for afterwards, so the JVMs (Kafka, s3proxy) and
ClickHouse boot in parallel on a small machine. Every socket a service binds is checked
before anything starts (``check_binds``): a loopback address and a port in range, so no
setting (``kafka.host`` naming a deployment's brokers, ``0.0.0.0``) makes a local service
listen beyond this host.
"""

from __future__ import annotations

import ipaddress
import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from loraplane.infra.clickhouse import ClickHouse
from loraplane.infra.kafka import kafka_nodes
from loraplane.infra.processes import StackError, port_in_use, wait_until
from loraplane.infra.s3 import S3
from loraplane.infra.service import Service

if TYPE_CHECKING:
    from loraplane.kernel.config import Settings

__all__ = [
    "LOG_LINES_ON_FAILURE",
    "Health",
    "check_binds",
    "down",
    "healthy",
    "print_status",
    "service",
    "services",
    "status",
    "up",
]

LOG_LINES_ON_FAILURE = 25


def services(settings: Settings) -> list[Service]:
    return [*kafka_nodes(settings), ClickHouse(settings), S3(settings)]


def service(settings: Settings, name: str) -> Service:
    found = {s.label: s for s in services(settings)}
    if name not in found:
        raise StackError(f"unknown service {name!r}; choose from {', '.join(found)}")
    return found[name]


@dataclass(frozen=True)
class Health:
    name: str
    endpoint: str
    pid: int | None
    healthy: bool
    version: str


def _probe(svc: Service) -> Health:
    try:
        ok = svc.healthy()
    except Exception:
        ok = False
    version = "-"
    if ok:
        try:
            version = svc.version()
        except Exception as exc:
            version = f"unknown ({exc})"
    return Health(svc.label, svc.endpoint(), svc.process.pid(), ok, version)


def status(settings: Settings) -> list[Health]:
    return [_probe(svc) for svc in services(settings)]


def healthy(settings: Settings) -> bool:
    return all(h.healthy for h in status(settings))


def print_status(settings: Settings, console: Console) -> bool:
    table = Table("service", "endpoint", "version", "pid", "health")
    rows = status(settings)
    for h in rows:
        table.add_row(
            h.name,
            h.endpoint,
            h.version,
            str(h.pid or "-"),
            "[green]healthy[/]" if h.healthy else "[red]down[/]",
        )
    console.print(table)
    return all(h.healthy for h in rows)


def _loopback(host: str) -> bool:
    """A loopback IP address, written as one (a name is resolved by DNS, not decided here)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_binds(settings: Settings) -> None:
    """Raise StackError unless every socket of every service is a loopback address and a
    port from 1 to 65535 (Kafka's later nodes add to its ports)."""
    for svc in services(settings):
        for port in svc.ports():
            if not _loopback(port.host):
                raise StackError(
                    f"{svc.label}: the local stack listens on loopback only, not on "
                    f"{port.host[:64]!r} ({port.what}); a deployment's own services are "
                    "not started by `stack up`"
                )
            if not 1 <= port.number <= 65535:
                raise StackError(
                    f"{svc.label}: port {port.number} ({port.what}) is not from 1 to 65535; "
                    f"set {port.env}"
                )


def _check_ports(svc: Service) -> None:
    for port in svc.ports():
        if port_in_use(port.host, port.number):
            raise StackError(
                f"{svc.label}: port {port.number} ({port.what}) on {port.host} is already in use "
                f"by another process; stop that process or set {port.env}"
            )


def _fail(svc: Service, why: str, console: Console) -> StackError:
    console.print(f"[red]✗ {svc.label}: {why}[/]; last lines of {svc.process.log_file}:")
    for line in svc.process.tail(LOG_LINES_ON_FAILURE):
        console.print(f"  {line}", markup=False, highlight=False)
    return StackError(f"{svc.label}: {why} (log: {svc.process.log_file})")


def up(settings: Settings, console: Console, apply_topics: bool = True) -> None:
    """Start whatever is not running, wait until all are ready, then apply the topics. Every
    port is checked before anything starts, and a service that fails (or an interrupt) stops
    the services this call started: ``up`` leaves the stack whole or as it found it."""
    check_binds(settings)
    todo: list[Service] = []
    for svc in services(settings):
        if svc.process.running():
            console.print(f"• {svc.label} already running (pid {svc.process.pid()})")
        else:
            todo.append(svc)
    for svc in todo:
        _check_ports(svc)
    started: list[Service] = []
    try:
        for svc in todo:
            with console.status(f"{svc.label}: preparing"):
                argv = svc.prepare()
            pid = svc.process.start(argv)
            started.append(svc)
            console.print(f"• {svc.label} started (pid {pid}), log {svc.process.log_file}")
        for svc in services(settings):
            t0 = time.monotonic()
            with console.status(f"{svc.label}: waiting until ready at {svc.endpoint()}"):
                ok = wait_until(svc.ready, svc.start_timeout, alive=svc.process.running)
                if not ok:
                    dead = not svc.process.running()
                    raise _fail(
                        svc,
                        "exited during start-up"
                        if dead
                        else f"not ready after {svc.start_timeout:.0f}s",
                        console,
                    )
                svc.after_start()
            if svc in started:
                console.print(f"[green]✓ {svc.label} ready[/] in {time.monotonic() - t0:.1f}s")
    except BaseException:
        for svc in reversed(started):
            svc.process.stop()
            console.print(f"• {svc.label} stopped: `up` did not complete")
        raise
    if apply_topics:
        from loraplane.kernel import topics
        from loraplane.kernel.bus import keys_spread
        from loraplane.kernel.worker_states import clear_left_behind

        with console.status("kafka: applying topics"):
            changes = topics.apply(settings, clear_grown=clear_left_behind, spread=keys_spread)
        applied = [c for c in changes if c.action not in ("unchanged", "refused")]
        refused = [c for c in changes if c.action == "refused"]
        mark = "[yellow]! topics[/]" if refused else "[green]✓ topics[/]"
        console.print(
            f"{mark}: {len(applied)} changed, {len(refused)} refused, "
            f"{len(changes) - len(applied) - len(refused)} unchanged"
            + (" (see `loraplane topics apply`)" if refused else "")
        )
        for change in [*applied, *refused]:
            console.print(f"  {change}", markup=False, soft_wrap=True)


def down(settings: Settings, console: Console, purge: bool = False) -> None:
    """Stop only what we started (PID file + command-line check); keep data unless purge."""
    for svc in reversed(services(settings)):
        with console.status(f"{svc.label}: stopping"):
            stopped = svc.process.stop()
        console.print(f"• {svc.label} {'stopped' if stopped else 'was not running'}")
        if purge:
            for path in svc.data_dirs():
                shutil.rmtree(path, ignore_errors=True)
                console.print(f"  purged {path}")
