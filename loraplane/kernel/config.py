"""One typed settings object for endpoints, local paths and the cache policy.

Sources, later ones winning: defaults, the YAML file (``LORAPLANE_CONFIG`` or
``./loraplane.yaml``), then environment variables such as ``LORAPLANE_KAFKA__PORT=29092``.
Every local service binds to loopback only, and so does every listener of loraplane's own
runtimes unless ``listen_host`` says otherwise (a pod network only: the Helm chart); the
defaults avoid the services' usual ports so that a developer's own Kafka or ClickHouse is
never touched.
"""

from __future__ import annotations

import ipaddress
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from loraplane.kernel.policy import Policy
from loraplane.kernel.secrets import read_secret
from loraplane.schemas.base import Identifier
from loraplane.schemas.validation_text import error_line

__all__ = [
    "CLICKHOUSE_NAME_PATTERN",
    "LOOPBACK",
    "MAX_CONFIG_BYTES",
    "ClickHouseSettings",
    "HttpLimits",
    "KafkaSettings",
    "S3Settings",
    "Settings",
    "SettingsError",
    "VllmSettings",
    "get_settings",
]

LOOPBACK = "127.0.0.1"
_Port = Annotated[int, Field(ge=1, le=65535)]
"""A fixed TCP port of a service (a local one binds it, clients dial it)."""
CLICKHOUSE_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
_ClickHouseName = Annotated[str, Field(pattern=CLICKHOUSE_NAME_PATTERN)]
"""A database or user name: it reaches DDL as a `quoted` identifier (no parameter can
stand for one), users.xml as an element name and the secrets folder as ``clickhouse-USER``."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KafkaSettings(_Section):
    host: str = LOOPBACK
    port: _Port = 19092
    controller_port: _Port = 19093
    version: str = "4.1.1"
    scala_version: str = "2.13"
    brokers: int = Field(
        1,
        ge=1,
        le=9,
        description="KRaft nodes of the local cluster (each broker+controller). Node n (from "
        "1) listens on port + 2(n-1), its controller on controller_port + 2(n-1); "
        "stack up, topics apply (replication) and the bootstrap list read it.",
    )
    heap: str | None = Field(
        None,
        description="-Xmx of each broker JVM; default 768m for one broker, 384m each "
        "when there are several (a 3-node cluster on a small machine).",
    )
    username: str | None = Field(
        None,
        description="SASL/SCRAM user of this process. Unset: the principal its runtime "
        "picks (loraplane.kernel.kafka.act_as) from credentials_dir.",
    )
    password_file: Path | None = Field(
        None,
        description="The file (mode 0600) holding username's password; required with "
        "username. Never put a password in the config itself.",
    )
    credentials_dir: Path | None = Field(
        None,
        description="One <principal>.password file per principal, as the local stack "
        "writes them (default: secrets_dir/kafka). When it does not "
        "exist and username is unset, clients speak PLAINTEXT.",
    )
    sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512"] = "SCRAM-SHA-256"
    bootstrap_servers: str | None = Field(
        None,
        description="HOST:PORT[,HOST:PORT...] clients bootstrap from, as given (a "
        "managed cluster's bootstrap Service, e.g. Strimzi's "
        "CLUSTER-kafka-bootstrap:9092); default: every node of host, "
        "port and brokers. brokers still sets the topics' copies.",
    )

    @property
    def bootstrap(self) -> str:
        """Every node's listener, so a client starts even while one node is down."""
        if self.bootstrap_servers:
            return self.bootstrap_servers
        return ",".join(f"{self.host}:{self.node_port(n)}" for n in range(1, self.brokers + 1))

    def node_port(self, node: int) -> int:
        """Node ``node``'s (from 1) client listener: ``port``, then every second port."""
        return self.port + 2 * (node - 1)

    def node_controller_port(self, node: int) -> int:
        return self.controller_port + 2 * (node - 1)

    @property
    def heap_per_broker(self) -> str:
        return self.heap or ("768m" if self.brokers == 1 else "384m")


class ClickHouseSettings(_Section):
    host: str = LOOPBACK
    tcp_port: _Port = 19000
    http_port: _Port = 18123
    interserver_port: _Port = 19009
    database: _ClickHouseName = "loraplane"
    user: _ClickHouseName = Field(
        "loraplane", description="the writer: the metrics sink, migrations"
    )
    password: SecretStr | None = Field(
        None, description="default: the file secrets_dir/clickhouse-USER (stack up makes it)"
    )
    reader_user: _ClickHouseName = Field(
        "loraplane_reader", description="read-only (readonly=2): report, dashboard, queries"
    )
    reader_password: SecretStr | None = None
    secrets_dir: Path | None = Field(None, description="default: Settings.secrets_dir")

    def login(self, *, reader: bool = False) -> tuple[str, str]:
        """User and password of the writer (or the read-only reader); read when connecting."""
        user, given = (
            (self.reader_user, self.reader_password) if reader else (self.user, self.password)
        )
        if given is not None:
            return user, given.get_secret_value()
        return user, read_secret(self.password_file(user))

    def password_file(self, user: str) -> Path:
        return (self.secrets_dir or Path(".loraplane/secrets")) / f"clickhouse-{user}"


class S3Settings(_Section):
    endpoint_url: str = f"http://{LOOPBACK}:15000"
    port: _Port = 15000
    bucket: str = "loraplane-artifacts"
    region: str = "us-east-1"
    access_key_id: str = "loraplane"
    server_version: str = Field("3.0.0", description="org.gaul:s3proxy that `stack up` runs")
    heap: str = "256m"
    secret_access_key: SecretStr | None = Field(
        None, description="default: the file credentials_file (stack up makes it)"
    )
    credentials_file: Path | None = Field(None, description="default: secrets_dir/s3-secret")
    allowed_prefixes: list[str] = Field(
        default_factory=lambda: ["s3://loraplane-artifacts/"],
        description="Only artifacts under these URI prefixes may ever be fetched.",
    )

    def secret(self) -> str:
        """The secret access key of ``access_key_id``; read when a client is made."""
        if self.secret_access_key is not None:
            return self.secret_access_key.get_secret_value()
        return read_secret(self.credentials_file or Path(".loraplane/secrets/s3-secret"))


class VllmSettings(_Section):
    api_key_file: Path | None = Field(
        None,
        description="vLLM's API key (VLLM_API_KEY) file; default: one per vLLM port, "
        "secrets_dir/vllm-PORT.key, made by `loraplane vllm serve`.",
    )


class HttpLimits(_Section):
    """Connection bounds shared by every HTTP server loraplane runs (the gateway, the
    worker's /metrics listener, the dashboard): ``loraplane.kernel.http_server``."""

    header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="a request head must be complete by then"
    )
    body_timeout_s: float = Field(
        30.0, gt=0, le=600, description="a request body must be complete by then"
    )
    keepalive_timeout_s: float = Field(
        15.0, gt=0, le=3600, description="an idle keep-alive connection is closed"
    )
    send_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="an answer the client takes no byte of for this long (its buffers full: "
        "it stopped reading) closes the connection",
    )
    max_connections: int = Field(
        16_384,
        ge=1,
        le=1_000_000,
        description="open connections per server (and all servers of a process within its "
        "descriptor limit); at the cap the one waiting longest on its client is "
        "closed",
    )
    max_header_bytes: int = Field(
        16 * 1024, ge=1024, le=1024 * 1024, description="request line + headers"
    )
    max_headers: int = Field(64, ge=8, le=1000)
    max_body_bytes: int = Field(1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    error_log_interval_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="a burst of connection errors logs one count per "
        "kind per interval, not a line each",
    )


class Settings(BaseSettings):
    """Everything a loraplane process needs to find its peers and its policy."""

    model_config = SettingsConfigDict(
        env_prefix="LORAPLANE_", env_nested_delimiter="__", extra="forbid"
    )

    home: Path = Field(default_factory=lambda: Path.cwd() / ".loraplane")
    topic_prefix: str = Field(
        "loraplane",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="starts every topic, ACL pattern and consumer group: Kafka's topic "
        "characters, not a leading '.', '_' or '-', at most 100",
    )
    keyring_path: Path = Field(
        default_factory=lambda data: data["home"] / "keyring.yaml",
        description="Publishers' public keys the registry trusts; re-read when it changes.",
    )
    planner_key_path: Path = Field(
        default_factory=lambda data: data["home"] / "keys" / "planner.key",
        description="The planner's private key file (mode 0600) that signs cache commands; "
        "its public key is in the keyring with role planner.",
    )
    schedules_path: Path = Field(
        default_factory=lambda data: data["home"] / "schedules.yaml",
        description="Known traffic peaks to prewarm for (streams.schedules); re-read when "
        "it changes.",
    )
    secrets_dir: Path = Field(
        default_factory=lambda data: data["home"] / "secrets",
        description="Local services' credentials (mode 0600 files, loraplane.kernel.secrets).",
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = Field(default_factory=ClickHouseSettings)
    s3: S3Settings = Field(default_factory=S3Settings)
    vllm: VllmSettings = Field(default_factory=VllmSettings)
    policy: Policy = Field(default_factory=Policy)
    base_model_aliases: dict[str, Identifier] = Field(
        default_factory=dict,
        description="What PEFT writes as base_model_name_or_path (a hub id or the local path "
        "the trainer loaded) -> the base-model id it stands for. Publishers and "
        "workers must read the same map.",
    )
    http: HttpLimits = Field(default_factory=HttpLimits)
    listen_host: str = Field(
        LOOPBACK,
        description="The address the runtimes' listeners bind: the router, the "
        "worker's gateway, every --metrics-port. Keep "
        "127.0.0.1 on a host; only a pod, whose network namespace is "
        "its own, binds 0.0.0.0 (the Helm chart sets it). vLLM and the "
        "dashboard stay on loopback whatever it says.",
    )
    gateway_secret_file: Path | None = Field(
        None,
        description="The gateway's secret for per-tenant cache salts (default: "
        "home/gateway-secret; created with mode 0600 when missing).",
    )
    router_secret_file: Path | None = Field(
        None,
        description="The fleet routers' HMAC secret for forwarded tenants, shared with "
        "the worker gateways (default: secrets_dir/router-secret; the router "
        "creates it with mode 0600 when missing).",
    )
    api_keys_file: Path | None = Field(
        None, description="Gateway API-key digests -> tenant (default: home/api-keys.json)."
    )
    spool_dir: Path = Field(
        default_factory=lambda data: data["home"] / "spool",
        description="Events Kafka did not take (an outage), one folder per producing client, "
        "replayed in order when the broker is back (eventlog.spool).",
    )
    event_journal: bool = Field(
        True,
        description="Journal every event of a log topic (request logs, cache events, "
        "dead letters) to local disk before emit returns, until Kafka acks "
        "it, so a process killed -9 loses none (eventlog.journal). "
        "Off: a kill loses what librdkafka held in memory.",
    )
    spool_max_bytes: int = Field(
        512 * 1024 * 1024,
        ge=0,
        description="Bound of each client's spool; an event past it is dropped, counted "
        "(loraplane_event_sink_dropped_total) and logged with the count.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

    @field_validator("listen_host")
    @classmethod
    def _an_address(cls, value: str) -> str:
        """An IP address, never a name: what a listener binds is decided here, not by DNS."""
        ipaddress.ip_address(value)
        return value

    @model_validator(mode="after")
    def _secret_paths(self) -> Settings:
        """The sections that read secrets find them under ``secrets_dir`` unless told."""
        if self.clickhouse.secrets_dir is None:
            self.clickhouse.secrets_dir = self.secrets_dir
        if self.s3.credentials_file is None:
            self.s3.credentials_file = self.secrets_dir / "s3-secret"
        if self.kafka.credentials_dir is None:
            self.kafka.credentials_dir = self.secrets_dir / "kafka"
        return self

    def vllm_api_key_path(self, port: int) -> Path:
        """The API key of the vLLM on ``port``: the server and its worker read one file."""
        return self.vllm.api_key_file or self.secrets_dir / f"vllm-{port}.key"

    @property
    def api_keys_path(self) -> Path:
        return self.api_keys_file or self.home / "api-keys.json"

    @property
    def gateway_secret_path(self) -> Path:
        return self.gateway_secret_file or self.home / "gateway-secret"

    @property
    def router_secret_path(self) -> Path:
        return self.router_secret_file or self.secrets_dir / "router-secret"

    @property
    def state_dir(self) -> Path:
        """Data, logs, PID files and download caches of the local stack."""
        return self.home


MAX_CONFIG_BYTES = 1024 * 1024
"""The most the config file is read: settings and a policy are a few KiB."""


class _YamlSource(PydanticBaseSettingsSource):
    """Reads the YAML config file; the policy section may use the seed's key name."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = Path(os.environ.get("LORAPLANE_CONFIG", "loraplane.yaml"))
        from loraplane.kernel.local_files import read_regular
        from loraplane.schemas.bounded_yaml import load_yaml

        try:
            raw = read_regular(path, MAX_CONFIG_BYTES)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise ValueError(f"{path}: {exc.strerror or exc}") from None
        try:
            data = load_yaml(raw.decode()) or {}
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not UTF-8 text") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping")
        if "adapter_cache_policy" in data:
            data["policy"] = data.pop("adapter_cache_policy")
        return data


class SettingsError(ValueError):
    """The environment or the config file holds a setting that is not valid: each one's
    place and why, without the input pydantic would echo (it may sit beside a password)."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings; a ``SettingsError`` names every invalid one (the CLI prints
    it as a usage error instead of a traceback)."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsError(f"invalid settings: {error_line(exc, 'settings')}") from None
    except (ValueError, yaml.YAMLError) as exc:  # the config file: not YAML, too large, ...
        raise SettingsError(f"invalid config file: {str(exc)[:500]}") from None
