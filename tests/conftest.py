"""Shared fixtures. ``stack``: the real local services, reused when already healthy."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import settings as hypothesis_settings

from loraplane.kernel.config import Settings, get_settings

# Property tests assert behaviour, not speed: no per-example deadline (on a loaded CI machine
# the first examples, cold imports included, can pass 200 ms and fail a correct test).
hypothesis_settings.register_profile("loraplane", deadline=None)
hypothesis_settings.load_profile("loraplane")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the real local stack is marked ``stack``: the fast loop
    (``./run test --unit``) leaves it out, since it starts no service."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.get("stack", ()) if info is not None else ()
        if defs and defs[-1].func is stack.__wrapped__:  # ours, not a module's own `stack`
            item.add_marker(pytest.mark.stack)


@pytest.fixture(scope="session")
def stack() -> Iterator[Settings]:
    """Settings of a healthy local stack; stopped at the end only if this session started it."""
    from rich.console import Console

    from loraplane.infra import stack as local_stack

    settings = get_settings()
    _await_a_background_stack_up()
    if local_stack.healthy(settings):
        with _children_find_the_kafka_passwords(settings), _topics_removed_after(settings):
            yield settings
        return
    was_running = any(h.pid for h in local_stack.status(settings))
    console = Console(stderr=True)
    local_stack.up(settings, console)
    with _children_find_the_kafka_passwords(settings), _topics_removed_after(settings):
        yield settings
    if not was_running:
        local_stack.down(settings, console)


@contextmanager
def _topics_removed_after(settings: Settings) -> Iterator[None]:
    """The topics this session created, deleted at its end. Each test namespaces its topics
    under a prefix of its own (~1,300 partitions a full run), and the broker keeps every
    partition's files open: left behind, they made each later ``stack up`` slower (Kafka
    loaded 18,621 logs in 54 s after 15 runs in one home) and then ran the broker out of
    descriptors. Not under pytest-xdist, where another worker's topics are in use."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    from loraplane.kernel import kafka

    try:
        before = set(kafka.admin(settings).list_topics(timeout=10).topics)
    except Exception as exc:  # a broker that is not answering: keep them all
        warnings.warn(f"topics before the session not listed ({exc}): none deleted", stacklevel=1)
        yield
        return
    yield
    try:
        admin = kafka.admin(settings)
        made = sorted(set(admin.list_topics(timeout=10).topics) - before)
        made = [t for t in made if not t.startswith("__")]
        for future in admin.delete_topics(made, operation_timeout=30).values() if made else []:
            future.result(timeout=60)
    except Exception as exc:  # clean-up only: never fail the session
        warnings.warn(f"the session's topics not all deleted: {exc}", stacklevel=1)


STACK_UP_WAIT_S = 280.0
"""How long a test waits for ``./run test``'s background ``stack up``: inside the tests'
300 s timeout (pyproject.toml), which counts a fixture's set-up too."""


def _await_a_background_stack_up() -> None:
    """``./run test`` brings the stack up in the background while the unit tests run, and
    names in ``LORAPLANE_TEST_STACK_UP`` the file that gets its exit status once done: a test
    that needs the stack waits for it rather than start a second ``up`` beside it."""
    name = os.environ.get("LORAPLANE_TEST_STACK_UP")
    if not name:
        return
    done = Path(name)
    deadline = time.monotonic() + STACK_UP_WAIT_S
    while not done.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the background `loraplane stack up` not done in {STACK_UP_WAIT_S:.0f}s")
        time.sleep(0.5)
    status = done.read_text().strip()
    if status != "0":
        pytest.fail(f"the background `loraplane stack up` failed (exit {status}): see its output")


@contextmanager
def _children_find_the_kafka_passwords(settings: Settings) -> Iterator[None]:
    """Tests start ``loraplane`` children with a home of their own and ``os.environ``
    underneath: they must still find the stack's password files (kafka.credentials_env)."""
    from loraplane.kernel import kafka

    with pytest.MonkeyPatch.context() as patch:
        for key, value in kafka.credentials_env(settings).items():
            patch.setenv(key, value)
        yield
