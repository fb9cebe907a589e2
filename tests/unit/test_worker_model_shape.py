"""A worker never hands vLLM an adapter whose tensor shapes were not checked against the base
model vLLM serves (workers/runner.py, ``base_model_shape``): from ``--model-dir``, else from
the folder vLLM lists as its base model's root, else every load refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from loraplane.artifact.model_config import read_model_config
from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import WorkerLimits, verify_artifact
from loraplane.kernel.config import Settings
from loraplane.schemas.adapter import AdapterRecord
from loraplane.schemas.reasons import ArtifactReason as Reason
from loraplane.testing.fake_vllm import FakeVllm
from loraplane.tiny_model import TINY_BASE_MODEL, TinyLlama, build_adapter, build_model
from loraplane.workers.base_model import BaseModelWatch
from loraplane.workers.runner import (
    WorkerOptions,
    base_model_shape,
    build_host_tier,
    served_base_root,
)
from loraplane.workers.vllm_client import VllmClient
from tests.hostile_corpus import CASES, Case, hostile
from tests.unit.test_worker_faults import _model

KEY = "k-vllm"
# lora_A of q_proj as [r, 5000] for a 128-wide model: vLLM takes it at load time and fails
# at activation, which can take its engine down with every tenant's requests.
WIDE = next(c for c in CASES if c.id == "lora_A wider than the model")
GOOD = Case("good", Reason.fetch_failed)
Root = Callable[[str], Awaitable[str | None]]


def _options(tmp_path: Path, model_dir: Path | None = None) -> WorkerOptions:
    return WorkerOptions(
        worker_id="w1",
        base_model=TINY_BASE_MODEL,
        vllm_url="",
        gateway_port=0,
        metrics_port=None,
        host_tier_dir=tmp_path / "host",
        host_budget_bytes=10**8,
        model_dir=model_dir,
    )


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return build_model(tmp_path / "model")


@pytest.fixture
async def listed_root() -> AsyncIterator[Root]:
    """``await listed_root(model)``: the root a FAKE vLLM serving ``model`` lists for its
    base model, read as the worker reads it."""
    servers: list[TestServer] = []

    async def root(model: str) -> str | None:
        server = TestServer(FakeVllm(model, api_key=KEY).app(), host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        client = VllmClient(str(server.make_url("")), api_key=KEY)
        try:
            return await served_base_root(client, 5.0)
        finally:
            await client.close()

    yield root
    for server in servers:
        await server.close()


def _limits(tmp_path: Path, served_root: str | None, model_dir: Path | None = None) -> WorkerLimits:
    shape = base_model_shape(model_dir, served_root)
    options = _options(tmp_path, model_dir)
    return build_host_tier(Settings(home=tmp_path), options, lambda _n: False, shape).limits


def _verify(case: Case, limits: WorkerLimits, tmp_path: Path) -> tuple[Reason, ...]:
    good = build_adapter(tmp_path / f"src-{case.id}", seed=5)
    artifact, record = hostile(case, good, tmp_path / f"case-{case.id}")
    assert isinstance(record, AdapterRecord)
    return verify_artifact(artifact, limits, record).reasons


async def test_attack_a_worker_without_model_dir_refuses_a_wrong_shape_adapter(
    tmp_path: Path, model_dir: Path, listed_root: Root
) -> None:
    """ATTACK: a worker started without ``--model-dir`` beside a vLLM serving a local model
    folder. An adapter of ``lora_A [8, 5000]`` for the 128-wide model passed verification
    (no shapes known) and reached vLLM; it is refused as ``tensor_shape_mismatch``, and a
    module the model lacks as ``module_not_in_model``, while the genuine adapter passes."""
    root = await listed_root(str(model_dir))
    limits = _limits(tmp_path, root)
    assert _verify(WIDE, limits, tmp_path) == (Reason.tensor_shape_mismatch,)
    assert _verify(GOOD, limits, tmp_path) == ()
    for case in CASES:
        if case.id in ("shape not model", "module the model lacks"):
            assert case.reason in _verify(case, limits, tmp_path), case.id


async def test_the_shapes_come_from_the_root_vllm_lists(
    tmp_path: Path, model_dir: Path, listed_root: Root
) -> None:
    """Without ``--model-dir`` the worker reads the config.json of the folder vLLM lists as
    its base model's root: the model vLLM serves; with it, ``--model-dir``'s."""
    root = await listed_root(str(model_dir))
    assert root == str(model_dir)
    expected = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    assert _limits(tmp_path, root).model == expected
    assert _limits(tmp_path / "given", None, model_dir).model == expected


@pytest.mark.parametrize("served", ["org/hub-model", "relative/model", "/no/such/folder", "dir"])
async def test_attack_with_no_shapes_the_worker_does_not_start(
    served: str, tmp_path: Path, listed_root: Root
) -> None:
    """ATTACK: no ``--model-dir`` and vLLM serves a hub id, a relative path, a folder that
    is gone or one without a config.json: nothing says the model's shapes. A worker that ran
    so refused every load, and its startup scan dropped every host-tier entry as
    ``model_shape_unknown``. Its start stops with one line naming why and what to pass."""
    if served == "dir":
        (tmp_path / "bare").mkdir()
        served = str(tmp_path / "bare")
    root = await listed_root(served)
    with pytest.raises(ValueError, match="pass --model-dir"):
        base_model_shape(None, root)


def test_without_shapes_verification_refuses_every_adapter(tmp_path: Path) -> None:
    """Where no shapes are known and they are required (vLLM's resolver for a hub id), every
    adapter is refused as ``model_shape_unknown``, the genuine one too."""
    limits = WorkerLimits(
        base_model=TINY_BASE_MODEL, max_lora_rank=64, model=None, require_model=True
    )
    assert _verify(GOOD, limits, tmp_path) == (Reason.model_shape_unknown,)
    assert Reason.model_shape_unknown in _verify(WIDE, limits, tmp_path)


def test_the_watch_adopts_no_root_it_cannot_match_with_the_verified_shapes(
    tmp_path: Path,
) -> None:
    """``BaseModelWatch``: without ``--model-dir`` the verified root and any root whose
    config.json gives the verified shapes are served; another shape, no readable shapes,
    or no base model listed are not, nor is the first root after one of those. With
    ``--model-dir``, a first root with no shapes to read (a hub id) is vouched for, that
    root only; a first root with other shapes is not."""
    verified = _model(tmp_path / "a")
    shape = read_model_config(Path(verified) / "config.json")
    wide = _model(tmp_path / "wide", TinyLlama(hidden_size=256))
    same = _model(tmp_path / "same")
    watch = BaseModelWatch(shape, root=verified)
    assert watch.check(verified) is None
    for other in (wide, "org/hub", "relative/a", str(tmp_path / "none"), None):
        assert watch.check(other) is not None, other
    assert watch.check(same) is None and watch.root == same
    # the same root, its config.json rewritten with other shapes (vLLM restarted there)
    (tmp_path / "same" / "config.json").write_text((tmp_path / "wide" / "config.json").read_text())
    assert watch.check(same) is not None
    given = BaseModelWatch(shape, model_dir=Path(verified))
    assert given.check("org/hub") is None
    assert given.check("org/other") is not None
    assert given.check(wide) is not None
    assert given.check("org/hub") is None
    assert BaseModelWatch(shape, model_dir=Path(verified)).check(wide) is not None
