"""One way to open a ClickHouse connection, so timeouts and the database name live in one place."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from loraplane.kernel.config import CLICKHOUSE_NAME_PATTERN

if TYPE_CHECKING:
    from clickhouse_driver import Client

    from loraplane.kernel.config import Settings

__all__ = ["DATABASE_RE", "checked_database", "connect", "unavailable", "unavailable_errors"]

DATABASE_RE = re.compile(CLICKHOUSE_NAME_PATTERN)


def checked_database(name: str) -> str:
    """Database names end up in DDL (they cannot be bound as parameters), so only plain
    identifiers are accepted."""
    if not DATABASE_RE.fullmatch(name):
        raise ValueError(f"invalid ClickHouse database name {name!r}: use letters, digits, _")
    return name


def connect(
    settings: Settings,
    *,
    database: str | None = None,
    timeout_s: float = 10.0,
    reader: bool = False,
) -> Client:
    """A native-protocol client for ``settings.clickhouse``; ``database=""`` connects to the
    server's default database (needed before ours exists). ``reader``: the read-only login
    (reports, dashboards), which can neither write nor change the schema."""
    from clickhouse_driver import Client

    c = settings.clickhouse
    db = c.database if database is None else database
    user, password = c.login(reader=reader)
    return Client(
        host=c.host,
        port=c.tcp_port,
        user=user,
        password=password,
        database=checked_database(db) if db else "default",
        connect_timeout=min(timeout_s, 5.0),
        send_receive_timeout=timeout_s,
    )


def unavailable_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean "ClickHouse cannot be read now" (server away, a query it
    refused, its password file missing), for a command to say so in one line."""
    from clickhouse_driver import errors as ch_errors

    from loraplane.kernel.secrets import SecretError

    return (ch_errors.Error, SecretError, OSError, EOFError)


def unavailable(settings: Settings, exc: BaseException) -> str:
    """``cannot read ClickHouse at HOST:PORT, database DB: WHY``, the server's own lines of
    WHY only (no stack trace)."""
    from clickhouse_driver import errors as ch_errors

    c = settings.clickhouse
    first = " ".join(str(exc).split("Stack trace:")[0].split())
    if isinstance(exc, ch_errors.SocketTimeoutError):  # its text is the code and address only
        first = f"no answer in time (hung or overloaded): {first}"
    return f"cannot read ClickHouse at {c.host}:{c.tcp_port}, database {c.database}: {first}"
