"""The host-tier LoRA resolver's decision (workers/vllm_resolver.py), attacked on real folders.

Entries are installed by the real HostTier (its fetcher copies a local published folder, the
only stand-in here), then named, swapped, linked and edited the ways an attacker with the
request's ``model`` field or with write access to the disk would. The real vLLM end, under
a running agent, is tests/integration/test_worker_e2e.py
(``test_vllm_resolves_only_verified_host_tier_entries_and_the_agent_keeps_them``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import MANIFEST_NAME, WorkerLimits
from loraplane.artifact_publish import PublishRequest, build_record
from loraplane.schemas.adapter import AdapterRecord, AdapterStatus, Priority
from loraplane.schemas.base import now_utc
from loraplane.schemas.keyring import save_keyring
from loraplane.schemas.lifecycle import LifecycleAction
from loraplane.schemas.manifest import Manifest
from loraplane.schemas.registry import AdapterView, views_to_json
from loraplane.tiny_model import TINY_BASE_MODEL, TinyLlama, build_adapter
from loraplane.workers.artifact_fetch import FetchedArtifact
from loraplane.workers.host_tier import HostTier
from loraplane.workers.host_tier_entry import RESOLVER_COPIES, VIEWS_FILE
from loraplane.workers.reconcile import ActualState, HostEntry, vouched
from loraplane.workers.vllm_process import PLUGIN_DIST, VllmProcess
from loraplane.workers.vllm_resolver import (
    ENTRY_POINT,
    PLUGIN_NAME,
    HostTierResolver,
    ResolverConfig,
    ResolverConfigError,
)
from tests.lifecycle_kit import extended_view, make_kit, signed_view

ROOT = Path(__file__).resolve().parents[2]
OTHER_BASE = "other-llama"


class LocalFetcher:
    """The S3 fetch's stand-in: the published files and their manifest, by artifact URI."""

    def __init__(self) -> None:
        self.sources: dict[str, tuple[Path, Manifest]] = {}

    def fetch(
        self,
        artifact_uri: str,
        dest: Path,
        *,
        expected_sha256: str | None,
        max_total_bytes: int,
        owner: AdapterRecord | None,
    ) -> FetchedArtifact:
        folder, manifest = self.sources[artifact_uri]
        dest.mkdir(parents=True)
        for f in manifest.files:
            shutil.copyfile(folder / f.path, dest / f.path)
        (dest / MANIFEST_NAME).write_bytes(manifest.canonical_bytes())
        return FetchedArtifact(dest, manifest, {}, manifest.total_size, 0.0)

    def stop(self) -> None:
        """A copy has no chunk to stop at: it ends by itself."""


class World:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = tmp / "model"
        self.model.mkdir()
        hf = TinyLlama().hf_config(1000)
        (self.model / "config.json").write_text(json.dumps(hf))
        self.shape = ModelShape.from_hf_config(hf)
        self.root = tmp / "tier"
        self.fetcher = LocalFetcher()
        self.kit, self.now = make_kit(now_utc()), now_utc()
        self.keyring = tmp / "keyring.yaml"  # the worker's (settings.keyring_path)
        save_keyring(self.kit.keyring, self.keyring)
        self.views: dict[str, AdapterView] = {}
        self.config = ResolverConfig(
            self.root, TINY_BASE_MODEL, str(self.model), 8, keyring=self.keyring
        )
        self.resolver = HostTierResolver(self.config, snapshot_root=tmp / "copies")
        (tmp / "copies").mkdir()

    def install(
        self, adapter_id: str, seed: int, base: str = TINY_BASE_MODEL, *, vouch: bool = True
    ) -> AdapterRecord:
        """An entry installed by the real HostTier and, with ``vouch``, its version active
        in a signed view among the agent's saved views (as the agent's registry leaves it)."""
        folder = build_adapter(self.tmp / "src" / adapter_id, seed=seed, base_model_name=base)
        record, manifest = build_record(
            folder, PublishRequest(adapter_id, "t1", base, "1", Priority.silver), "bucket"
        )
        self.fetcher.sources[record.artifact_uri] = (folder, manifest)
        limits = WorkerLimits(base_model=base, max_lora_rank=8, model=self.shape)
        HostTier(self.root, budget_bytes=10**8, limits=limits, fetcher=self.fetcher).ensure(record)
        if vouch:
            self.save_view(
                signed_view(
                    self.kit.keys["ops"],
                    [record.model_copy(update={"status": AdapterStatus.active})],
                    self.now,
                    self.kit.keyring,
                )
            )
        return record

    def save_view(self, view: AdapterView) -> None:
        self.views[view.adapter_id] = view
        (self.root / VIEWS_FILE).write_text(views_to_json(self.views))

    def adapter(self, record: AdapterRecord) -> Path:
        return self.root / record.lora_name / "adapter"


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "loraplane.vllm_resolver" and r.levelno == logging.WARNING
    ]


def test_a_verified_entry_resolves_to_a_private_verified_copy(world: World) -> None:
    record = world.install("a1", seed=1)
    found = world.resolver.resolve(str(world.model), record.lora_name)
    assert found is not None  # with the signed view's record: the same version and digest
    assert found.record == record.model_copy(update={"status": AdapterStatus.active})
    assert found.path.parent == world.tmp / "copies"  # never the tier's folder itself
    tier_files = {p.name: p.read_bytes() for p in world.adapter(record).iterdir()}
    assert {p.name: p.read_bytes() for p in found.path.iterdir()} == tier_files
    again = world.resolver.resolve(str(world.model), record.lora_name)
    assert again is not None and again.path != found.path
    assert not found.path.exists()  # one copy per name: the older one is gone


@pytest.mark.parametrize(
    "name",
    [
        "../a1@1-00000000",
        "/etc/passwd",
        "a1@1-00000000/adapter",
        "..",
        ".",
        "",
        "a1@1-00000000\n",
        "a..b@1-00000000",
        "A1@1-00000000",
        "a1@1-0000000g",
        "a1",
        ".partial-abc",
        "a1@1-00000000\x00",
        "~/a1@1-00000000",
        "a1@1-00000000/../b",
    ],
)
def test_names_that_are_paths_or_not_lora_names_are_refused(
    world: World, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert world.resolver.resolve(str(world.model), name) is None
    assert refusals(caplog) == [f"lora resolver refused {name!r}: unsafe_name"]


def test_an_absolute_path_to_a_verified_entry_is_still_refused(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    record = world.install("a1", seed=1)
    for name in (
        str(world.adapter(record)),
        str(world.adapter(record).parent),
        f"{record.lora_name}/adapter",
    ):
        assert world.resolver.resolve(str(world.model), name) is None
    assert all(m.endswith(": unsafe_name") for m in refusals(caplog))
    assert len(refusals(caplog)) == 3


def test_a_name_the_host_tier_does_not_hold_is_refused(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.install("a1", seed=1)
    assert world.resolver.resolve(str(world.model), "b2@1-0123abcd") is None
    assert refusals(caplog) == ["lora resolver refused 'b2@1-0123abcd': not_in_host_tier"]


def test_another_served_model_is_refused(world: World, caplog: pytest.LogCaptureFixture) -> None:
    record = world.install("a1", seed=1)
    assert world.resolver.resolve("/models/other", record.lora_name) is None
    assert refusals(caplog)[0].endswith(
        f"served_model_mismatch ('/models/other' != {str(world.model)!r})"
    )


def test_an_adapter_of_another_base_model_is_refused(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    other = world.install("o1", seed=3, base=OTHER_BASE)  # verified, for the other base model
    assert world.resolver.resolve(str(world.model), other.lora_name) is None
    assert refusals(caplog) == [
        f"lora resolver refused {other.lora_name!r}: other_base_model (record base {OTHER_BASE!r})"
    ]


def test_an_edited_record_json_changes_nothing_the_signed_record_decides(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    other = world.install("o1", seed=3, base=OTHER_BASE)
    forged = other.model_copy(update={"base_model": TINY_BASE_MODEL})
    assert forged.lora_name == other.lora_name
    (world.root / other.lora_name / "record.json").write_text(forged.model_dump_json())
    assert world.resolver.resolve(str(world.model), other.lora_name) is None
    assert refusals(caplog) == [
        f"lora resolver refused {other.lora_name!r}: other_base_model (record base {OTHER_BASE!r})"
    ]


def test_an_entry_no_signed_view_names_is_refused_however_consistent(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """ATTACK: write access to the tier. Files and a record.json that match each other (the
    real tier installed them) but no signed release names them: never loaded."""
    forged = world.install("f5", seed=5, vouch=False)
    assert world.resolver.resolve(str(world.model), forged.lora_name) is None
    genuine = world.install("a1", seed=1)
    other_digest = forged.model_copy(update={"adapter_id": "a1"})  # a1's id, f5's bytes
    assert world.resolver.resolve(str(world.model), other_digest.lora_name) is None
    assert world.resolver.resolve(str(world.model), genuine.lora_name) is not None
    assert [m.split(": ", 1)[1] for m in refusals(caplog)] == [
        "unvouched (no saved registry view of f5)",
        "not_in_host_tier",
    ]


def test_an_edited_view_or_a_keyring_away_vouches_for_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    a1 = world.install("a1", seed=1)
    forged = world.install("f5", seed=5, vouch=False)
    view = world.views["a1"]  # a1's genuine view, given f5's version: its evidence disagrees
    world.save_view(
        view.model_copy(
            update={
                "versions": [
                    *view.versions,
                    forged.model_copy(update={"adapter_id": "a1", "version": "2"}),
                ]
            }
        )
    )
    assert world.resolver.resolve(str(world.model), a1.lora_name) is None
    world.save_view(view)
    assert world.resolver.resolve(str(world.model), a1.lora_name) is not None
    world.keyring.unlink()
    assert world.resolver.resolve(str(world.model), a1.lora_name) is None
    save_keyring(world.kit.keyring, world.keyring)
    (world.root / VIEWS_FILE).write_text("{not json")
    assert world.resolver.resolve(str(world.model), a1.lora_name) is None
    blind = HostTierResolver(
        ResolverConfig(world.root, TINY_BASE_MODEL, str(world.model), 8),
        snapshot_root=world.tmp / "copies",
    )  # no keyring configured
    world.save_view(view)
    assert blind.resolve(str(world.model), a1.lora_name) is None
    assert [m.split(": ", 1)[1] for m in refusals(caplog)] == [
        "unvouched (the view of a1: view_mismatch)",
        "unvouched (the view of a1: view_keyring_unavailable)",
        "unvouched (no saved registry view of a1)",
        "unvouched (the view of a1: view_keyring_unavailable)",
    ]


def test_a_retired_or_revoked_version_is_withdrawn(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    a1 = world.install("a1", seed=1)
    key, ring = world.kit.keys["ops"], world.kit.keyring
    world.save_view(
        extended_view(key, world.views["a1"], LifecycleAction.revoke, "1", ring, world.now)
    )
    assert world.resolver.resolve(str(world.model), a1.lora_name) is None
    assert refusals(caplog) == [
        f"lora resolver refused {a1.lora_name!r}: withdrawn ({a1.lora_name} is revoked)"
    ]


def test_a_file_changed_after_verification_is_refused(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    record = world.install("a1", seed=1)
    weights = world.adapter(record) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert world.resolver.resolve(str(world.model), record.lora_name) is None
    assert refusals(caplog)[0].endswith(": tampered (sha256_mismatch)")
    assert list((world.tmp / "copies").iterdir()) == []  # a refused copy is deleted


def test_a_folder_swapped_for_another_adapter_is_refused(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    a1, b2 = world.install("a1", seed=1), world.install("b2", seed=2)
    shutil.rmtree(world.adapter(a1))
    shutil.copytree(world.adapter(b2), world.adapter(a1))  # verified bytes, the wrong ones
    assert world.resolver.resolve(str(world.model), a1.lora_name) is None
    assert refusals(caplog)[0].endswith(": tampered (manifest_digest_mismatch)")


def test_links_are_never_followed(world: World, caplog: pytest.LogCaptureFixture) -> None:
    a1 = world.install("a1", seed=1)
    weights = world.adapter(a1) / "adapter_model.safetensors"
    outside = world.tmp / "outside.safetensors"
    shutil.copyfile(weights, outside)  # the very bytes, behind a link
    weights.unlink()
    weights.symlink_to(outside)
    assert world.resolver.resolve(str(world.model), a1.lora_name) is None
    b2 = world.install("b2", seed=2)
    linked = world.tmp / "tier2"
    linked.mkdir()
    (linked / b2.lora_name).symlink_to(world.root / b2.lora_name)  # the entry is a link
    via_link = HostTierResolver(
        ResolverConfig(linked, TINY_BASE_MODEL, str(world.model), 8),
        snapshot_root=world.tmp / "copies",
    )
    assert via_link.resolve(str(world.model), b2.lora_name) is None
    shutil.rmtree(world.adapter(b2))
    world.adapter(b2).symlink_to(world.adapter(a1))  # the adapter folder is a link
    assert world.resolver.resolve(str(world.model), b2.lora_name) is None
    assert [m.split(": ", 1)[1] for m in refusals(caplog)] == [
        "tampered (file_missing,weights_missing)",
        "unverified (entry: Not a directory)",
        "unverified (adapter/: Not a directory)",
    ]


def test_unverified_folders_are_refused(world: World, caplog: pytest.LogCaptureFixture) -> None:
    a1 = world.install("a1", seed=1)
    bare = world.root / "c3@1-0123abcd"  # a folder dropped in beside the tier's entries
    shutil.copytree(world.root / a1.lora_name / "adapter", bare / "adapter")
    assert world.resolver.resolve(str(world.model), bare.name) is None
    (bare / "record.json").write_text(a1.model_dump_json())  # another entry's record
    assert world.resolver.resolve(str(world.model), bare.name) is None
    (bare / "record.json").write_text("{not json")
    assert world.resolver.resolve(str(world.model), bare.name) is None
    (world.root / "d4@1-0123abcd").write_text("a file, not a folder")
    assert world.resolver.resolve(str(world.model), "d4@1-0123abcd") is None
    assert [m.split(": ", 1)[1] for m in refusals(caplog)] == [
        "unverified (record.json: No such file or directory)",
        "unverified (record_mismatch)",
        "unverified (record_unreadable)",
        "unverified (entry: Not a directory)",
    ]


def _record_replaced(world: World, kind: str) -> tuple[str, Path, bytes]:
    """Install a1, then put ``kind`` where its record.json was: (its lora name, the record's
    path, the record's bytes)."""
    a1 = world.install("a1", seed=1)
    record = world.root / a1.lora_name / "record.json"
    kept = record.read_bytes()
    record.unlink()
    if kind == "fifo":
        os.mkfifo(record)
    elif kind == "link-to-a-device":
        record.symlink_to("/dev/zero")
    else:
        (world.tmp / "record.json").write_bytes(kept)
        record.symlink_to(world.tmp / "record.json")
    return a1.lora_name, record, kept


@pytest.mark.parametrize("kind", ["fifo", "link-to-a-device", "link-to-the-record"])
def test_a_record_json_that_is_no_regular_file_is_refused_at_once(
    kind: str, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """A FIFO named record.json (any user may make one) would hold the resolver, inside
    vLLM, forever at its open; a link is never followed."""
    name, record, kept = _record_replaced(world, kind)
    assert world.resolver.resolve(str(world.model), name) is None
    assert [m.split(": ", 1)[1].split(" (")[0] for m in refusals(caplog)] == ["unverified"]
    record.unlink()
    record.write_bytes(kept)
    assert world.resolver.resolve(str(world.model), name) is not None


@pytest.mark.parametrize("kind", ["fifo", "link-to-a-device", "link-to-the-record"])
def test_the_startup_scan_drops_an_entry_whose_record_is_no_regular_file(
    kind: str, world: World
) -> None:
    name, _, _ = _record_replaced(world, kind)
    limits = WorkerLimits(base_model=TINY_BASE_MODEL, max_lora_rank=8, model=world.shape)
    tier = HostTier(world.root, budget_bytes=10**8, limits=limits, fetcher=world.fetcher)
    assert tier.get(name) is None
    assert not (world.root / name).exists()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    name=st.one_of(
        st.text(max_size=80),
        st.text(alphabet="ab1@.-/\\~\x00\n", max_size=30),
        st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,10}@v?[0-9.]{1,4}-[0-9a-f]{8}\Z"),
    )
)
def test_no_name_but_a_held_entry_ever_resolves(world: World, name: str) -> None:
    held = getattr(world, "held", None)
    if held is None:
        held = world.held = world.install("a1", seed=1)  # type: ignore[attr-defined]
    found = world.resolver.resolve(str(world.model), name)
    if name == held.lora_name:
        assert found is not None
    else:
        assert found is None
    assert all(p.parent == world.tmp / "copies" for p in (world.tmp / "copies").iterdir())


def test_the_config_travels_through_the_environment() -> None:
    config = ResolverConfig(
        Path("/srv/tier"),
        TINY_BASE_MODEL,
        "/models/tiny",
        16,
        {"acme/tiny": TINY_BASE_MODEL},
        keyring=Path("/etc/lp/keyring.yaml"),
    )
    assert ResolverConfig.from_env(config.env()) == config
    assert ResolverConfig.from_env({}) is None
    for broken in (
        {**config.env(), "LORAPLANE_RESOLVER_MAX_LORA_RANK": "x"},
        {**config.env(), "LORAPLANE_RESOLVER_KEYRING": "keyring.yaml"},
        {**config.env(), "LORAPLANE_RESOLVER_HOST_TIER": "relative/tier"},
        {**config.env(), "LORAPLANE_RESOLVER_BASE_MODEL_ALIASES": "[1]"},
        {k: v for k, v in config.env().items() if "SERVED" not in k},
    ):
        with pytest.raises(ResolverConfigError):
            ResolverConfig.from_env(broken)


def test_the_vllm_it_starts_gets_only_this_resolver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's own resolvers are never on (their folders dropped, VLLM_PLUGINS names none);
    with a resolver the one plugin allowed is this one, found through a generated folder."""
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", "/tmp/anything")
    monkeypatch.setenv("PYTHONPATH", "/opt/keep")
    plain = VllmProcess(tmp_path / "model", 24999, tmp_path / "logs" / "vllm.log").environment()
    assert plain["VLLM_PLUGINS"] == "" and "VLLM_LORA_RESOLVER_CACHE_DIR" not in plain
    assert "LORAPLANE_RESOLVER_HOST_TIER" not in plain
    config = ResolverConfig(tmp_path / "tier", TINY_BASE_MODEL, "ignored", 8)
    env = VllmProcess(
        tmp_path / "model", 24999, tmp_path / "logs" / "vllm.log", resolver=config
    ).environment()
    assert env["VLLM_PLUGINS"] == PLUGIN_NAME and "VLLM_LORA_RESOLVER_CACHE_DIR" not in env
    assert ResolverConfig.from_env(env) == ResolverConfig(
        tmp_path / "tier", TINY_BASE_MODEL, str(tmp_path / "model"), 8
    )
    plugins, kept = env["PYTHONPATH"].split(os.pathsep)
    assert kept == "/opt/keep"
    assert (Path(plugins) / "loraplane" / "vllm_plugin.py").is_file()
    points = (Path(plugins) / PLUGIN_DIST / "entry_points.txt").read_text()
    assert points == f"[vllm.general_plugins]\n{PLUGIN_NAME} = {ENTRY_POINT}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {PLUGIN_NAME: ENTRY_POINT}


def test_the_agent_vouches_for_the_resolvers_copy_and_nothing_like_it(tmp_path: Path) -> None:
    """By default the copies live in the tier's .resolver-copies/, where the agent's
    reconcile accepts them as the entry's bytes; a look-alike anywhere else is a conflict."""
    world = World(tmp_path)
    resolver = HostTierResolver(world.config)  # the default place
    record = world.install("a1", seed=1)
    stale = world.root / RESOLVER_COPIES / f"{record.lora_name}.old"
    stale.mkdir(parents=True)  # an earlier vLLM's copy: emptied at the first resolve
    found = resolver.resolve(str(world.model), record.lora_name)
    assert found is not None and not stale.exists()
    assert found.path.parent == world.root / RESOLVER_COPIES
    assert stat.S_IMODE(found.path.parent.stat().st_mode) == 0o700
    entry = HostEntry(record.lora_name, str(world.adapter(record)), record.sha256)
    actual = ActualState(gpu={}, host={record.lora_name: entry})
    registry = {record.lora_name: record}
    assert vouched(record.lora_name, str(found.path), actual, registry)
    assert vouched(record.lora_name, str(world.adapter(record)), actual, registry)
    copies = world.root / RESOLVER_COPIES
    for root in (
        tmp_path / "elsewhere" / found.path.name,  # not the tier's copies folder
        copies / f"b2@1-0123abcd.{found.path.name.rsplit('.', 1)[1]}",  # another name
        copies / f"{record.lora_name}.x/../..",
        copies / record.lora_name,
    ):
        assert not vouched(record.lora_name, str(root), actual, registry), root
    other = HostEntry(record.lora_name, str(world.adapter(record)), "f" * 64)  # another digest
    assert not vouched(
        record.lora_name,
        str(found.path),
        ActualState(gpu={}, host={record.lora_name: other}),
        registry,
    )


def test_vllm_serve_turns_the_resolver_on_only_with_a_base_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from loraplane.cli import app

    started: list[VllmProcess] = []

    def enter(self: VllmProcess) -> VllmProcess:
        started.append(self)
        raise KeyboardInterrupt  # stands in for vLLM's start: the CLI stops there

    monkeypatch.setattr(VllmProcess, "__enter__", enter)
    monkeypatch.chdir(tmp_path)
    base = [
        "vllm",
        "serve",
        "--port",
        "24998",
        "--model",
        str(tmp_path / "model"),
        "--api-key-file",
        str(tmp_path / "vllm.key"),
        "--resolver-host-tier",
        "tier",
    ]
    refused = CliRunner().invoke(app, base)
    assert refused.exit_code == 2 and "--base-model" in refused.output and not started
    CliRunner().invoke(app, [*base, "--base-model", TINY_BASE_MODEL])
    (proc,) = started
    assert proc.resolver is not None
    assert (proc.resolver.host_tier, proc.resolver.base_model) == (
        tmp_path.resolve() / "tier",
        TINY_BASE_MODEL,
    )


def test_a_file_that_grows_while_copied_is_refused_at_its_size(
    world: World, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ATTACK: an entry's file grows after the resolver read its size (whoever can write the
    host disk extends it, sparse, right then). The copy ran to the file's end, wherever that
    is, onto the host tier's disk, before verification refused it; it now copies the size
    it read and refuses a file that has more."""
    record = world.install("a1", seed=1)
    weights = world.adapter(record) / "adapter_model.safetensors"
    real_fstat = os.fstat

    def fstat_then_grow(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        if os.path.realpath(f"/proc/self/fd/{fd}") == str(weights.resolve()):
            os.truncate(weights, st.st_size + 2**20)  # a MiB more, read as zeros
        return st

    monkeypatch.setattr(os, "fstat", fstat_then_grow)
    assert world.resolver.resolve(str(world.model), record.lora_name) is None
    monkeypatch.undo()
    assert refusals(caplog) == [
        f"lora resolver refused {record.lora_name!r}: tampered "
        "(adapter_model.safetensors grew while copied)"
    ]
    assert list((world.tmp / "copies").iterdir()) == []


def test_attack_a_resolver_without_the_models_shapes_hands_vllm_nothing(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """ATTACK: vLLM serves a hub id (no local config.json) and resolves a name whose entry
    fits the worker's model. Its copy was verified without shapes and handed to vLLM, so an
    entry swapped for a wrong-shape adapter would reach it; nothing is handed to vLLM
    unchecked: ``model_shape_unknown``, said once at the start."""
    a1 = world.install("a1", seed=1)
    with caplog.at_level(logging.INFO, logger="loraplane.vllm_resolver"):
        hub = HostTierResolver(
            ResolverConfig(world.root, TINY_BASE_MODEL, "org/tiny", 8, keyring=world.keyring),
            snapshot_root=world.tmp / "copies",
        )
        assert hub.resolve("org/tiny", a1.lora_name) is None
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(said) == 1 and "model_shape_unknown" in said[0]
    assert [m.split(": ", 1)[1].split(" ")[0] for m in refusals(caplog)] == ["model_shape_unknown"]
    assert world.resolver.resolve(str(world.model), a1.lora_name) is not None  # with shapes
