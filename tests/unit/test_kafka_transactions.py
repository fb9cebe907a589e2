"""kernel.transactions: retriable commits are repeated, failed or timed-out attempts are
aborted and the whole transaction retried, fatal errors (or too many tries) ask for a new
producer; nothing blocks without a timeout."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from loraplane.kernel.transactions import ProducerBroken, transact


def _err(
    code: int, *, retriable: bool = False, abortable: bool = False, fatal: bool = False
) -> KafkaException:
    return KafkaException(
        KafkaError(code, "fake", fatal=fatal, retriable=retriable, txn_requires_abort=abortable)
    )


TIMED_OUT = lambda: _err(KafkaError._TIMED_OUT, retriable=True)  # noqa: E731
ABORTABLE = lambda: _err(KafkaError._TIMED_OUT, abortable=True)  # noqa: E731
FENCED = lambda: _err(KafkaError._FENCED, fatal=True)  # noqa: E731


class FakeTxn:
    """Records the calls; ``script`` maps a call name to the exceptions its next calls raise."""

    def __init__(self, script: dict[str, list[Callable[[], KafkaException]]]) -> None:
        self.script = script
        self.calls: list[str] = []
        self.timeouts: list[float] = []
        self.committed = 0

    def _call(self, name: str) -> None:
        self.calls.append(name)
        queue = self.script.get(name, [])
        if queue:
            raise queue.pop(0)()

    def begin_transaction(self) -> None:
        self._call("begin")

    def fill(self) -> None:
        self._call("fill")

    def commit_transaction(self, timeout: float = -1) -> None:
        self.timeouts.append(timeout)
        self._call("commit")
        self.committed += 1

    def abort_transaction(self, timeout: float = -1) -> None:
        self.timeouts.append(timeout)
        self._call("abort")


def _run(txn: FakeTxn, **kwargs: float) -> int:
    return transact(txn, txn.fill, sleep=lambda _: None, step_timeout_s=7, **kwargs)  # type: ignore[arg-type]


def test_a_commit_that_times_out_is_committed_again() -> None:
    txn = FakeTxn({"commit": [TIMED_OUT, TIMED_OUT]})
    assert _run(txn) == 1
    assert txn.calls == ["begin", "fill", "commit", "commit", "commit"]
    assert txn.committed == 1 and set(txn.timeouts) == {7}


def test_a_failed_send_offsets_aborts_and_retries_the_whole_transaction() -> None:
    txn = FakeTxn({"fill": [ABORTABLE, TIMED_OUT]})
    assert _run(txn) == 3
    assert txn.calls == [
        "begin",
        "fill",
        "abort",
        "begin",
        "fill",
        "abort",
        "begin",
        "fill",
        "commit",
    ]
    assert txn.committed == 1


def test_a_commit_that_needs_an_abort_is_retried_from_the_start() -> None:
    txn = FakeTxn({"commit": [ABORTABLE]})
    assert _run(txn) == 2
    assert txn.calls == ["begin", "fill", "commit", "abort", "begin", "fill", "commit"]


def test_a_fenced_producer_must_be_rebuilt() -> None:
    txn = FakeTxn({"commit": [FENCED]})
    with pytest.raises(ProducerBroken, match="fatally"):
        _run(txn)
    assert txn.committed == 0


def test_endless_timeouts_give_up_after_the_tries_not_never() -> None:
    txn = FakeTxn({"fill": [ABORTABLE] * 100})
    with pytest.raises(ProducerBroken, match="after 3 attempts"):
        _run(txn, tries=3)
    assert txn.calls.count("abort") == 3 and txn.committed == 0


def test_an_abort_that_fails_for_good_asks_for_a_new_producer() -> None:
    txn = FakeTxn({"fill": [ABORTABLE], "abort": [lambda: _err(KafkaError._STATE)]})
    with pytest.raises(ProducerBroken, match="abort_transaction"):
        _run(txn)


def test_a_bug_in_fill_aborts_and_propagates() -> None:
    txn = FakeTxn({})

    def broken() -> None:
        raise ValueError("bug")

    with pytest.raises(ValueError):
        transact(txn, broken, sleep=lambda _: None)
    assert txn.calls == ["begin", "abort"]


def test_a_librdkafka_call_that_ignores_its_timeout_is_abandoned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka#5456: send_offsets_to_transaction can block past its timeout while the
    coordinator is away; the call is abandoned (ProducerBroken: the caller's next producer
    fences this one) instead of hanging the scoring thread, and no abort is asked of the
    stuck producer."""
    import threading

    from loraplane.kernel import transactions

    monkeypatch.setattr(transactions, "GRACE_S", 0.05)
    release = threading.Event()
    calls: list[str] = []

    class Stuck:
        def send_offsets_to_transaction(self, offsets: list, meta: object, timeout: float) -> None:
            release.wait(10)  # ignores ``timeout``

        def begin_transaction(self) -> None:
            calls.append("begin")

        def commit_transaction(self, timeout: float = -1) -> None:
            calls.append("commit")

        def abort_transaction(self, timeout: float = -1) -> None:
            calls.append("abort")

    stuck = Stuck()
    try:
        with pytest.raises(transactions.ProducerBroken, match="did not return"):
            transactions.transact(
                stuck,
                lambda: transactions.send_offsets(stuck, [], None, timeout_s=0.05),
                sleep=lambda _: None,
            )
    finally:
        release.set()
    assert calls == ["begin"]


def test_a_bounded_call_passes_its_error_on() -> None:
    from loraplane.kernel import transactions

    def boom() -> None:
        raise KafkaException(_err(1, retriable=True))

    with pytest.raises(KafkaException):
        transactions.bounded("commit_transaction", boom, 1.0)
