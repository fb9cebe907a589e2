"""Registry memory per process: a worker agent's registry (scoped to its base model) against
one that holds every base model (a router serving all of them), at N adapters over B base
models, on the real broker of the local stack.

N genuine views (a signed publish and promote each, folded by the registry's own
``registry.fold.evaluate``) are written to a private ``registry`` topic as the registry
agent writes them (key adapter_id, the view's canonical bytes, the ``base_model`` header):
through the agent itself 100k adapters would take 20-40 minutes. Then each consumer runs in
a fresh process of its own, built as its runtime builds it (``workers/runner.py``:
``RegistryScope``, ``registry_tail`` started after the ``VerifiedRegistry`` with a host-tier
folder for its checkpoints and saved views), reads the topic to its end, verifies every view
it keeps and indexes the records by lora name as the worker agent does. Measured in it:

* ``rss_mb``: the process's resident memory then (``/proc/self/statm``), and
  ``rss_growth_mb``, its growth over the process before the tail started;
* ``state_mb``: the registry state's own size, every object reachable from the tail's
  records, the verified registry (views, signed bytes, verdicts, checkpoints) and the
  lora-name index, each counted once (``sys.getsizeof`` over ``gc.get_referents``);
* ``first_read_s``: the start to a verified registry (read, skip, verify);
* records kept and read past, views accepted.

The baseline is the unscoped consumer in the same run: ``scoped / every`` is the worker's
share of what a process holding every base model needs. ``--before-checkout DIR`` runs the
same consumer on another checkout's code too (its own ``.venv``), e.g. the code before the
registry was scoped, for the before figure. Selection costs per record (header, the peek of
a record written before the header, a full decode) are timed in this process.

    .venv/bin/python -m bench.registry_memory                       # 100k adapters, 10 bases
    .venv/bin/python -m bench.registry_memory --adapters 2000 --base-models 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.report import Row, emit, parse_args, times
from loraplane.kernel import kafka, topics
from loraplane.kernel.bus import Record
from loraplane.kernel.config import Settings, get_settings
from loraplane.registry.fold import Accepted, AdapterState, evaluate
from loraplane.schemas.base import now_utc
from loraplane.schemas.codec import decode, encode
from loraplane.schemas.keyring import KeyringFile, save_keyring
from loraplane.schemas.registry import AdapterView
from tests.lifecycle_kit import Kit, make_kit

BASE = "base-{:02d}"
READY_S = 1800.0
ROOT = Path(__file__).resolve().parents[1]


# ---- sizes ---------------------------------------------------------------------------------


def deep_size(*roots: object) -> int:
    """Bytes of every object reachable from ``roots``, each counted once; classes, modules
    and functions (shared by the whole process) are not followed."""
    import types

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
    seen: set[int] = set()
    stack = list(roots)
    total = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return total


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- a child: one consumer -------------------------------------------------------------------


class _NoSink:
    def emit(self, topic_suffix: str, key: str, message: Any) -> None:
        pass


def child(base_model: str | None) -> None:
    """One consumer as the worker runner builds it (``base_model`` None: every base model,
    as a router serving all); prints its figures as one JSON line. Runs on whichever
    checkout's code it is started in: without ``RegistryScope`` (before the registry was
    scoped) it holds every base model whatever it is asked."""
    import loraplane.registry.topic as registry_topic
    from loraplane.registry.live import VerifiedRegistry
    from loraplane.workers.reconcile import registry_by_name

    settings = get_settings()
    home = Path(tempfile.mkdtemp(prefix="bench-registry-memory-"))
    gc.collect()
    rss0 = rss_bytes()
    started = time.monotonic()
    scope_type = getattr(registry_topic, "RegistryScope", None)
    scoped = scope_type is not None
    extra: dict[str, Any] = {}
    if scoped:
        scope = scope_type(None if base_model is None else [base_model])
        tail = registry_topic.registry_tail(settings, "bench-memory", scope, start=False)
        extra["scope"] = scope
    else:
        tail = registry_topic.registry_tail(settings, "bench-memory")
    registry = VerifiedRegistry(
        KeyringFile(settings.keyring_path),
        tail.snapshot,
        sink=_NoSink(),
        component="bench-memory",
        checkpoints_path=home / ".registry-checkpoints.json",
        views_path=home / ".registry-views.json",
        version=lambda: tail.version,
        **extra,
    )
    if scoped:
        tail.start()
    if not tail.wait_caught_up(READY_S):
        raise SystemExit("the registry tail did not reach the topic's end")
    records = registry_by_name(registry.records())
    first_read_s = time.monotonic() - started
    gc.collect()
    rss = rss_bytes()
    state = deep_size(
        tail._view._latest,
        registry.accepted,
        getattr(registry, "signed", {}),
        registry._cache,
        registry.checkpoints,
        registry._reported,
        records,
    )
    print(
        json.dumps(
            {
                "holds": base_model or "every base model",
                "scoped_code": scoped,
                "rss_mb": round(rss / 2**20, 1),
                "rss_growth_mb": round((rss - rss0) / 2**20, 1),
                "state_mb": round(state / 2**20, 1),
                "first_read_s": round(first_read_s, 2),
                "records_kept": len(tail.snapshot()),
                "records_read_past": getattr(tail, "skipped", 0),
                "views_accepted": len(registry.accepted),
                "lora_names": len(records),
                "state_bytes_per_view": round(state / max(1, len(registry.accepted))),
            }
        ),
        flush=True,
    )
    tail.stop()
    os._exit(0)


def run_child(
    env: dict[str, str], base_model: str | None, python: str = sys.executable, root: Path = ROOT
) -> dict[str, Any]:
    argv = [python, str(Path(__file__).resolve()), "--child", base_model or "-"]
    out = subprocess.run(
        argv,
        env={**env, "PYTHONPATH": str(root)},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=READY_S + 300,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"child {base_model} failed ({out.returncode}): {out.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


# ---- the parent: views, topic, children -----------------------------------------------------


def genuine_views(kit: Kit, adapters: int, bases: int) -> Iterator[AdapterView]:
    """Adapter i on base model i % bases: signed publish + promote, folded by the registry."""
    now = now_utc()
    for i in range(adapters):
        aid, base = f"m{i:06d}", BASE.format(i % bases)
        state: AdapterState | None = None
        for seq, action in ((1, "publish"), (2, "promote")):
            event = kit.event(
                "ci", action, aid, "1", seq, now - timedelta(minutes=1), base_model=base
            )
            decision = evaluate(event, kit.keyring, lambda _a, s=state: s, now)
            assert isinstance(decision, Accepted), decision
            state = decision.state
        assert state is not None
        yield state.view


def selection_costs(views: list[AdapterView], n: int = 5000) -> dict[str, float]:
    """Microseconds per record to select one of another base model: by its header, by a
    peek at its value (a record from before the header), and a full decode for scale."""
    from loraplane.registry.topic import BASE_MODEL_HEADER, RegistryScope

    scope = RegistryScope(["not-this-one"])
    raws = [encode(v) for v in views[:n]]
    headed = [
        Record("r", 0, i, v.adapter_id.encode(), raw, {BASE_MODEL_HEADER: v.base_model.encode()}, 0)
        for i, (v, raw) in enumerate(zip(views, raws, strict=False))
    ]
    bare = [Record("r", 0, i, r.key, r.value, {}, 0) for i, r in enumerate(headed)]

    def per_record(fn: Any, items: list[Any]) -> float:
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        return round((time.perf_counter() - t0) / len(items) * 1e6, 2)

    return {
        "header_us": per_record(scope.keeps, headed),
        "peek_us": per_record(scope.keeps, bare),
        "decode_us": per_record(lambda raw: decode(AdapterView, raw), raws),
    }


def write_topic(
    settings: Settings, views: Iterator[AdapterView]
) -> tuple[int, int, list[AdapterView]]:
    """The views onto the registry topic as the registry agent writes them; the count, the
    bytes and the first few thousand views (for the selection costs)."""
    from loraplane.registry.topic import view_headers

    topic = topics.topic_name(settings, "registry")
    producer = kafka.producer(settings, linger_ms=50)
    count = size = 0
    sample: list[AdapterView] = []
    for view in views:
        raw = encode(view)
        producer.produce(
            topic, key=view.adapter_id.encode(), value=raw, headers=list(view_headers(view).items())
        )
        producer.poll(0)
        count, size = count + 1, size + len(raw)
        if len(sample) < 5000:
            sample.append(view)
    if producer.flush(120) != 0:
        raise RuntimeError("registry views not delivered")
    return count, size, sample


def run(stack: Settings, adapters: int, bases: int, before: Path | None) -> dict[str, Any]:
    prefix = f"bench-mem-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="bench-registry-memory-") as tmp:
        settings = stack.model_copy(
            update={"topic_prefix": prefix, "keyring_path": Path(tmp) / "keyring.yaml"}
        )
        topics.apply(settings, only=(topics.spec("registry"),))
        try:
            kit = make_kit(now_utc())
            save_keyring(kit.keyring, settings.keyring_path)
            t0 = time.monotonic()
            count, size, sample = write_topic(settings, genuine_views(kit, adapters, bases))
            made_s = time.monotonic() - t0
            env = {
                **os.environ,
                "LORAPLANE_TOPIC_PREFIX": prefix,
                "LORAPLANE_KEYRING_PATH": str(settings.keyring_path),
            }
            worker = run_child(env, BASE.format(0))
            every = run_child(env, None)
            out: dict[str, Any] = {
                "adapters": count,
                "base_models": bases,
                "topic_bytes": size,
                "views_made_and_written_s": round(made_s, 1),
                "worker": worker,
                "every_base_model": every,
                "worker_over_every": {
                    k: round(worker[k] / every[k], 3)
                    for k in ("rss_mb", "rss_growth_mb", "state_mb", "first_read_s")
                    if every[k]
                },
                "selection_per_record": selection_costs(sample),
                "goal": "<= 100 MB of registry state in a worker agent at 100k adapters over "
                "10 base models: 100 MB per 10k views of its base model",
            }
            if before is not None:
                python = str(before / ".venv" / "bin" / "python")
                out["before"] = {
                    "checkout": str(before),
                    "worker": run_child(env, BASE.format(0), python, before),
                }
                out["before"]["worker_over_before"] = {
                    k: round(worker[k] / out["before"]["worker"][k], 3)
                    for k in ("rss_mb", "state_mb", "first_read_s")
                }
            out["goal_met"] = worker["state_mb"] <= 100 * worker["views_accepted"] / 10_000
        finally:
            admin = kafka.admin(settings)
            for done in admin.delete_topics([topics.topic_name(settings, "registry")]).values():
                try:
                    done.result(30)
                except Exception as exc:  # left for the next stack reset
                    print(f"registry_memory: topic not deleted: {exc}", file=sys.stderr)
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


def row(r: dict[str, Any]) -> Row:
    w, e = r["worker"], r["every_base_model"]
    return Row(
        f"registry memory per process ({r['adapters']} adapters, {r['base_models']} base models)",
        f"worker (one base model): state {w['state_mb']:.1f} MB, RSS {w['rss_mb']:.0f} "
        f"MB, first read {w['first_read_s']:.1f} s",
        f"every base model: state {e['state_mb']:.0f} MB, RSS {e['rss_mb']:.0f} MB, "
        f"first read {e['first_read_s']:.1f} s",
        times(r["worker_over_every"]["state_mb"]) + " (state, worker / every)",
        r["goal"],
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=100_000)
    parser.add_argument("--base-models", type=int, default=10)
    parser.add_argument(
        "--before-checkout",
        type=Path,
        default=None,
        help="also run the worker's consumer on this checkout's code "
        "(with its .venv): the before figure",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    raw = sys.argv[1:] if argv is None else argv
    if "--child" in raw:
        args = parser.parse_args(raw)
        child(None if args.child == "-" else args.child)
        return
    args = parse_args(parser, "bench.registry_memory", argv)
    r = run(get_settings(), args.adapters, args.base_models, args.before_checkout)
    emit(r, row(r), args)


if __name__ == "__main__":
    main()
