"""Decision quality: the default policy against every online baseline, per scenario, and the
goals it is held to (docs/benchmarks.md, "Decision quality").

    python -m bench.decision_quality [SCENARIO.yaml ...] [--policies a,b] [--write-doc]

Each scenario (default: every ``bench/scenarios/*.yaml`` but ``million``, the throughput
check) is replayed with every online baseline, offline Belady and the loraplane rows, each on
the scenario's own deployment (a scenario's ``overrides``, the seed comparison's other
deployments, are left out: a goal compares rows on the same slots and budget), with the
budgeted LP bound and the hindsight per-window set. The goals of the default policy
(``loraplane``: the product's default ``Policy`` unless the scenario's file sets one):

- ``cost``: weighted miss cost at most every online baseline's;
- ``interactive`` / ``batch``: SLO attainment of each class at least the best online
  baseline's (the highest of any of them);
- ``canary``: canary versions' attainment at least 0.99;
- ``guarantee``: no platinum or canary cold start where every such version fits in the
  protected slots (``max_protected_gpu_share``); ``None`` where they do not fit;
- ``hindsight``: cost at most 1.2x the hindsight per-window set's.

Prints one JSON object (every run's result and its goals); edits no tracked file unless
``--write-doc`` is given, which replaces the table of the section in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from loraplane.simulator import benchmark
from loraplane.simulator.catalog import Catalog
from loraplane.simulator.report import TIERS, best_online
from loraplane.simulator.scenario import Scenario, load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "bench" / "scenarios"
DOC = ROOT / "docs" / "benchmarks.md"
POLICIES = (
    "lru",
    "fifo",
    "s3-fifo",
    "sieve",
    "gdsf",
    "dynamo",
    "belady",
    "loraplane",
    "loraplane-seed",
)
DEFAULT = "loraplane"
HINDSIGHT_FACTOR = 1.2
CANARY_FLOOR = 0.99
TABLE_START = "<!-- decision-quality table: bench/decision_quality.py --write-doc -->"
TABLE_END = "<!-- end of the decision-quality table -->"


def guarantee_fits(scenario: Scenario, catalog: Catalog) -> bool:
    """Does every platinum and canary version of each pool fit in its protected slots?"""
    policy = scenario.policy
    for pool, spec in enumerate(scenario.fleet.base_models):
        slots = min(policy.gpu_slots_per_base_model, spec.workers * spec.gpu_slots_per_worker)
        cap = max(1, math.ceil(policy.max_protected_gpu_share * slots))
        guarded = sum(
            1
            for a in catalog.adapters
            if a.base_model == pool and (a.priority == "platinum" or a.is_canary)
        )
        if guarded > cap:
            return False
    return True


def goals(result: dict[str, Any], fits: bool, default: str = DEFAULT) -> dict[str, Any]:
    """The default row's goals against the online baselines of the same run."""
    rows, kinds = result["policies"], result["kinds"]
    online = [
        n for n, k in kinds.items() if k["online"] and k["baseline"] and not k["own_deployment"]
    ]
    me = rows[default]
    slo = me["slo_attainment"]
    best = {
        c: max((rows[n]["slo_attainment"].get(c, 0.0) for n in online), default=0.0)
        for c in ("interactive", "batch")
    }
    cheapest = best_online(result)
    hindsight = (result.get("hindsight") or {}).get("weighted_miss_cost")
    cold = me["platinum_cold_starts"] + me["canary_cold_starts"]
    judged = bool(online)  # without a baseline in the run (--policies) these are not judged
    out: dict[str, Any] = {
        "cost": me["weighted_miss_cost"]
        <= min((rows[n]["weighted_miss_cost"] for n in online), default=math.inf)
        if judged
        else None,
        "interactive": ("interactive" not in slo or slo["interactive"] >= best["interactive"])
        if judged
        else None,
        "batch": ("batch" not in slo or slo["batch"] >= best["batch"]) if judged else None,
        "canary": slo.get("canary", 1.0) >= CANARY_FLOOR,
        "guarantee": (cold == 0) if fits else None,
        "hindsight": bool(hindsight) and me["weighted_miss_cost"] <= HINDSIGHT_FACTOR * hindsight,
    }
    out["all"] = all(v is not False for v in out.values())
    out["best_online"] = {
        "cost": cheapest,
        "interactive": best["interactive"],
        "batch": best["batch"],
        "by_interactive": max(
            online, default=None, key=lambda n: rows[n]["slo_attainment"].get("interactive", 0.0)
        ),
        "by_batch": max(
            online, default=None, key=lambda n: rows[n]["slo_attainment"].get("batch", 0.0)
        ),
    }
    return out


def run_scenario(path: Path, policies: list[str]) -> dict[str, Any]:
    scenario = load_scenario(path).model_copy(update={"overrides": {}})
    bench = benchmark.prepare(scenario)
    started = time.perf_counter()
    result = benchmark.run(
        bench,
        policies,
        progress=lambda step: print(f"{scenario.name}: {step}", file=sys.stderr, flush=True),
    )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    fits = guarantee_fits(scenario, bench.catalog)
    result["guarantee_fits"] = fits
    result["goals"] = goals(result, fits) if DEFAULT in result["policies"] else None
    return result


def table(results: list[dict[str, Any]]) -> str:
    """One row per scenario: attainment per class first (the default's, then the best online
    baseline's), the tiers, then the cost and its ratios, then what tenants got instead."""
    lines = [
        "| scenario | interactive: default / best online | batch: default / best online "
        "| canary | bronze/silver/gold/platinum | weighted cost | / cheapest online "
        "| / hindsight set | / LP bound | wrong-model answers (base) | 429s (mean "
        "Retry-After s) | plat/can cold starts | goals |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["goals"] is None:  # the default policy was not run: nothing to show
            continue
        me, g = r["policies"][DEFAULT], r["goals"]
        slo, tiers = me["slo_attainment"], me["slo_attainment_by_priority"]
        cost = me["weighted_miss_cost"]
        best = g["best_online"]
        cheapest = r["policies"][best["cost"]]["weighted_miss_cost"] if best["cost"] else None
        hs = r["hindsight"]["weighted_miss_cost"]
        bound = r["bound"]
        lp = (
            f"{cost / bound['weighted_miss_cost']:.2f}x"
            if bound.get("binds")
            else "not binding"
            if bound["weighted_miss_cost"] is not None
            else "not computed"
        )
        shares = [
            f"{slo[c]:.3f} / "
            + (f"{best[c]:.3f} ({best['by_' + c]})" if best["by_" + c] else "- (no baseline run)")
            if c in slo
            else "-"
            for c in ("interactive", "batch")
        ]
        failed = [
            k
            for k in ("cost", "interactive", "batch", "canary", "guarantee", "hindsight")
            if g[k] is False
        ]
        cells = [
            f"{r['scenario']['name']} ({r['requests']})",
            *shares,
            f"{slo['canary']:.3f}" if "canary" in slo else "-",
            "/".join(f"{tiers[t]:.2f}" if t in tiers else "-" for t in TIERS),
            f"{cost:.4g}",
            f"{cost / cheapest:.2f}x ({best['cost']})" if cheapest else "-",
            f"{cost / hs:.2f}x",
            lp,
            str(me["fallbacks"]),
            f"{me['retries']} ({me['retry_wait_s_mean']:.1f})",
            f"{me['platinum_cold_starts']}/{me['canary_cold_starts']}"
            + ("" if r["guarantee_fits"] else " (does not fit)"),
            "all" if not failed else "not " + ", ".join(failed),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(text: str, doc: Path | None = None) -> None:
    """Replace the table between the section's markers (they must be there)."""
    doc = doc or DOC
    body = doc.read_text()
    start, end = body.index(TABLE_START), body.index(TABLE_END)
    doc.write_text(body[: start + len(TABLE_START)] + "\n\n" + text + "\n\n" + body[end:])


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "scenarios",
        nargs="*",
        type=Path,
        help="scenario files (default: bench/scenarios/*.yaml but million)",
    )
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--write-doc", action="store_true", help="replace the table in docs/benchmarks.md"
    )
    args = parser.parse_args(argv)
    paths = args.scenarios or [p for p in sorted(SCENARIOS.glob("*.yaml")) if p.stem != "million"]
    results = [run_scenario(p, args.policies.split(",")) for p in paths]
    out = {"machine": machine(), "results": results, "table": table(results)}
    print(json.dumps(out, indent=1))
    if args.write_doc:
        write_doc(out["table"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
