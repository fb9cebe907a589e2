"""Presenting a benchmark result: a text table, the JSON file, and PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMNS",
    "SLO_CLASSES",
    "TIERS",
    "best_online",
    "check_outputs",
    "plot",
    "seed_table",
    "table",
    "write_json",
]

COLUMNS = (
    "interactive",
    "batch",
    "canary",
    "bronze/silver/gold/platinum",
    "wcost",
    "/ best online",
    "/ hindsight",
    "/ bound",
    "wrong-model answers",
    "429s (mean wait s)",
    "gpu_hit",
    "plat/can cold",
    "time_s",
)
SLO_CLASSES = ("interactive", "batch", "canary")
TIERS = ("bronze", "silver", "gold", "platinum")


def best_online(result: dict[str, Any]) -> str | None:
    """The online baseline of the scenario's own deployment with the lowest weighted cost."""
    kinds = result.get("kinds") or {}
    rows = [
        n for n, k in kinds.items() if k["online"] and k["baseline"] and not k["own_deployment"]
    ]
    return min(rows, key=lambda n: result["policies"][n]["weighted_miss_cost"], default=None)


def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _share(attainment: dict[str, float], key: str) -> str:
    return f"{attainment[key]:.3f}" if key in attainment else "-"


def table(result: dict[str, Any]) -> str:
    """Markdown table (also readable in a terminal), one row per policy: SLO attainment per
    request class and per priority tier first, then the weighted cost and its ratios to the
    best online baseline, the hindsight per-window set and the budgeted bound of the row's
    own deployment; then what a tenant got instead of its adapter: an answer of the base model
    (a wrong-model answer) or a 429 (a wait, its mean Retry-After). The references follow."""
    head = "| policy | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    bounds = result.get("bounds") or {}
    best = best_online(result)
    best_cost = result["policies"][best]["weighted_miss_cost"] if best else None
    hindsight = (result.get("hindsight") or {}).get("weighted_miss_cost")
    for name, m in result["policies"].items():
        slo = m.get("slo_attainment", {})
        tiers = m.get("slo_attainment_by_priority", {})
        cost = m["weighted_miss_cost"]
        bound = bounds.get(name) or {}
        own = (result.get("kinds") or {}).get(name, {}).get("own_deployment", False)
        cells = [
            _share(slo, "interactive"),
            _share(slo, "batch"),
            _share(slo, "canary"),
            "/".join(f"{tiers[k]:.2f}" if k in tiers else "-" for k in TIERS),
            f"{cost:.4g}",
            "-" if own else _ratio(cost, best_cost),
            "-" if own else _ratio(cost, hindsight),
            _ratio(cost, bound.get("weighted_miss_cost")) if bound.get("binds") else "-",
            str(m["fallbacks"]),
            f"{m['retries']} ({m.get('retry_wait_s_mean', 0):.1f})",
            f"{m['gpu_hit_rate']:.3f}",
            f"{m['platinum_cold_starts']}/{m['canary_cold_starts']}",
            f"{result['timing_s'].get(name, 0):.2f}",
        ]
        label = f"{name} (own deployment)" if own else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [_reference(label, cost) for label, cost in _references(result)]
    return "\n".join(lines)


def _references(result: dict[str, Any]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    hs = result.get("hindsight")
    if hs:
        out.append(
            (
                f"hindsight per-window set ({hs['window_s']:g} s windows, {hs['loads']} "
                "loads; a reference, not a bound)",
                f"{hs['weighted_miss_cost']:.4g}",
            )
        )
    bound = result.get("bound")
    if bound:
        if bound["weighted_miss_cost"] is None:
            out.append(("budgeted LP bound", bound["reason"]))
        elif bound["binds"]:
            out.append(
                (
                    f"budgeted LP bound ({bound['bucket_s']:g} s buckets)",
                    f"{bound['weighted_miss_cost']:.4g}",
                )
            )
        else:
            out.append(
                (
                    "budgeted LP bound: the cold start only",
                    f"{bound['weighted_miss_cost']:.4g}: {bound['reason']}",
                )
            )
    opt = result.get("optimum")
    if opt:
        kind = (
            "budget-free offline optimum"
            if opt["exact"]
            else f"budget-free lower bound ({opt['segments']} segments)"
        )
        out.append((kind, f"{opt['weighted_miss_cost']:.4g}"))
    return out


def _reference(label: str, cost: str) -> str:
    return f"| {label} | " + " | ".join(cost if c == "wcost" else "" for c in COLUMNS) + " |"


def seed_table(result: dict[str, Any]) -> str:
    comparison = result.get("seed_comparison")
    if not comparison:
        return ""
    lines = [
        "| strategy (policy) | HBM peak sim / seed | swap ms sim / seed "
        "| P95 tok/s sim / seed | relative to pooled: HBM, swap, P95 (sim / seed) |",
        "|---|---|---|---|---|",
    ]
    for name, row in comparison["rows"].items():
        s, d = row["simulated"], row["seed"]
        sr, dr = row["simulated_relative"], row["seed_relative"]
        rel = ", ".join(
            f"{sr[k]} / {dr[k]}" for k in ("hbm_peak_ratio", "swap_ms", "p95_tokens_per_s")
        )
        lines.append(
            f"| {name} | {s['hbm_peak_ratio']:.2f}x / {d['hbm_peak']:.2f}x "
            f"| {s['swap_ms']:.0f} / {d['swap_ms']:.0f} "
            f"| {s['p95_tokens_per_s']:.1f} / {d['p95_tokens_per_s']:.0f} | {rel} |"
        )
    return "\n".join(lines)


def check_outputs(outputs: list[tuple[Path | None, str, bool]]) -> None:
    """ValueError naming the flag of the first ``(path, flag, is_folder)`` that could not be
    written (None: not asked for): checked before a run, so a mistyped path loses no sweep."""
    for path, flag, folder in outputs:
        if path is None:
            continue
        what = "a folder" if folder else "a file"
        if path.exists() and path.is_dir() != folder:
            raise ValueError(f"{flag} {path}: expected {what}, and it is not one")
        above = path.parent
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise ValueError(f"{flag} {path}: {above} is no folder")
        if not os.access(above, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: {above} is not writable")


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
    for metric, label, suffix in (
        ("gpu_hit_rate", "GPU hit rate", "hit-rate"),
        ("weighted_miss_cost", "priority-weighted miss cost (ms)", "weighted-cost"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy, series in sweep["policies"].items():
            ax.plot(slots, series[metric], marker="o", label=policy)
        if metric == "weighted_miss_cost" and all(v is not None for v in sweep["optimum"]):
            ax.plot(
                slots,
                sweep["optimum"],
                linestyle=":",
                color="black",
                label="budget-free optimum / bound",
            )
        if metric == "weighted_miss_cost" and all(v is not None for v in sweep["bound"]):
            ax.plot(slots, sweep["bound"], linestyle="--", color="black", label="budgeted LP bound")
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
