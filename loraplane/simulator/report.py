"""Presenting a benchmark result: a text table, the JSON file, and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLUMNS = ("gpu_hit", "host_hit", "cold", "swaps", "fallbk", "retry", "queued", "p50", "p95", "p99",
           "wcost", "plat_cs", "can_cs", "slo i/b/c", "time_s")
SLO_CLASSES = ("interactive", "batch", "canary")


def _slo_cell(attainment: dict[str, float]) -> str:
    """SLO attainment of interactive / batch / canary requests ("-": none of that class)."""
    return "/".join(f"{attainment[k]:.3f}" if k in attainment else "-" for k in SLO_CLASSES)


def table(result: dict[str, Any]) -> str:
    """Markdown table (also readable in a terminal): one row per policy, its weighted cost
    also as a multiple of the budgeted bound of its own deployment, then the bounds."""
    head = "| policy | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    bounds = result.get("bounds") or {}
    for name, m in result["policies"].items():
        p = m["ttft_penalty_ms"]
        wcost = f"{m['weighted_miss_cost']:.4g}"
        best = (bounds.get(name) or {}).get("weighted_miss_cost")
        if best:
            wcost += f" ({m['weighted_miss_cost'] / best:.2f}x)"
        cells = [f"{m['gpu_hit_rate']:.3f}", f"{m['host_hit_rate']:.3f}", str(m["cold_loads"]),
                 str(m["swaps"]), str(m["fallbacks"]),
                 str(m["retries"]), str(m["queued"]), f"{p['p50']:.0f}",
                 f"{p['p95']:.0f}",
                 f"{p['p99']:.0f}", wcost, str(m["platinum_cold_starts"]),
                 str(m["canary_cold_starts"]), _slo_cell(m.get("slo_attainment", {})),
                 f"{result['timing_s'].get(name, 0):.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    bound = result.get("bound")
    if bound:
        lines.append(f"| budgeted LP bound ({bound['bucket_s']:g} s buckets) | " + " | ".join(
            f"{bound['weighted_miss_cost']:.4g}" if c == "wcost" else "" for c in COLUMNS)
            + " |")
    opt = result.get("optimum")
    if opt:
        kind = ("budget-free offline optimum" if opt["exact"]
                else f"budget-free lower bound ({opt['segments']} segments)")
        lines.append(f"| {kind} | " + " | ".join(
            f"{opt['weighted_miss_cost']:.4g}" if c == "wcost" else "" for c in COLUMNS) + " |")
    return "\n".join(lines)


def seed_table(result: dict[str, Any]) -> str:
    comparison = result.get("seed_comparison")
    if not comparison:
        return ""
    lines = ["| strategy (policy) | HBM peak sim / seed | swap ms sim / seed "
             "| P95 tok/s sim / seed | relative to pooled: HBM, swap, P95 (sim / seed) |",
             "|---|---|---|---|---|"]
    for name, row in comparison["rows"].items():
        s, d = row["simulated"], row["seed"]
        sr, dr = row["simulated_relative"], row["seed_relative"]
        rel = ", ".join(f"{sr[k]} / {dr[k]}" for k in ("hbm_peak_ratio", "swap_ms",
                                                       "p95_tokens_per_s"))
        lines.append(f"| {name} | {s['hbm_peak_ratio']:.2f}x / {d['hbm_peak']:.2f}x "
                     f"| {s['swap_ms']:.0f} / {d['swap_ms']:.0f} "
                     f"| {s['p95_tokens_per_s']:.1f} / {d['p95_tokens_per_s']:.0f} | {rel} |")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")


def plot(sweep: dict[str, Any], name: str, directory: Path) -> list[Path]:
    """``{name}-hit-rate.png`` and ``{name}-weighted-cost.png``: one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    slots = sweep["gpu_slots_per_worker"]
    written = []
    for metric, label, suffix in (("gpu_hit_rate", "GPU hit rate", "hit-rate"),
                                  ("weighted_miss_cost", "priority-weighted miss cost (ms)",
                                   "weighted-cost")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, series in sweep["policies"].items():
            ax.plot(slots, series[metric], marker="o", label=policy)
        if metric == "weighted_miss_cost" and all(v is not None for v in sweep["optimum"]):
            ax.plot(slots, sweep["optimum"], linestyle=":", color="black",
                    label="budget-free optimum / bound")
        if metric == "weighted_miss_cost" and all(v is not None for v in sweep["bound"]):
            ax.plot(slots, sweep["bound"], linestyle="--", color="black",
                    label="budgeted LP bound")
        ax.set_xscale("log", base=2)
        ax.set_xticks(slots, [str(s) for s in slots])
        ax.set_xlabel("GPU slots per worker")
        ax.set_ylabel(label)
        ax.set_title(f"{name}: {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = directory / f"{name}-{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
