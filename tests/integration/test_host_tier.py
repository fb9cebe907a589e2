"""The host warm tier against the real S3 endpoint (s3proxy) of the shared stack.

Every test uploads under its own key prefix. "S3 down" is made real without touching the
shared endpoint: the tier talks to S3 through a TCP forwarder this test owns, which can be
closed (connection refused), turned into a black hole (connects, never answers) and
re-opened on the same port.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.refusal import ArtifactError
from loraplane.artifact.verification import WorkerLimits
from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.kernel.config import S3Settings, Settings
from loraplane.schemas.adapter import AdapterRecord, Priority
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.tiny_model import TinyLlama, build_adapter
from loraplane.workers.artifact_fetch import ArtifactFetcher, FetchPolicy, parse_s3_uri, s3_client
from loraplane.workers.host_tier import HostTier, TierEntry
from tests.integration.tmpfs import small_tmpfs

pytestmark = pytest.mark.integration

LIMITS = WorkerLimits(
    base_model="tiny-llama",
    max_lora_rank=8,
    model=ModelShape.from_hf_config(TinyLlama().hf_config(1000)),
)
FAST = FetchPolicy(
    connect_timeout_s=0.5, read_timeout_s=0.5, attempts=3, backoff_s=0.05, deadline_s=5.0
)


class Forwarder:
    """A loopback TCP forwarder to the S3 endpoint: ``up``, ``down`` (port closed) or
    ``blackhole`` (accepts, never answers)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.mode = "down"
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []

    def set(self, mode: str) -> None:
        self._close()
        self.mode = mode
        if mode != "down":
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(16)
            self._listener = listener
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            self._conns.append(client)
            if self.mode == "up":
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
                self._conns.append(upstream)
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass  # either side closed: stop pumping
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _close(self) -> None:
        if self._listener is not None:
            with suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            self._listener.close()
            self._listener = None
        for conn in self._conns:
            conn.close()
        self._conns.clear()


@pytest.fixture
def prefix(stack: Settings) -> Iterator[str]:
    """A fresh adapter-id prefix (the publisher puts each adapter under its id); every
    object under it is deleted afterwards."""
    tag = f"test-host-tier-{uuid.uuid4().hex[:10]}-"
    yield tag
    client = s3_client(stack.s3)
    listed = client.list_objects_v2(Bucket=stack.s3.bucket, Prefix=tag).get("Contents", [])
    for obj in listed:
        client.delete_object(Bucket=stack.s3.bucket, Key=obj["Key"])


def publish(stack: Settings, prefix: str, tmp_path: Path, name: str, seed: int) -> AdapterRecord:
    """Upload a tiny adapter with the real publisher (issue 3's artifact_publish)."""
    folder = build_adapter(tmp_path / "src" / name, seed=seed)
    release = PublishRequest(f"{prefix}{name}", "t1", "tiny-llama", "1", Priority.silver)
    record, manifest = build_record(folder, release, stack.s3.bucket)
    upload(stack, folder, record, manifest)
    return record


class CountingFetcher(ArtifactFetcher):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def fetch(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return super().fetch(*args, **kwargs)


def tier(root: Path, s3: S3Settings, budget: int = 10**7, **kwargs: Any) -> HostTier:
    return HostTier(
        root, budget_bytes=budget, limits=LIMITS, fetcher=CountingFetcher(s3, FAST), **kwargs
    )


def test_fetch_verify_install_is_idempotent_and_single_flight(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    record = publish(stack, prefix, tmp_path, "a1", seed=1)
    host = tier(tmp_path / "tier", stack.s3)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(host.ensure(record))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(set(results)) == 1 and len(results) == 4
    path = results[0]
    assert path == tmp_path / "tier" / record.lora_name / "adapter"
    assert {p.name for p in path.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
    }
    assert host.ensure(record) == path
    assert host._fetcher.calls == 1  # type: ignore[attr-defined]
    (entry,) = host.entries()
    assert (entry.lora_name, entry.sha256) == (record.lora_name, record.sha256)
    assert entry.size_bytes == sum(p.stat().st_size for p in path.iterdir())
    assert not [p for p in (tmp_path / "tier").iterdir() if p.name.startswith(".")]


def test_budget_evicts_least_recently_used_and_spares_protected(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    records = [publish(stack, prefix, tmp_path, f"a{i}", seed=i) for i in range(1, 5)]
    evicted: list[TierEntry] = []
    protected = {records[0].lora_name}
    host = tier(
        tmp_path / "tier", stack.s3, on_evict=evicted.append, is_protected=protected.__contains__
    )
    host.ensure(records[0])
    size = host.entries()[0].size_bytes
    host.budget_bytes = 3 * size  # room for three
    host.ensure(records[1])
    host.ensure(records[2])
    host.touch(records[1].lora_name)  # a2 used after a3: a3 is now least recently used
    host.ensure(records[3])
    assert [e.lora_name for e in evicted] == [records[2].lora_name]
    assert {e.lora_name for e in host.entries()} == {
        records[0].lora_name,
        records[1].lora_name,
        records[3].lora_name,
    }
    assert host.used_bytes <= host.budget_bytes
    assert not (tmp_path / "tier" / records[2].lora_name).exists()
    protected.update(e.lora_name for e in host.entries())
    with pytest.raises(ArtifactError) as refused:
        host.ensure(records[2])
    assert refused.value.reasons == (Reason.host_budget_exceeded,)
    assert not [p for p in (tmp_path / "tier").iterdir() if p.name.startswith(".")]


def test_restart_scan_keeps_verified_entries_and_drops_the_rest(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "tier"
    good, bad = (publish(stack, prefix, tmp_path, f"a{i}", seed=i) for i in (1, 2))
    first = tier(root, stack.s3)
    first.ensure(good)
    bad_path = first.ensure(bad)
    weights = bad_path / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # bit rot / tampering on local disk
    (root / ".partial-crashed").mkdir()
    (root / ".partial-crashed" / "half.safetensors").write_bytes(b"\0" * 10)

    second = tier(root, stack.s3)
    assert [e.lora_name for e in second.entries()] == [good.lora_name]
    dropped = dict(second.startup_report.dropped)
    assert dropped[bad.lora_name] == Reason.sha256_mismatch.value
    assert dropped[".partial-crashed"] == "partial"
    assert sorted(p.name for p in root.iterdir()) == [good.lora_name]
    assert second.ensure(bad) == bad_path  # fetched again, verified again
    assert second._fetcher.calls == 1  # type: ignore[attr-defined]


def test_an_entry_changed_while_the_tier_runs_is_fetched_again_not_handed_out(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    """ATTACK: the weights of an installed entry rewritten in place on the local disk while
    the tier runs (the restart scan would catch it; a running tier handed it out). The next
    ``ensure`` sees the change and fetches and verifies the artifact from S3 again."""
    record = publish(stack, prefix, tmp_path, "a1", seed=1)
    host = tier(tmp_path / "tier", stack.s3)
    path = host.ensure(record)
    weights = path / "adapter_model.safetensors"
    verified = weights.read_bytes()
    data = bytearray(verified)
    data[-1] ^= 1
    with open(weights, "r+b") as f:  # in place: same inode, same size
        f.write(bytes(data))
    assert host.ensure(record) == path
    assert weights.read_bytes() == verified
    assert host._fetcher.calls == 2  # type: ignore[attr-defined]


def test_hostile_store_content_never_lands_in_the_tier(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    record = publish(stack, prefix, tmp_path, "a1", seed=1)
    host = tier(tmp_path / "tier", stack.s3)
    from loraplane.schemas.adapter import owner_prefix

    bucket, _ = parse_s3_uri(record.artifact_uri)
    unpublished = record.model_copy(update={"version": "9"})  # an owner prefix with no objects
    cases = {
        # same owner prefix (sha8), another digest: the manifest's digest decides
        Reason.manifest_digest_mismatch: record.model_copy(
            update={"sha256": record.sha256[:8] + "ab" * 28}
        ),
        Reason.source_not_allowed: record.model_copy(
            update={"artifact_uri": "s3://someone-elses-bucket/a1/1/"}
        ),
        Reason.manifest_missing: unpublished.model_copy(
            update={"artifact_uri": owner_prefix(unpublished, bucket)}
        ),
        Reason.outside_owner_prefix: record.model_copy(
            update={"artifact_uri": record.artifact_uri + "nope/"}
        ),
        Reason.adapter_revoked: record.model_copy(update={"status": "revoked"}),
    }
    for reason, hostile in cases.items():
        with pytest.raises(ArtifactError) as refused:
            host.ensure(hostile)
        assert reason in refused.value.reasons
    # the weights object is replaced after publication: same size, other bytes
    bucket, key_prefix = parse_s3_uri(record.artifact_uri)
    client = s3_client(stack.s3)
    key = key_prefix + "adapter_model.safetensors"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[-4:] = b"\xff\xff\xff\xff"
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(ArtifactError) as refused:
        host.ensure(record)
    assert refused.value.reasons == (Reason.sha256_mismatch,)
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data) + b"\0")
    with pytest.raises(ArtifactError) as refused:
        host.ensure(record)
    assert refused.value.reasons == (Reason.size_mismatch,)
    assert host.entries() == []
    assert list((tmp_path / "tier").iterdir()) == []


def test_attack_a_faithfully_published_nan_adapter_is_refused_after_its_fetch(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    """ATTACK, on the real fetch path (s3proxy, ``ArtifactFetcher``, ``HostTier``): an
    adapter whose weights hold a NaN, uploaded with a manifest and a record that describe
    its bytes faithfully (as a publisher that skips ``publish``'s verification would), passed
    every check and was installed for vLLM. It is refused as ``tensor_value_nonfinite``
    naming the tensor, and the tier keeps nothing of it."""
    from loraplane.schemas.adapter import owner_prefix
    from loraplane.schemas.manifest import Manifest
    from tests.hostile_corpus import CASES, PREFIX, hostile

    nan = next(c for c in CASES if c.id == "NaN weight")
    artifact, record = hostile(nan, build_adapter(tmp_path / "src", seed=1), tmp_path / "nan")
    record = record.model_copy(update={"adapter_id": f"{prefix}nan", "base_model": "tiny-llama"})
    record = record.model_copy(update={"artifact_uri": owner_prefix(record, stack.s3.bucket)})
    manifest = Manifest.model_validate_json((artifact.root / "manifest.json").read_bytes())
    upload(stack, artifact.root, record, manifest)
    host = tier(tmp_path / "tier", stack.s3)
    with pytest.raises(ArtifactError) as refused:
        host.ensure(record)
    assert refused.value.reasons == (Reason.tensor_value_nonfinite,)
    assert f"{PREFIX}.1.self_attn.v_proj.lora_B.weight: NaN at [" in str(refused.value)
    assert host.entries() == [] and list((tmp_path / "tier").iterdir()) == []


def test_s3_down_fails_fast_with_a_reason_and_loads_resume_when_it_is_back(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    record = publish(stack, prefix, tmp_path, "a1", seed=1)
    forwarder = Forwarder(stack.s3.port)
    s3 = stack.s3.model_copy(update={"endpoint_url": f"http://127.0.0.1:{forwarder.port}"})
    host = tier(tmp_path / "tier", s3)
    try:
        for mode in ("down", "blackhole"):
            forwarder.set(mode)
            started = time.monotonic()
            with pytest.raises(ArtifactError) as failed:
                host.ensure(record)
            elapsed = time.monotonic() - started
            assert failed.value.reasons == (Reason.artifact_store_unavailable,)
            assert failed.value.is_failure
            # nothing hangs: bounded by the fetch deadline, not by the OS's TCP timeouts
            assert elapsed < FAST.deadline_s + FAST.read_timeout_s, (mode, elapsed)
            print(f"S3 {mode}: artifact_store_unavailable after {elapsed * 1000:.0f} ms")
        forwarder.set("up")
        path = host.ensure(record)
        assert (path / "adapter_model.safetensors").is_file()
        assert [e.lora_name for e in host.entries()] == [record.lora_name]
    finally:
        forwarder.set("down")


def test_artifact_verify_cli_reads_from_s3(stack: Settings, prefix: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from loraplane.cli import app

    record = publish(stack, prefix, tmp_path, "a1", seed=1)
    good, forged = tmp_path / "record.json", tmp_path / "forged.json"
    good.write_text(record.model_dump_json())
    forged.write_text(
        record.model_copy(update={"sha256": record.sha256[:8] + "ab" * 28}).model_dump_json()
    )  # same owner prefix (sha8), another digest
    runner = CliRunner()
    ok = runner.invoke(
        app,
        [
            "artifact",
            "verify",
            record.artifact_uri,
            "--record",
            str(good),
            "--max-rank",
            "8",
            "--base-model",
            "tiny-llama",
        ],
    )
    assert (ok.exit_code, ok.output.strip()) == (0, "ok")
    refused = runner.invoke(
        app, ["artifact", "verify", record.artifact_uri, "--record", str(forged)]
    )
    assert refused.exit_code == 1
    assert refused.output.split()[0] == Reason.manifest_digest_mismatch.value


def test_a_full_disk_refuses_with_its_reason_leaves_nothing_and_heals_with_room(
    stack: Settings, prefix: str, tmp_path: Path
) -> None:
    """The tier's folder is a real tmpfs, far smaller than the byte budget: the install
    that does not fit is refused as ``host_disk_full`` (a failure: retried later), leaves
    no partial file, keeps the entry already there, and succeeds once there is room."""
    first = publish(stack, prefix, tmp_path, "a1", seed=1)
    second = publish(stack, prefix, tmp_path, "a2", seed=2)
    with small_tmpfs(tmp_path / "tier", 1 << 20) as disk:
        host = tier(disk.path, stack.s3, budget=10**9)
        kept = host.ensure(first)
        disk.resize(disk.used + 8192)  # two pages left: the 35 KB adapter cannot fit
        with pytest.raises(ArtifactError) as full:
            host.ensure(second)
        assert full.value.reasons == (Reason.host_disk_full,) and full.value.is_failure
        assert "No space left on device" in str(full.value)
        assert sorted(p.name for p in disk.path.iterdir()) == [first.lora_name]
        assert [e.lora_name for e in host.entries()] == [first.lora_name]
        assert host.ensure(first) == kept and (kept / "adapter_model.safetensors").is_file()
        print(f"full disk: {full.value}")
        disk.resize(1 << 20)
        path = host.ensure(second)
        assert (path / "adapter_model.safetensors").is_file()
        assert {e.lora_name for e in host.entries()} == {first.lora_name, second.lora_name}
