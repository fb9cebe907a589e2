"""The host warm tier's folders changed under a running tier: an entry replaced by a link to
other bytes, a folder torn by a crash or replaced by a file. The tier never hands out a
folder it did not verify, and a leftover in an entry's place never blocks the install."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from loraplane.artifact.refusal import ArtifactError
from loraplane.artifact.verification import WorkerLimits
from loraplane.testing.fake_vllm import FakeVllm
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter
from loraplane.workers.agent import WorkerAgent, WorkerConfig
from loraplane.workers.host_tier import HostTier
from loraplane.workers.reconcile import Ask
from loraplane.workers.vllm_client import VllmClient
from tests.unit.test_gateway import ListSink, converge
from tests.unit.test_vllm_resolver import World


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def tier_of(world: World) -> HostTier:
    limits = WorkerLimits(base_model=TINY_BASE_MODEL, max_lora_rank=8, model=world.shape)
    return HostTier(world.root, budget_bytes=10**8, limits=limits, fetcher=world.fetcher)


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def other_bytes(world: World) -> Path:
    """An attacker's folder in the entry layout: ``adapter/`` of another adapter's bytes."""
    fake = world.tmp / "attacker"
    build_adapter(fake / "adapter", seed=99)
    return fake


@pytest.mark.parametrize("linked", ["entry", "adapter"])
def test_an_entry_replaced_by_a_link_is_installed_again_not_handed_out(
    world: World, linked: str
) -> None:
    """ATTACK: the entry folder (or its ``adapter/``) replaced by a symlink to other bytes.
    ``ensure`` followed the link (``is_dir``) and handed vLLM the unverified folder."""
    record = world.install("a1", seed=1)
    tier = tier_of(world)
    verified = files(world.adapter(record))
    fake = other_bytes(world)
    target = world.root / record.lora_name
    if linked == "adapter":
        target = target / "adapter"
        fake = fake / "adapter"
    shutil.rmtree(target)
    target.symlink_to(fake, target_is_directory=True)
    path = tier.ensure(record)
    assert not path.is_symlink() and not path.parent.is_symlink()
    assert files(path) == verified
    assert (world.tmp / "attacker" / "adapter").is_dir()  # the link's target is left alone


@pytest.mark.parametrize("leftover", ["torn_folder", "file", "dangling_link"])
def test_a_leftover_in_an_entrys_place_does_not_block_its_install(
    world: World, leftover: str
) -> None:
    """ATTACK: the entry's ``adapter/`` lost (a crash, a cleanup) with its ``record.json``
    left, or the folder replaced by a file or a dangling link. The reinstall's rename onto
    it failed (ENOTEMPTY, ENOTDIR) as ``host_io_error`` on every retry, for good."""
    record = world.install("a1", seed=1)
    tier = tier_of(world)
    verified = files(world.adapter(record))
    folder = world.root / record.lora_name
    if leftover == "torn_folder":
        shutil.rmtree(folder / "adapter")
    else:
        shutil.rmtree(folder)
        if leftover == "file":
            folder.write_bytes(b"not a folder")
        else:
            folder.symlink_to(world.tmp / "nowhere")
    path = tier.ensure(record)
    assert files(path) == verified
    assert tier.get(record.lora_name) is not None


@pytest.mark.asyncio(loop_scope="session")
async def test_the_agent_never_loads_an_entry_linked_away_behind_it(world: World) -> None:
    """ATTACK: the agent took a host-tier entry it already knew for verified and handed its
    path to vLLM without asking the tier: an entry replaced by a link to other bytes after
    the tier installed it was loaded into vLLM. Every load now goes through ``ensure``."""
    record = world.install("a1", seed=1)
    tier = tier_of(world)
    fake = FakeVllm(str(world.model), api_key="k")
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url(""))
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1", base_model=TINY_BASE_MODEL, vllm_url=url, host_budget_bytes=10**8
        ),
        vllm=VllmClient(url, timeout_s=2, api_key="k"),
        host_tier=tier,
        registry_loader=lambda: [record],
        sink=ListSink(),
    )
    try:
        await agent.start()  # adopts the entry, on the host tier
        assert agent.is_on_host(record.lora_name)
        verified = files(world.adapter(record))
        folder = world.root / record.lora_name
        shutil.rmtree(folder)
        folder.symlink_to(other_bytes(world), target_is_directory=True)
        agent._fold(Ask.gateway_load(record))
        await converge(agent)
        assert agent.is_hot(record.lora_name)
        loaded = Path(fake.adapters[record.lora_name][0])
        assert not loaded.parent.is_symlink() and files(loaded) == verified
    finally:
        await agent.vllm.close()
        await server.close()


def test_an_entry_verified_against_another_digest_is_not_handed_out(world: World) -> None:
    """ATTACK: the registry's record of a name now pins another digest with the same first 8
    hex (the name carries only those): a version republished after the registry topic was
    reset, or a collision a publisher ground out. ``ensure`` returned the entry verified
    against the old digest; now the new record's artifact is fetched and verified, and
    refused here since its bytes are not those the new digest pins."""
    record = world.install("a1", seed=1)
    tier = tier_of(world)
    newer = record.model_copy(update={"sha256": record.sha256[:8] + "0" * 56})
    assert newer.lora_name == record.lora_name
    with pytest.raises(ArtifactError):
        tier.ensure(newer)
    assert tier.get(record.lora_name) is None


class SettableClock:
    """A wall clock a test sets, as an NTP step or an operator sets the real one."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_wall_clock_stepped_back_never_evicts_the_newest_entry_first(world: World) -> None:
    """ATTACK (or an NTP step): the wall clock jumps back an hour between two uses. Entries
    were ranked by the raw clock, so the entry installed (or used) right after the jump
    looked the oldest and was evicted first, ahead of entries idle for an hour. Use order is
    now kept whatever the clock does."""
    first, second = world.install("a", seed=1), world.install("b", seed=2)
    later = [world.install(n, seed=s) for n, s in [("c", 3), ("d", 4)]]
    for record in later:  # fetched again by the tier under test
        shutil.rmtree(world.root / record.lora_name)
    clock = SettableClock(time.time() - 3600)
    limits = WorkerLimits(base_model=TINY_BASE_MODEL, max_lora_rank=8, model=world.shape)
    tier = HostTier(
        world.root, budget_bytes=10**8, limits=limits, fetcher=world.fetcher, clock=clock
    )
    assert {e.lora_name for e in tier.entries()} == {first.lora_name, second.lora_name}
    tier.ensure(later[0])
    tier.budget_bytes = tier.used_bytes  # the next install evicts one entry
    clock.now += 1
    tier.ensure(later[1])
    left = {e.lora_name for e in tier.entries()}
    assert left == {second.lora_name, later[0].lora_name, later[1].lora_name}
    assert [e.lora_name for e in tier.entries()][:2] == [later[1].lora_name, later[0].lora_name]


@pytest.mark.parametrize("change", ["rewritten", "replaced", "added", "removed"])
@pytest.mark.parametrize("when", ["installed", "adopted"])
def test_an_entry_changed_on_disk_after_its_verification_is_installed_again(
    world: World, change: str, when: str
) -> None:
    """ATTACK: whoever can write the host disk changes a verified entry's files in place
    (the weights rewritten, a file renamed over one, one added or deleted). ``ensure``
    checked only that the folder was no link and handed vLLM the changed bytes; now any
    change since the verification (a file's inode, size, mtime or ctime, or the names) is
    seen and the entry is fetched and verified again."""
    record = world.install("a1", seed=1)
    if when == "installed":
        shutil.rmtree(world.root / record.lora_name)
    tier = tier_of(world)
    path = tier.ensure(record)
    verified = files(path)
    weights = path / "adapter_model.safetensors"
    fake = bytearray(weights.read_bytes())
    fake[-1] ^= 0xFF  # the same size: only the bytes differ
    if change == "rewritten":
        with open(weights, "r+b") as f:
            f.write(bytes(fake))
    elif change == "replaced":
        (path / "swap").write_bytes(bytes(fake))
        os.replace(path / "swap", weights)
    elif change == "added":
        (path / "adapter_model.bin").write_bytes(b"pickle")
    else:
        (path / "adapter_config.json").unlink()
    again = tier.ensure(record)
    assert files(again) == verified


@pytest.mark.asyncio(loop_scope="session")
async def test_a_gpu_copy_whose_entry_changes_on_disk_is_unloaded_and_loaded_again(
    world: World,
) -> None:
    """ATTACK: the weights of an entry vLLM serves are rewritten on disk after the load.
    vLLM reads the folder again whenever the adapter drops out of its CPU cache, so the
    changed bytes would reach the GPU unseen: the agent vouched for the copy by its path
    and digest only. Now the next tick sees the entry changed: the copy is unloaded as a
    conflict and loaded again from a freshly verified entry."""
    record = world.install("a1", seed=1)
    tier = tier_of(world)
    fake = FakeVllm(str(world.model), api_key="k")
    server = TestServer(fake.app(), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url(""))
    agent = WorkerAgent(
        WorkerConfig(
            worker_id="w1", base_model=TINY_BASE_MODEL, vllm_url=url, host_budget_bytes=10**8
        ),
        vllm=VllmClient(url, timeout_s=2, api_key="k"),
        host_tier=tier,
        registry_loader=lambda: [record],
        sink=ListSink(),
    )
    try:
        await agent.start()
        agent._fold(Ask.gateway_load(record))
        await agent.reconcile_once()
        assert agent.is_hot(record.lora_name)
        loaded = Path(fake.adapters[record.lora_name][0])
        verified = files(loaded)
        weights = loaded / "adapter_model.safetensors"
        changed = bytearray(weights.read_bytes())
        changed[-1] ^= 0xFF
        with open(weights, "r+b") as f:
            f.write(bytes(changed))
        await agent.reconcile_once()  # unloads the copy of changed bytes
        await converge(agent)  # loads the name again, verified
        assert agent.is_hot(record.lora_name)
        assert files(Path(fake.adapters[record.lora_name][0])) == verified
    finally:
        await agent.vllm.close()
        await server.close()


def test_a_concurrent_ensure_of_another_digest_never_gets_the_leaders_folder(
    world: World,
) -> None:
    """ATTACK (a race): ``ensure`` of a name's record is in flight when the registry's record
    of that name changes to another digest with the same 8 hex, and a second ``ensure`` asks
    for the new one. The single flight handed the second caller the folder verified against
    the first record. Now a waiter whose digest the finished install does not match installs
    its own (refused here: no artifact has the new digest)."""
    record = world.install("a1", seed=1)
    shutil.rmtree(world.root / record.lora_name)
    tier = tier_of(world)
    newer = record.model_copy(update={"sha256": record.sha256[:8] + "f" * 56})
    entered, release = threading.Event(), threading.Event()
    fetch = world.fetcher.fetch

    def gated(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(10)
        return fetch(*args, **kwargs)

    world.fetcher.fetch = gated  # type: ignore[method-assign]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(tier.ensure, record)
        assert entered.wait(10)
        second = pool.submit(tier.ensure, newer)
        _, flight = tier._inflight[record.lora_name]
        while not flight._condition._waiters:  # type: ignore[attr-defined]  # second joined it
            time.sleep(0.001)
        release.set()
        assert first.result(10) == world.adapter(record)
        with pytest.raises(ArtifactError):
            second.result(10)


def test_an_entry_is_handed_out_when_its_use_cannot_be_stamped_on_disk(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk remounted read-only after an error (ext4's errors=remount-ro), or an entry
    folder whose owner changed: the use's mtime cannot be written. ``ensure`` raised that
    OSError, so every load of a verified, readable entry failed as ``host_io_error``; the
    stamp only orders evictions across a restart, so the entry is handed out regardless."""
    record = world.install("a1", seed=1)
    tier = tier_of(world)

    def read_only(*_args: Any, **_kwargs: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    assert tier.ensure(record) == world.adapter(record)
    tier.touch(record.lora_name)
