"""Artifact path: S3 -> verified host tier, in MB/s, against a raw boto3 download.

loraplane's path is ``workers.host_tier.HostTier.ensure`` (manifest first, every file
streamed with its sha256, size checks, safetensors/PEFT verification against the model
shape, atomic rename; no fsync: the startup scan re-hashes every entry). The raw baseline
is the faster of boto3's ``download_file`` and a streamed ``get_object`` of the same objects
into a plain folder: what a worker without any checks would do. Both run against the
shared S3 endpoint, interleaved (alternating which goes first), on adapters of several
sizes built for a Llama-shaped model with hidden size 1024 (1 MiB of rank-64 q/v weights per
layer). Everything is uploaded under a unique prefix and deleted afterwards.

    .venv/bin/python -m bench.artifact_path            # 8, 16, 32, 64 MiB; 3 repetitions
    .venv/bin/python -m bench.artifact_path --sizes 64 128 --reps 5
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.isolation import delete_s3_prefix
from bench.report import Row, Summary, emit, parse_args, times
from loraplane.artifact.model_shape import ModelShape
from loraplane.artifact.verification import WorkerLimits
from loraplane.artifact_publish import PublishRequest, build_record, upload
from loraplane.kernel.config import Settings, get_settings
from loraplane.schemas.adapter import AdapterRecord, Priority
from loraplane.tiny_model import TinyLlama, build_adapter
from loraplane.workers.artifact_fetch import ArtifactFetcher, FetchPolicy, parse_s3_uri, s3_client
from loraplane.workers.host_tier import HostTier

MIB = 1024**2
RANK = 64
CHUNK = 1024 * 1024
PATHS = ("loraplane", "download_file", "get_object", "get_object_sha256")
RAW = ("download_file", "get_object")  # the baselines the ratio may be taken against
BASE_MODEL = "bench-llama"


def arch(layers: int) -> TinyLlama:
    """A Llama shape where a rank-64 q_proj+v_proj adapter weighs 1 MiB per layer."""
    return TinyLlama(
        hidden_size=1024, num_hidden_layers=layers, num_attention_heads=8, intermediate_size=2048
    )


def publish(settings: Settings, work: Path, prefix: str, size_mib: int) -> AdapterRecord:
    config = arch(size_mib).hf_config(1000)
    folder = build_adapter(
        work / f"src-{size_mib}",
        seed=size_mib,
        rank=RANK,
        base_model_name=BASE_MODEL,
        model_config=config,
    )
    release = PublishRequest(f"{prefix}{size_mib}m", "bench", BASE_MODEL, "1", Priority.silver)
    record, manifest = build_record(folder, release, settings.s3.bucket)
    upload(settings, folder, record, manifest)
    shutil.rmtree(folder)
    return record


def raw_download(client: Any, record: AdapterRecord, dest: Path, how: str) -> int:
    """Every object of the artifact with boto3's managed ``download_file``, or one streamed
    ``get_object`` each (``get_object_sha256``: also hashing each chunk, the least a
    verified install must do); bytes written."""
    bucket, key_prefix = parse_s3_uri(record.artifact_uri)
    dest.mkdir(parents=True)
    total = 0
    for obj in client.list_objects_v2(Bucket=bucket, Prefix=key_prefix)["Contents"]:
        target = dest / obj["Key"][len(key_prefix) :]
        if how == "download_file":
            client.download_file(bucket, obj["Key"], str(target))
        else:
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"]
            digest = hashlib.sha256()
            with open(target, "wb") as out:
                for chunk in body.iter_chunks(CHUNK):
                    out.write(chunk)
                    if how == "get_object_sha256":
                        digest.update(chunk)
        total += target.stat().st_size
    return total


def run(settings: Settings, sizes: list[int], reps: int) -> dict[str, Any]:
    prefix = f"bench-artifact-{uuid.uuid4().hex[:10]}-"
    limits = WorkerLimits(
        base_model=BASE_MODEL,
        max_lora_rank=RANK,
        max_total_bytes=max(sizes) * MIB * 2,
        model=ModelShape.from_hf_config(arch(max(sizes)).hf_config(1000)),
    )
    policy = FetchPolicy(read_timeout_s=10.0, deadline_s=300.0)
    client = s3_client(settings.s3, policy)
    with tempfile.TemporaryDirectory(prefix="bench-artifact-") as tmp:
        work = Path(tmp)
        try:
            records = [publish(settings, work, prefix, s) for s in sizes]
            tier = HostTier(
                work / "tier",
                budget_bytes=4 * sum(sizes) * MIB,
                limits=limits,
                fetcher=ArtifactFetcher(settings.s3, policy, client=client),
            )
            per_size: dict[int, dict[str, list[float]]] = {s: {p: [] for p in PATHS} for s in sizes}
            totals: dict[str, list[float]] = {p: [] for p in PATHS}
            for rep in range(reps):
                elapsed = dict.fromkeys(PATHS, 0.0)
                moved = dict.fromkeys(PATHS, 0)
                for size, record in zip(sizes, records, strict=True):
                    shift = rep % len(PATHS)
                    for path in PATHS[shift:] + PATHS[:shift]:
                        dest = work / f"raw-{rep}-{size}"
                        started = time.perf_counter()
                        if path == "loraplane":
                            folder = tier.ensure(record)
                            n = sum(p.stat().st_size for p in folder.iterdir())
                        else:
                            n = raw_download(client, record, dest, path)
                        seconds = time.perf_counter() - started
                        if path == "loraplane":
                            tier.remove(record.lora_name)
                        else:
                            shutil.rmtree(dest)
                        elapsed[path] += seconds
                        moved[path] += n
                        per_size[size][path].append(n / MIB / seconds)
                for path in totals:
                    totals[path].append(moved[path] / MIB / elapsed[path])
        finally:
            delete_s3_prefix(settings, f"bench/{prefix}")  # TENANT/ADAPTER_ID/...
    summary = {p: Summary.from_samples(v) for p, v in totals.items()}
    best = max(RAW, key=lambda p: summary[p].median)
    ratios = [a / b for a, b in zip(totals["loraplane"], totals[best], strict=True)]
    return {
        "unit": "MiB/s",
        "sizes_mib": sizes,
        "reps": reps,
        "loraplane_mib_s": summary["loraplane"].as_dict(),
        "raw_download_file_mib_s": summary["download_file"].as_dict(),
        "raw_get_object_mib_s": summary["get_object"].as_dict(),
        "reference_get_object_sha256_mib_s": summary["get_object_sha256"].as_dict(),
        "ratio_vs_reference": round(
            summary["loraplane"].median / summary["get_object_sha256"].median, 3
        ),
        "baseline": best,
        "ratio": round(summary["loraplane"].median / summary[best].median, 3),
        "ratio_per_rep": Summary.from_samples(ratios).as_dict(),
        "per_size_mib_s": {
            str(s): {p: round(Summary.from_samples(v[p]).median, 1) for p in PATHS}
            for s, v in per_size.items()
        },
        "goal": ">= 0.9x",
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=[8, 16, 32, 64], help="adapter sizes in MiB"
    )
    parser.add_argument("--reps", type=int, default=3)
    args = parse_args(parser, "bench.artifact_path", argv)
    result = run(get_settings(), args.sizes, args.reps)
    best = result["baseline"]
    emit(
        result,
        Row(
            "artifact path (S3 -> verified host tier)",
            Summary(**result["loraplane_mib_s"]).text("MiB/s"),
            Summary(**result[f"raw_{best}_mib_s"]).text("MiB/s") + f" boto3 {best}; "
            "with sha256: " + Summary(**result["reference_get_object_sha256_mib_s"]).text("MiB/s"),
            f"{times(result['ratio'])} ({times(result['ratio_vs_reference'])} of "
            "get_object+sha256)",
            result["goal"],
        ),
        args,
    )


if __name__ == "__main__":
    main()
