"""One Kafka transaction, run to the end or given up cleanly: never a hang.

librdkafka sorts transaction errors three ways (KIP-360): *retriable* (the same call may be
made again: a timeout, a coordinator moving after a broker restart), *abortable* (abort,
then try anew) and *fatal* (a fenced or broken producer: only a new producer can go on).
Every call carries a timeout; a step that keeps failing aborts the transaction and the
whole transaction is retried (``fill`` produces the same records again: callers fold first,
then transact, and apply the result only after the commit); a fatal error or too many
attempts raise ``ProducerBroken`` so the caller builds a new producer through
``kernel.kafka``.

librdkafka does not always keep its own timeout: ``send_offsets_to_transaction`` can block
for good while the group coordinator is away, e.g. for minutes after a broker SIGKILL
(confluentinc/librdkafka#5456, confluentinc/librdkafka#5511). So each call runs on a helper
thread and is abandoned past its timeout plus ``GRACE_S``: that raises ``ProducerBroken``,
and the new producer's ``init_transactions`` (same transactional id) fences the stuck one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "BACKOFF_S",
    "GRACE_S",
    "STEP_TIMEOUT_S",
    "TRIES",
    "ProducerBroken",
    "TransactionalProducer",
    "bounded",
    "send_offsets",
    "transact",
]

log = logging.getLogger(__name__)

STEP_TIMEOUT_S = 30.0
"""Each librdkafka transaction call (send offsets, commit, abort) waits at most this long."""
TRIES = 5
"""Whole-transaction attempts (each one aborted if it failed) before the producer is
rebuilt; commit retries of one attempt count separately (``TRIES`` too)."""
BACKOFF_S = 1.0
GRACE_S = 5.0
"""How long past its own timeout a librdkafka call may take before it is abandoned."""


class TransactionalProducer(Protocol):
    """The part of ``confluent_kafka.Producer`` a transaction uses (fakes in tests)."""

    def begin_transaction(self) -> None: ...
    def commit_transaction(self, timeout: float = ...) -> None: ...
    def abort_transaction(self, timeout: float = ...) -> None: ...


class ProducerBroken(RuntimeError):
    """The producer cannot run transactions any more (fatal, fenced, or out of tries):
    build a new one (``kernel.kafka.transactional_producer``) and start over."""


def _error(exc: BaseException) -> Any:
    """The KafkaError a KafkaException carries (None for any other exception)."""
    args = getattr(exc, "args", ())
    err = args[0] if args else None
    return err if hasattr(err, "retriable") else None


def bounded(step: str, call: Callable[[], None], timeout_s: float) -> None:
    """``call`` (a librdkafka call given ``timeout_s``), abandoned if it has not returned
    ``GRACE_S`` after that: ``ProducerBroken``. Its exception, if it raises, is re-raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    worker = threading.Thread(target=run, name=f"txn-{step}", daemon=True)
    worker.start()
    worker.join(timeout_s + GRACE_S)
    if worker.is_alive():
        raise ProducerBroken(
            f"{step} did not return within {timeout_s + GRACE_S:.0f} s "
            "(librdkafka ignored its timeout); the producer is abandoned"
        )
    if failed:
        raise failed[0]


def send_offsets(
    txn: Any, offsets: list[Any], group_metadata: Any, timeout_s: float = STEP_TIMEOUT_S
) -> None:
    """``send_offsets_to_transaction``, bounded (``bounded``)."""
    bounded(
        "send_offsets_to_transaction",
        lambda: txn.send_offsets_to_transaction(offsets, group_metadata, timeout_s),
        timeout_s,
    )


def _fatal(err: Any) -> bool:
    return err is None or bool(err.fatal())


def transact(
    txn: TransactionalProducer,
    fill: Callable[[], None],
    *,
    step_timeout_s: float = STEP_TIMEOUT_S,
    tries: int = TRIES,
    backoff_s: float = BACKOFF_S,
    on_step: Callable[[str], None] = lambda _: None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Begin, ``fill`` (produce, send offsets; it must pass ``step_timeout_s`` to its own
    calls), commit. Returns how many attempts it took. ``on_step`` names the step that is
    about to block (for ``kernel.progress``). Raises ``ProducerBroken``; any exception that
    is not a Kafka one (a bug in ``fill``) aborts and propagates."""
    from confluent_kafka import KafkaException

    last = "no attempt"
    for attempt in range(1, tries + 1):
        on_step("begin_transaction")
        try:
            txn.begin_transaction()
            on_step("fill")
            fill()
            _commit(txn, step_timeout_s, tries, on_step)
            return attempt
        except KafkaException as exc:
            err = _error(exc)
            if _fatal(err):
                raise ProducerBroken(f"transaction failed fatally: {err}") from exc
            last = str(err)
            log.warning(
                "transaction attempt %d/%d failed (%s); aborting and retrying", attempt, tries, err
            )
            _abort(txn, step_timeout_s, tries, on_step)
            sleep(backoff_s * attempt)
        except ProducerBroken:
            raise  # a stuck producer is not asked to abort: the next one fences it
        except BaseException:
            _abort(txn, step_timeout_s, tries, on_step)
            raise
    raise ProducerBroken(f"transaction not committed after {tries} attempts: {last}")


def _repeat(
    step: str,
    call: Callable[[], None],
    tries: int,
    on_step: Callable[[str], None],
    final: Callable[[Any, Exception], None],
) -> None:
    """Make one transaction call, repeating it while its error is retriable (librdkafka
    allows the same call again then); ``final`` handles the error that ends the repeats."""
    from confluent_kafka import KafkaException

    for left in range(tries - 1, -1, -1):
        on_step(step)
        try:
            call()
            return
        except KafkaException as exc:
            err = _error(exc)
            if (
                left == 0
                or err is None
                or not err.retriable()
                or (step == "commit_transaction" and err.txn_requires_abort())
            ):
                final(err, exc)
            log.warning("%s: %s; retrying it", step, err)


def _commit(
    txn: TransactionalProducer, timeout_s: float, tries: int, on_step: Callable[[str], None]
) -> None:
    """Commit; a retriable error (a timeout) repeats the commit; any other propagates (the
    caller aborts and retries the transaction)."""

    def give_up(_err: Any, exc: Exception) -> None:
        raise exc

    _repeat(
        "commit_transaction",
        lambda: bounded("commit_transaction", lambda: txn.commit_transaction(timeout_s), timeout_s),
        tries,
        on_step,
        give_up,
    )


def _abort(
    txn: TransactionalProducer, timeout_s: float, tries: int, on_step: Callable[[str], None]
) -> None:
    """Abort; a retriable failure repeats it, anything else means a new producer."""

    def broken(err: Any, exc: Exception) -> None:
        raise ProducerBroken(f"abort_transaction failed: {err}") from exc

    _repeat(
        "abort_transaction",
        lambda: bounded("abort_transaction", lambda: txn.abort_transaction(timeout_s), timeout_s),
        tries,
        on_step,
        broken,
    )
