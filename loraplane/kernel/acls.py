"""Who may do what on the broker: the ACL table of one topic prefix, and its idempotent apply.

The broker denies whatever no ACL allows (``allow.everyone.if.no.acl.found=false``), so
this table is the whole policy; ``ops`` is a super user and needs none. Topic writers and
readers come from ``topics.TOPICS`` (``TopicSpec.writers``/``readers``, handed in as
``TopicAccess``), so a new topic states its producer where it is declared.
``topics.apply`` converges the ACLs of the prefix it applies (a test's or a demo run's
fresh prefix gets its own); docs/security.md prints the table.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from loraplane.kernel import kafka
from loraplane.kernel.kafka import Principal

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

    from loraplane.kernel.config import Settings

__all__ = [
    "READER_GROUP_PREFIX",
    "Grant",
    "Operation",
    "Pattern",
    "Resource",
    "TopicAccess",
    "apply",
    "grants",
]

log = logging.getLogger(__name__)

READER_GROUP_PREFIX = "loraplane-reader-"
"""``bus.read_topic``'s throwaway consumer groups (it commits nothing)."""


class Resource(StrEnum):
    topic = "TOPIC"
    group = "GROUP"
    transactional_id = "TRANSACTIONAL_ID"


class Pattern(StrEnum):
    literal = "LITERAL"
    prefixed = "PREFIXED"


class Operation(StrEnum):
    read = "READ"
    write = "WRITE"
    all = "ALL"


@dataclass(frozen=True)
class TopicAccess:
    """One declared topic's full name and who, besides ops, writes or reads it by name."""

    name: str
    writers: tuple[Principal, ...]
    readers: tuple[Principal, ...]


@dataclass(frozen=True, order=True)
class Grant:
    """One ALLOW binding: ``principal`` may ``operation`` on ``name`` (any host)."""

    principal: Principal
    resource: Resource
    pattern: Pattern
    name: str
    operation: Operation

    def __str__(self) -> str:
        star = "*" if self.pattern is Pattern.prefixed else ""
        return f"User:{self.principal} {self.operation} {self.resource} {self.name}{star}"


def grants(settings: Settings, declared: Sequence[TopicAccess], every_topic: str) -> list[Grant]:
    """The ACL table of ``settings.topic_prefix``; ``every_topic`` is the name prefix all
    its declared topics share (pure: testable without a broker)."""
    p = settings.topic_prefix
    topic, group = Resource.topic, Resource.group
    lit, pre = Pattern.literal, Pattern.prefixed
    out = [Grant(w, topic, lit, t.name, Operation.write) for t in declared for w in t.writers]
    out += [Grant(r, topic, lit, t.name, Operation.read) for t in declared for r in t.readers]
    out += [
        Grant(who, topic, pre, every_topic, Operation.read)
        for who in (Principal.streams, Principal.metrics, Principal.reader)
    ]
    out += [
        # Faust's own topics (changelogs, the assignor's leader topic): created by the app.
        Grant(Principal.streams, topic, pre, f"{p}-streams-", Operation.all),
        Grant(Principal.streams, group, pre, f"{p}-streams", Operation.read),
        Grant(Principal.streams, group, pre, f"{p}-scoring", Operation.read),
        Grant(Principal.streams, Resource.transactional_id, pre, f"{p}-scoring", Operation.write),
        # the planner lease (a group per base model) and its transactional producer
        Grant(Principal.streams, group, pre, f"{p}-planner-", Operation.read),
        Grant(Principal.streams, Resource.transactional_id, pre, f"{p}-planner-", Operation.write),
        Grant(Principal.worker, group, pre, f"{p}-worker-", Operation.read),
        Grant(Principal.router, group, pre, f"{p}-router-", Operation.read),
        Grant(Principal.metrics, group, pre, f"{p}.metrics-sink", Operation.read),
    ]
    out += [
        Grant(who, group, pre, READER_GROUP_PREFIX, Operation.read)
        for who in Principal
        if who is not Principal.ops
    ]
    return sorted(set(out))


def apply(
    settings: Settings,
    admin: AdminClient,
    declared: Sequence[TopicAccess],
    every_topic: str,
    timeout: float = 30.0,
) -> bool:
    """Create every grant of the table (creating an existing ACL is a no-op). Returns False
    when the broker has no authorizer (a bare broker without SASL): nothing to apply."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import (
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    if kafka.credentials(settings) is None:
        return False
    bindings = [
        AclBinding(
            ResourceType[g.resource.value],
            g.name,
            ResourcePatternType[g.pattern.value],
            f"User:{g.principal}",
            "*",
            AclOperation[g.operation.value],
            AclPermissionType.ALLOW,
        )
        for g in grants(settings, declared, every_topic)
    ]
    try:
        for future in admin.create_acls(bindings, request_timeout=timeout).values():
            future.result(timeout=timeout)
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.SECURITY_DISABLED:
            return False
        raise
    _wait_visible(admin, set(bindings), timeout)
    return True


def _wait_visible(admin: AdminClient, bindings: set[Any], timeout: float) -> None:
    """Wait until the broker lists every one of ``bindings``: CreateAcls answers when the
    controller has them, and a client that uses them at once (a fresh prefix's first
    ``streams run`` creating its changelog topics) was refused TOPIC_AUTHORIZATION_FAILED
    by a just-started broker whose authorizer had not caught up. A broker that never lists
    them within ``timeout`` is logged; its clients' own errors then say the rest."""
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    # None matches any name, principal and host (the stubs type them str only)
    anything: Any = None
    every = AclBindingFilter(
        ResourceType.ANY,
        anything,
        ResourcePatternType.ANY,
        anything,
        anything,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    deadline = time.monotonic() + timeout
    while True:
        listed = set(admin.describe_acls(every, request_timeout=timeout).result(timeout=timeout))
        missing = len(bindings - listed)
        if not missing:
            return
        if time.monotonic() >= deadline:
            log.warning(
                "%d ACLs created but not listed by the broker after %.0f s", missing, timeout
            )
            return
        time.sleep(0.1)
