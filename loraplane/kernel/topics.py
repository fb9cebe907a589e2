"""Every Kafka topic of loraplane, declared once, and the idempotent ``topics apply``.

Components never spell a topic name: they call ``topic_name(settings, "requests")`` so the
prefix (``settings.topic_prefix``) and the set of topics stay in this one file. ``apply``
converges the broker to these declarations: it creates missing topics, alters configs that
differ, grows partition counts and refuses to shrink them (Kafka cannot, and re-keying
would break per-key ordering).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from loraplane.kernel import acls, kafka
from loraplane.kernel.kafka import Principal

if TYPE_CHECKING:
    from collections.abc import Callable
    from concurrent.futures import Future

    from confluent_kafka.admin import AdminClient

    from loraplane.kernel.config import Settings

__all__ = [
    "DAY_MS",
    "FOREVER",
    "HOUR_MS",
    "MAX_REPLICAS",
    "TOPICS",
    "Change",
    "Existing",
    "TopicSpec",
    "access",
    "apply",
    "diff",
    "every_topic",
    "min_insync",
    "replicas",
    "spec",
    "topic_name",
]

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
FOREVER = -1


@dataclass(frozen=True)
class TopicSpec:
    """One topic: what it carries, how it is keyed and how long Kafka keeps it."""

    suffix: str
    partitions: int
    purpose: str
    key: str
    cleanup_policy: Literal["delete", "compact"] = "delete"
    retention_ms: int | None = None  # only for "delete"; FOREVER keeps everything
    # only for "compact": a record replaced (or tombstoned) is compacted away within about
    # this long, the partition's active segment rolled for it at its next write (Kafka's
    # ``max.compaction.lag.ms``; None: the broker's default, never forced)
    max_compaction_lag_ms: int | None = None
    # its readers refuse a record off its key's partition (``worker_states.at_home``): a
    # grow by ``apply`` tombstones what is left off the new homes (its ``clear_grown``)
    clear_on_grow: bool = False
    # compacted, its readers rank a key's record on its home over one off it
    # (``bus.replaces``) and nothing clears what a grow leaves: ``apply`` grows it only
    # while every key's records lie on one partition (a second grow could make a key's
    # record from before the first the one on its home)
    grows_once: bool = False
    writers: tuple[Principal, ...] = ()  # besides ops (the super user); see kernel.acls
    readers: tuple[Principal, ...] = ()  # by name; streams, metrics, reader read every topic

    def configs(self, replicas: int = 1) -> dict[str, str]:
        """The topic-level configs we own; anything else stays at the broker default. With
        replicas, ``min.insync.replicas`` too: an acks=all write then survives a node."""
        wanted: dict[str, str] = {"cleanup.policy": self.cleanup_policy}
        if self.retention_ms is not None:
            wanted["retention.ms"] = str(self.retention_ms)
        if self.max_compaction_lag_ms is not None:
            wanted["max.compaction.lag.ms"] = str(self.max_compaction_lag_ms)
        if replicas > 1:
            wanted["min.insync.replicas"] = str(min_insync(replicas))
        return wanted


TOPICS: tuple[TopicSpec, ...] = (
    TopicSpec(
        "requests",
        6,
        "request logs from gateways and workers",
        "adapter_id",
        retention_ms=7 * DAY_MS,
        writers=(Principal.worker,),
    ),
    TopicSpec(
        "lifecycle",
        3,
        "signed lifecycle events from CI (publish ... revoke)",
        "adapter_id",
        retention_ms=FOREVER,
    ),
    TopicSpec(
        "registry",
        3,
        "current registry record per adapter",
        "adapter_id",
        cleanup_policy="compact",
        grows_once=True,
        writers=(Principal.streams,),
        readers=(Principal.worker, Principal.router),
    ),
    # as many partitions as requests: a key lives on the partition number of its logs
    TopicSpec(
        "scores",
        6,
        "hot-score state per adapter version (the scoring keepers' "
        "changelog, written in transactions)",
        "adapter_id@version",
        cleanup_policy="compact",
        writers=(Principal.streams,),
    ),
    TopicSpec(
        "commands",
        64,
        "cache commands: prewarm / pin / demote / evict",
        "worker_id",
        retention_ms=DAY_MS,
        writers=(Principal.streams,),
        readers=(Principal.worker,),
    ),
    TopicSpec(
        "worker-state",
        3,
        "latest reported state per worker",
        "worker_id",
        cleanup_policy="compact",
        max_compaction_lag_ms=HOUR_MS,  # a state a grow left behind: gone within the hour
        clear_on_grow=True,
        writers=(Principal.worker,),
        readers=(Principal.router,),
    ),
    TopicSpec(
        "router-state",
        1,
        "latest in-flight work and queue depths per fleet router",
        "router_id",
        cleanup_policy="compact",
        max_compaction_lag_ms=HOUR_MS,  # a state a grow left behind: gone within the hour
        clear_on_grow=True,
        writers=(Principal.router,),
    ),
    TopicSpec(
        "cache-events",
        6,
        "what workers actually loaded and evicted",
        "adapter_id",
        retention_ms=7 * DAY_MS,
        writers=(Principal.worker,),
    ),
    TopicSpec(
        "audit",
        3,
        "who did what to which adapter",
        "adapter_id",
        retention_ms=90 * DAY_MS,
        writers=(Principal.streams,),
    ),
    TopicSpec(
        "dead-letters",
        3,
        "records no consumer could process",
        "source key",
        retention_ms=30 * DAY_MS,
        writers=(Principal.streams, Principal.worker, Principal.metrics, Principal.router),
    ),
    TopicSpec(
        "decisions",
        3,
        "planner decisions with their inputs",
        "base_model",
        retention_ms=30 * DAY_MS,
        writers=(Principal.streams,),
    ),
    TopicSpec(
        "planner-memory",
        3,
        "the planner's memory per worker (PlannerMemory), written "
        "in the transaction of the commands it remembers",
        "worker_id",
        cleanup_policy="compact",
        grows_once=True,
        writers=(Principal.streams,),
    ),
    TopicSpec(
        "planner-lease",
        1,
        "the planner lease: the member of a base model's planner "
        "group assigned its one partition plans (nothing is written)",
        "none",
        retention_ms=HOUR_MS,
    ),
    TopicSpec(
        "stack-health",
        1,
        "stack up's produce/consume readiness probe",
        "none",
        retention_ms=HOUR_MS,
    ),
)
_BY_SUFFIX = {spec.suffix: spec for spec in TOPICS}


MAX_REPLICAS = 3


def replicas(settings: Settings) -> int:
    """Copies of every partition (ours, Faust's and Kafka's internal topics): one per node,
    up to three."""
    return min(settings.kafka.brokers, MAX_REPLICAS)


def min_insync(replicas: int) -> int:
    """In-sync copies an acks=all write needs: all but one, so one node may be down and
    no acknowledged write lives on a single disk (with three)."""
    return max(1, replicas - 1)


def spec(suffix: str) -> TopicSpec:
    try:
        return _BY_SUFFIX[suffix]
    except KeyError:
        raise KeyError(f"unknown topic {suffix!r}; declared: {', '.join(_BY_SUFFIX)}") from None


def topic_name(settings: Settings, suffix: str) -> str:
    """The full topic name, e.g. ``topic_name(s, "requests") == "loraplane.requests"``."""
    return every_topic(settings) + spec(suffix).suffix


def access(settings: Settings) -> list[acls.TopicAccess]:
    """Who writes and reads each declared topic of ``settings.topic_prefix``."""
    return [acls.TopicAccess(topic_name(settings, t.suffix), t.writers, t.readers) for t in TOPICS]


def every_topic(settings: Settings) -> str:
    """The name prefix every topic of ``settings.topic_prefix`` starts with."""
    return f"{settings.topic_prefix}."


@dataclass(frozen=True)
class Existing:
    """What the broker currently has for one topic."""

    partitions: int
    configs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """One line of the diff; ``action`` says what apply does (or would do)."""

    topic: str
    action: Literal["create", "config", "partitions", "unchanged", "refused"]
    detail: str = ""
    key: str = ""
    value: str = ""

    def __str__(self) -> str:
        return f"{self.topic}: {self.action}" + (f" ({self.detail})" if self.detail else "")


def diff(
    name: str, wanted: TopicSpec, existing: Existing | None, replicas: int = 1
) -> list[Change]:
    """Pure comparison of a declaration with the broker's state: no I/O, easy to test."""
    if existing is None:
        configs = ", ".join(f"{k}={v}" for k, v in wanted.configs(replicas).items())
        extra = f", {replicas} replicas" if replicas > 1 else ""
        return [Change(name, "create", f"{wanted.partitions} partitions{extra}, {configs}")]
    changes: list[Change] = []
    if wanted.partitions > existing.partitions:
        changes.append(
            Change(
                name,
                "partitions",
                f"partitions {existing.partitions} -> {wanted.partitions}",
                value=str(wanted.partitions),
            )
        )
    elif wanted.partitions < existing.partitions:
        changes.append(
            Change(
                name,
                "refused",
                f"has {existing.partitions} partitions, declared "
                f"{wanted.partitions}: Kafka cannot decrease partitions",
            )
        )
    for key, value in wanted.configs(replicas).items():
        current = existing.configs.get(key)
        if current != value:
            changes.append(
                Change(name, "config", f"{key} from {current} to {value}", key=key, value=value)
            )
    return changes or [Change(name, "unchanged")]


def _existing(admin: AdminClient, names: list[str], timeout: float) -> dict[str, Existing]:
    from confluent_kafka.admin import ConfigResource, ResourceType

    metadata = admin.list_topics(timeout=timeout).topics
    present = [n for n in names if n in metadata]
    if not present:
        return {}
    futures = admin.describe_configs(
        [ConfigResource(ResourceType.TOPIC, n) for n in present], request_timeout=timeout
    )
    result: dict[str, Existing] = {}
    for resource, future in futures.items():
        entries = future.result(timeout=timeout)
        result[resource.name] = Existing(
            partitions=len(metadata[resource.name].partitions),
            configs={k: e.value for k, e in entries.items() if e.value is not None},
        )
    return result


def apply(
    settings: Settings,
    dry_run: bool = False,
    only: tuple[TopicSpec, ...] = TOPICS,
    timeout: float = 30.0,
    clear_grown: Callable[[Settings, str, int, float], int] | None = None,
    spread: Callable[[Settings, str, float], int] | None = None,
) -> list[Change]:
    """Converge the broker to the declarations; returns the diff applied (or planned).
    ``clear_grown(settings, topic, partitions, timeout)``: called for each topic grown
    that is ``clear_on_grow`` (``worker_states.clear_left_behind``, which the CLI and
    ``stack up`` give), its count of records cleared said in the topic's line.
    ``spread(settings, topic, timeout)``: how many keys of a ``grows_once`` topic hold
    records on more than one partition (``bus.keys_spread``, which they give too); such a
    topic grows only when it says none, and is refused without it (a dry run asks it too:
    it only reads)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import (
        AlterConfigOpType,
        ConfigEntry,
        ConfigResource,
        NewPartitions,
        NewTopic,
        ResourceType,
    )

    admin = kafka.admin(settings)
    named = {topic_name(settings, s.suffix): s for s in only}
    try:
        existing = _existing(admin, list(named), timeout)
    except KafkaException as exc:
        raise kafka.KafkaUnavailable(
            f"kafka at {settings.kafka.bootstrap} is not reachable ({exc}); "
            "is the stack up? (loraplane stack status)"
        ) from None
    copies = replicas(settings)
    changes = [c for name, s in named.items() for c in diff(name, s, existing.get(name), copies)]
    for i, c in enumerate(changes):
        if c.action == "partitions" and named[c.topic].grows_once:
            if spread is None:
                changes[i] = Change(
                    c.topic,
                    "refused",
                    f"{c.detail}: not grown without a check that each key's records lie on "
                    "one partition (docs/stack.md, Topics)",
                )
            elif n := spread(settings, c.topic, timeout):
                changes[i] = Change(
                    c.topic,
                    "refused",
                    f"{c.detail}: {n} key(s) hold records on more than one partition, "
                    "left by an earlier grow; growing again could rank a record from before "
                    "it over a newer one (docs/stack.md, Topics)",
                )
    if dry_run:
        return changes

    futures: list[Future[None]] = []
    creates = [
        NewTopic(
            c.topic,
            num_partitions=named[c.topic].partitions,
            replication_factor=copies,
            config=named[c.topic].configs(copies),
        )
        for c in changes
        if c.action == "create"
    ]
    if creates:
        futures += admin.create_topics(creates, request_timeout=timeout).values()
    grows = [NewPartitions(c.topic, int(c.value)) for c in changes if c.action == "partitions"]
    if grows:
        futures += admin.create_partitions(grows, request_timeout=timeout).values()
    alters: dict[str, list[ConfigEntry]] = {}
    for c in changes:
        if c.action == "config":
            alters.setdefault(c.topic, []).append(
                ConfigEntry(c.key, c.value, incremental_operation=AlterConfigOpType.SET)
            )
    if alters:
        resources = [
            ConfigResource(ResourceType.TOPIC, t, incremental_configs=entries)
            for t, entries in alters.items()
        ]
        futures += admin.incremental_alter_configs(resources, request_timeout=timeout).values()
    for future in futures:
        future.result(timeout=timeout)
    acls.apply(settings, admin, access(settings), every_topic(settings), timeout)
    for i, c in enumerate(changes):
        if c.action == "partitions" and named[c.topic].clear_on_grow and clear_grown:
            cleared = clear_grown(settings, c.topic, int(c.value), timeout)
            changes[i] = replace(c, detail=f"{c.detail}; {cleared} left behind cleared")
    return changes
