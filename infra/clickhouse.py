"""ClickHouse as our own process: own config, data under ``<home>/clickhouse``, loopback only.

We never touch the Debian package's service or /etc/clickhouse-server: the generated
config.xml/users.xml use the ports from the settings so a system ClickHouse can coexist.
The XML is in the old ``<yandex>`` dialect, which Debian's 18.16 and newer releases accept.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from loraplane.infra.processes import StackError
from loraplane.infra.service import Port, Service
from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.config import CLICKHOUSE_NAME_PATTERN
from loraplane.kernel.secrets import ensure_secret, write_private

__all__ = ["BINARY_CANDIDATES", "ClickHouse", "users_xml"]

BINARY_CANDIDATES = ("/usr/sbin/clickhouse-server", "/usr/bin/clickhouse-server")

_CONFIG = """<?xml version="1.0"?>
<yandex>
  <logger><level>warning</level><console>1</console></logger>
  <listen_host>{host}</listen_host>
  <tcp_port>{tcp}</tcp_port>
  <http_port>{http}</http_port>
  <interserver_http_port>{interserver}</interserver_http_port>
  <interserver_http_host>{host}</interserver_http_host>
  <path>{data}/</path>
  <tmp_path>{data}/tmp/</tmp_path>
  <user_files_path>{data}/user_files/</user_files_path>
  <format_schema_path>{data}/format_schemas/</format_schema_path>
  <users_config>{users}</users_config>
  <default_profile>default</default_profile>
  <default_database>default</default_database>
  <max_concurrent_queries>64</max_concurrent_queries>
  <mark_cache_size>268435456</mark_cache_size>
  <uncompressed_cache_size>268435456</uncompressed_cache_size>
  <mlock_executable>false</mlock_executable>
</yandex>
"""
# No `default` user: every login has a password (sha256 in the file, the secret only in
# secrets_dir), the reader's profile is readonly=2 (reads, and settings a query asks for, such
# as max_execution_time; no INSERT, no DDL, and `readonly` itself cannot be lowered).
_USERS = """<?xml version="1.0"?>
<yandex>
  <profiles>
    <default><max_memory_usage>2000000000</max_memory_usage></default>
    <reader><max_memory_usage>2000000000</max_memory_usage><readonly>2</readonly>
      <allow_ddl>0</allow_ddl></reader>
  </profiles>
  <users>{users}
  </users>
  <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
    <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time>
  </interval></default></quotas>
</yandex>
"""
_USER = """
    <{user}>
      <password_sha256_hex>{digest}</password_sha256_hex>
      <networks><ip>127.0.0.1</ip><ip>::1</ip></networks>
      <profile>{profile}</profile>
      <quota>default</quota>
    </{user}>"""
_NAME = re.compile(CLICKHOUSE_NAME_PATTERN)


def users_xml(logins: list[tuple[str, str, str]]) -> str:
    """users.xml for (user, password, profile) triples; only the passwords' sha256 is
    written, so the file leaks no secret."""
    for user, _, _ in logins:
        if not _NAME.fullmatch(user):
            raise StackError(f"invalid ClickHouse user name {user!r}: use letters, digits, _")
    return _USERS.format(
        users="".join(
            _USER.format(
                user=user, digest=hashlib.sha256(password.encode()).hexdigest(), profile=profile
            )
            for user, password, profile in logins
        )
    )


@dataclass(frozen=True)
class ClickHouse(Service):
    name = "clickhouse"
    start_timeout = 60.0

    @property
    def dir(self) -> Path:
        return self.home / "clickhouse"

    def marker(self) -> str:
        return str(self.dir / "config.xml")

    def ports(self) -> list[Port]:
        c = self.settings.clickhouse
        env = "LORAPLANE_CLICKHOUSE__"
        return [
            Port("clickhouse tcp", c.host, c.tcp_port, f"{env}TCP_PORT"),
            Port("clickhouse http", c.host, c.http_port, f"{env}HTTP_PORT"),
            Port("clickhouse interserver", c.host, c.interserver_port, f"{env}INTERSERVER_PORT"),
        ]

    def endpoint(self) -> str:
        c = self.settings.clickhouse
        return f"tcp://{c.host}:{c.tcp_port} http://{c.host}:{c.http_port}"

    def data_dirs(self) -> list[Path]:
        return [self.dir]

    @staticmethod
    def binary() -> str:
        found = next(
            (b for b in BINARY_CANDIDATES if Path(b).is_file()), shutil.which("clickhouse-server")
        )
        if found is None:
            raise StackError(
                "clickhouse-server is not installed; run ./run setup "
                "(or: apt-get install -y clickhouse-server)"
            )
        return found

    def prepare(self) -> list[str]:
        c = self.settings.clickhouse
        data = self.dir / "data"
        for sub in ("tmp", "user_files", "format_schemas"):
            (data / sub).mkdir(parents=True, exist_ok=True)
        users = self.dir / "users.xml"
        write_private(  # the passwords' hashes: the owner's only
            users,
            users_xml(
                [
                    (c.user, self._password(c.user, writer=True), "default"),
                    (c.reader_user, self._password(c.reader_user), "reader"),
                ]
            ),
        )
        write_atomic(
            Path(self.marker()),
            _CONFIG.format(
                host=c.host,
                tcp=c.tcp_port,
                http=c.http_port,
                interserver=c.interserver_port,
                data=escape(str(data)),
                users=escape(str(users)),
            ),
        )
        return [self.binary(), f"--config-file={self.marker()}"]

    def _password(self, user: str, writer: bool = False) -> str:
        """A password given in the settings, else the secret file (made when missing)."""
        c = self.settings.clickhouse
        given = c.password if writer else c.reader_password
        return given.get_secret_value() if given else ensure_secret(c.password_file(user))

    def _query(self, sql: str) -> list[tuple[object, ...]]:
        from clickhouse_driver import Client

        c = self.settings.clickhouse
        user, password = c.login()
        client = Client(
            host=c.host,
            port=c.tcp_port,
            user=user,
            password=password,
            connect_timeout=2,
            send_receive_timeout=5,
        )
        try:
            return client.execute(sql)
        finally:
            client.disconnect()

    def healthy(self) -> bool:
        return self._query("SELECT 1") == [(1,)]

    def after_start(self) -> None:
        self._query(f"CREATE DATABASE IF NOT EXISTS `{self.settings.clickhouse.database}`")

    def version(self) -> str:
        return str(self._query("SELECT version()")[0][0])
