"""The topic declarations and the diff that ``topics apply`` acts on (no broker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplane.kernel.config import Settings
from loraplane.kernel.topics import (
    DAY_MS,
    HOUR_MS,
    TOPICS,
    Existing,
    TopicSpec,
    diff,
    spec,
    topic_name,
)


def test_topic_name_uses_the_prefix() -> None:
    assert topic_name(Settings(), "requests") == "loraplane.requests"
    assert topic_name(Settings(topic_prefix="dev"), "registry") == "dev.registry"


def test_unknown_topic_is_refused_with_the_declared_names() -> None:
    with pytest.raises(KeyError, match=r"requets.*declared: requests"):
        topic_name(Settings(), "requets")


def test_declarations_match_the_issue() -> None:
    assert len({s.suffix for s in TOPICS}) == len(TOPICS)
    assert spec("requests").partitions == 6 and spec("requests").key == "adapter_id"
    assert spec("lifecycle").configs()["retention.ms"] == "-1"
    assert spec("commands").configs() == {"cleanup.policy": "delete", "retention.ms": str(DAY_MS)}
    assert spec("registry").configs() == {"cleanup.policy": "compact"}
    # only topics whose readers refuse a record off its home: the others' stands until its
    # home holds one (bus.replaces), so a tombstone would lose it (the memory of an idle worker)
    assert {s.suffix for s in TOPICS if s.clear_on_grow} == {"worker-state", "router-state"}
    for states in ("worker-state", "router-state"):  # what a grow left is compacted within 1 h
        assert spec(states).configs() == {
            "cleanup.policy": "compact",
            "max.compaction.lag.ms": str(HOUR_MS),
        }


WANTED = TopicSpec("requests", 6, "request logs", "adapter_id", retention_ms=7 * DAY_MS)
SAME = Existing(
    6, {"cleanup.policy": "delete", "retention.ms": str(7 * DAY_MS), "segment.bytes": "1073741824"}
)


def test_missing_topic_is_created() -> None:
    [change] = diff("lp.requests", WANTED, None)
    assert change.action == "create" and "6 partitions" in change.detail


def test_matching_topic_is_unchanged_and_foreign_configs_are_ignored() -> None:
    assert [c.action for c in diff("lp.requests", WANTED, SAME)] == ["unchanged"]


def test_differing_config_is_altered_with_from_and_to() -> None:
    existing = Existing(6, {**SAME.configs, "retention.ms": "1000"})
    [change] = diff("lp.requests", WANTED, existing)
    assert (change.action, change.key, change.value) == ("config", "retention.ms", str(7 * DAY_MS))
    assert str(change) == f"lp.requests: config (retention.ms from 1000 to {7 * DAY_MS})"


def test_partitions_grow_but_never_shrink() -> None:
    [grow] = diff("lp.requests", WANTED, Existing(3, SAME.configs))
    assert (grow.action, grow.value) == ("partitions", "6")
    [refuse] = diff("lp.requests", WANTED, Existing(12, SAME.configs))
    assert refuse.action == "refused" and "cannot decrease" in refuse.detail


def test_the_stack_docs_topic_table_matches_the_declarations() -> None:
    """docs/stack.md's table of topics is what operators size a broker by: each declared
    topic once, with its partition count and whether it is compacted, as ``TOPICS`` says."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "stack.md").read_text()
    rows = re.findall(r"^\| `([a-z-]+)` \| (\d+)[^|]*\| [^|]+\| ([^|]+)\|", text, re.M)
    documented = {name: (int(n), "compacted" in kept) for name, n, kept in rows}
    assert len(rows) == len(documented)
    declared = {s.suffix: (s.partitions, s.cleanup_policy == "compact") for s in TOPICS}
    assert documented == declared


def test_a_dry_run_says_a_second_grow_of_a_grows_once_topic_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``topics apply --dry-run`` prints what apply would do: a grow of a ``grows_once``
    topic (``registry``) whose keys lie on several partitions is refused there too, and one
    whose keys each lie on one partition would grow; nothing is grown in either."""
    from loraplane.kernel import topics

    settings = Settings()
    registry = spec("registry")
    name = topic_name(settings, "registry")
    assert registry.grows_once and registry.partitions > 1
    existing = {name: Existing(registry.partitions - 1, registry.configs())}

    class Admin:
        def create_partitions(self, *a: object, **k: object) -> None:
            raise AssertionError("a dry run grows nothing")

    monkeypatch.setattr(topics.kafka, "admin", lambda s: Admin())
    monkeypatch.setattr(topics, "_existing", lambda admin, names, timeout: existing)
    asked: list[str] = []

    def spread(n: int) -> object:
        return lambda s, topic, timeout: asked.append(topic) or n

    [change] = topics.apply(settings, dry_run=True, only=(registry,), spread=spread(3))
    assert change.action == "refused" and "3 key(s)" in change.detail and asked == [name]
    [change] = topics.apply(settings, dry_run=True, only=(registry,), spread=spread(0))
    assert change.action == "partitions"
    [change] = topics.apply(settings, dry_run=True, only=(registry,))
    assert change.action == "refused"


def test_stack_up_tells_a_refused_topic_change_from_an_applied_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stack up`` applies the topics as ``topics apply`` does: a change apply refused (a
    second grow of a ``grows_once`` topic) is said as refused, not counted as changed under
    a check mark."""
    import io

    from rich.console import Console

    from loraplane.infra import stack
    from loraplane.kernel import topics
    from loraplane.kernel.topics import Change

    settings = Settings(home=tmp_path)
    monkeypatch.setattr(stack, "check_binds", lambda s: None)
    monkeypatch.setattr(stack, "services", lambda s: [])
    changes = [
        Change("lp.registry", "refused", "partitions 4 -> 6: 8 key(s) hold records"),
        Change("lp.requests", "partitions", "partitions 3 -> 6", value="6"),
        Change("lp.commands", "unchanged"),
    ]
    monkeypatch.setattr(topics, "apply", lambda *a, **k: changes)
    out = io.StringIO()
    stack.up(settings, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "1 changed, 1 refused, 1 unchanged" in text, text
    assert "lp.registry: refused" in text
