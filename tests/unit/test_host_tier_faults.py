"""The host warm tier's folders changed under a running tier: an entry replaced by a link to
other bytes, a folder torn by a crash or replaced by a file. The tier never hands out a
folder it did not verify, and a leftover in an entry's place never blocks the install."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from loraplane.artifact.verification import WorkerLimits
from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter
from loraplane.workers.host_tier import HostTier
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
