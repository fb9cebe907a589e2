"""Attack tests: what an operator hands ``loraplane simulate`` and ``loraplane capacity`` (a
scenario file they were sent, sweep ranges, output paths) is refused as a line before any run,
never a traceback after one, a hang, or a file written outside the folder named."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from loraplane.cli import app
from loraplane.commands.capacity import _counts
from loraplane.simulator.scenario import MAX_COUNT, Scenario, load_scenario

TINY = """
name: {name}
workload: {{requests: 120, adapters: 6}}
fleet: {{base_models: [{{workers: 1, gpu_slots_per_worker: 2}}]}}
sweep: {{gpu_slots_per_worker: [2]}}
"""


def _scenario(tmp_path: Path, name: str = "tiny") -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(TINY.format(name=name))
    return path


@pytest.mark.parametrize(
    "name", ["../../escaped", "a/b", "/abs", ".hidden", "", "x" * 129, "tab\there", "nl\n"]
)
def test_attack_a_scenario_name_is_one_plain_file_name(name: str, tmp_path: Path) -> None:
    """``simulate --plot DIR`` writes ``DIR/{name}-hit-rate.png``: a name with a separator or
    ``..`` wrote the picture anywhere the operator could write."""
    with pytest.raises(ValidationError, match="name"):
        Scenario(name=name)


def test_attack_the_plots_stay_in_the_folder_named(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(TINY.format(name='"../../../../../../../../../' + f'{tmp_path}/out"'))
    plots = tmp_path / "plots" / "a"
    result = CliRunner().invoke(
        app, ["simulate", "--scenario", str(path), "--policy", "lru", "--plot", str(plots)]
    )
    assert result.exit_code == 2 and "name" in result.output
    assert not list(tmp_path.glob("out*"))


def test_a_plain_scenario_name_still_runs_and_plots(tmp_path: Path) -> None:
    path = _scenario(tmp_path, "replay-24h.v2")
    result = CliRunner().invoke(
        app, ["simulate", "--scenario", str(path), "--policy", "lru", "--plot", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "replay-24h.v2-hit-rate.png").is_file()


@pytest.mark.parametrize(
    "field",
    [
        "sweep: {gpu_slots_per_worker: [0]}",
        "sweep: {gpu_slots_per_worker: [-2]}",
        "sweep: {gpu_slots_per_worker: [1000000000]}",
        "sweep: {gpu_slots_per_worker: []}",
        "fleet: {base_models: [{workers: 1000000000}]}",
        "fleet: {base_models: [{gpu_slots_per_worker: 1000000000}]}",
        "fleet: {base_models: [{max_concurrent_per_worker: 1000000000}]}",
        "workload: {requests: 1000000000000}",
        "workload: {adapters: 1000000000}",
        "workload: {tenants: 1000000000}",
        "workload: {peaks: [{at_s: 0, duration_s: 1.0e+9, qps: 1.0e+9, rank: 0}]}",
        "workload: {rate_qps: .inf}",
        "workload: {ranks: {1" + "0" * 400 + ": 1.0}}",
        "workload: {ranks: {-16: 1.0}}",
        "workload: {ranks: {0: 1.0}}",
        "workload: {ranks: {}}",
        "workload: {diurnal: {period_s: .nan}}",
        "fleet: {costs: {fallback_cost_ms: .inf}}",
        "fleet: {costs: {fallback_cost_ms: 1.0e+308}}",
        "fleet: {costs: {adapter_bytes_per_rank: 1.0e+308}}",
        "fleet: {costs: {s3_gbps: 1.0e-300}}",
        "fleet: {costs: {priority_weights: {gold: 1.0e+308}}}",
        "fleet: {base_models: [{hbm_bytes_per_worker: 1.0e+308}]}",
        "workload: {alpha: 1.0e+308}",
        "workload: {priority_mix: {gold: 1.0e+308}}",
        "adapter_cache_policy: {tenant_priority_values: {gold: .nan}}",
        "adapter_cache_policy: {tenant_priority_values: {gold: -5}}",
        "adapter_cache_policy: {normalisation: {qps_10m: .inf}}",
        "adapter_cache_policy: {ttft_penalty_prior_ms: .inf}",
        "overrides: {lru: {gpu_slots_per_worker: 0}}",
        "overrides: {lru: {cold_loads_per_minute_per_worker: 1000000000}}",
    ],
)
def test_attack_a_count_or_number_out_of_range_is_refused_before_the_run(
    field: str, tmp_path: Path
) -> None:
    """Before: a sweep of 0 or -2 slots ran the whole table, then raised in matplotlib or the
    optimum; 10**9 workers or requests held the command until memory ran out; ``.inf`` in a
    rate or a cost made every total infinite, and so did a finite 1e308 (the LP bound's
    ValueError traceback) or a bandwidth of 1e-300; a LoRA rank of 10**400 in the rank mix was an
    OverflowError traceback, and one of 0 or -16 sized adapters at nothing or less."""
    key = field.split(":", 1)[0]
    text = TINY.format(name="tiny")
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(f"{key}:"))
    path = tmp_path / "s.yaml"
    path.write_text(text + "\n" + field + "\n")
    with pytest.raises(ValueError):
        load_scenario(path)
    result = CliRunner().invoke(app, ["simulate", "--scenario", str(path), "--policy", "lru"])
    assert result.exit_code == 2 and result.output.startswith("simulate: "), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (str(MAX_COUNT + 1), f"at most {MAX_COUNT}"),
        ("100000000", f"at most {MAX_COUNT}"),
        ("\u0663", "whole numbers"),  # an Arabic-Indic three: int() reads it, no operator meant it
        ("1_000", "whole numbers"),
        (",".join(str(i) for i in range(1, 66)), "at most 64 values"),
    ],
)
def test_attack_a_capacity_axis_is_bounded(text: str, says: str, tmp_path: Path) -> None:
    """Before: ``--workers 100000000`` built a fleet of 10**8 workers per point and held the
    command until memory ran out."""
    with pytest.raises(ValueError, match=says):
        _counts(text, "--workers")
    args = ["capacity", "--target", "batch=0.9", "--scenario", str(_scenario(tmp_path))]
    result = CliRunner().invoke(app, [*args, "--workers", text])
    assert result.exit_code == 2 and says in result.output


@given(st.lists(st.integers(1, MAX_COUNT), min_size=1, max_size=64))
def test_a_capacity_axis_reads_back_what_was_written(values: list[int]) -> None:
    assert _counts(",".join(map(str, values)), "--slots") == tuple(sorted(set(values)))


def _outputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    folder = tmp_path / "folder"
    folder.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    scenario = str(_scenario(tmp_path))
    capacity = ["capacity", "--target", "batch=0.1", "--scenario", scenario, "--policy", "lru"]
    capacity += ["--workers", "1", "--slots", "2", "--loads", "6"]
    simulate = ["simulate", "--scenario", scenario, "--policy", "lru"]
    return [
        ([*simulate, "--json", str(folder)], "--json"),
        ([*simulate, "--json", str(a_file / "out.json")], "--json"),
        ([*simulate, "--plot", str(a_file)], "--plot"),
        ([*simulate, "--plot", str(a_file / "plots")], "--plot"),
        ([*capacity, "--json", str(folder)], "--json"),
        ([*capacity, "--plot", str(folder)], "--plot"),
        ([*capacity, "--plot", str(a_file / "cap.png")], "--plot"),
    ]


def test_attack_an_output_path_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path,
) -> None:
    """Before: a folder given as ``--json`` (or a file as ``--plot DIR``) ran the whole sweep,
    then ended in IsADirectoryError / FileExistsError with a traceback, the result lost."""
    for args, flag in _outputs(tmp_path):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert flag in result.output and "requests" not in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW = "2023-11-16 18:15:46.6805900,374,44\n"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ("2023-11-16 18:15:47,374,-5\n", "GeneratedTokens"),
        ("2023-11-16 18:15:47,374," + "9" * 30 + "\n", "GeneratedTokens"),
        ("2023-11-16 18:15:47,374,\u0663\n", "GeneratedTokens"),
        ("2023-11-16 18:15:47,374," + "1" * 200_000 + "\n", "field"),
    ],
)
def test_attack_a_trace_row_out_of_range_is_a_trace_error_naming_its_line(
    body: str, says: str, tmp_path: Path
) -> None:
    """Before: 10**30 tokens raised OverflowError in numpy, an over-long field csv.Error,
    each a traceback; -5 tokens was replayed as a request of negative decode time."""
    from loraplane.simulator.trace import TraceError, load_trace

    path = tmp_path / "trace.csv"
    path.write_text(HEADER + ROW + body)
    with pytest.raises(TraceError, match=says) as refused:
        load_trace(path)
    assert f"{path}:3" in str(refused.value)
    result = CliRunner().invoke(
        app, ["simulate", "--scenario", str(_scenario(tmp_path)), "--trace", str(path)]
    )
    assert result.exit_code == 2 and result.output.startswith("simulate: "), result.output


CORNERS = """
name: corners
workload: {requests: 120, adapters: 6, rate_qps: 1.0e+9, alpha: 100, cv: 100,
  priority_mix: {gold: 1.0e+6, bronze: 0}, ranks: {512: 1.0e+6}}
fleet:
  base_models: [{workers: 1, gpu_slots_per_worker: 2, host_bytes_per_worker: 1.152921504606847e+18,
    hbm_bytes_per_worker: 1.152921504606847e+18, base_weights_bytes: 0, kv_reserved_bytes: 0}]
  costs: {swap_fixed_ms: 1.0e+9, fetch_fixed_ms: 1.0e+9, fallback_cost_ms: 1.0e+9,
    host_to_gpu_gbps: 1.0e-6, s3_gbps: 1.0e-6, decode_tokens_per_s: 1.0e-6,
    adapter_bytes_per_rank: 134217728,
    priority_weights: {gold: 1.0e+6, bronze: 1.0e+6}}
sweep: {gpu_slots_per_worker: [2]}
"""


def test_a_scenario_at_every_bound_runs_to_finite_figures(tmp_path: Path) -> None:
    """Every quantity at the edge of its range (the largest bytes and costs, the slowest
    rates, the heaviest weights) still gives a table of finite numbers, the LP bound's
    included: the ranges are what keeps the simulator's sums finite."""
    path = tmp_path / "s.yaml"
    path.write_text(CORNERS)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        app, ["simulate", "--scenario", str(path), "--policies", "all", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    text = out.read_text()
    assert "Infinity" not in text and "NaN" not in text, text[:2000]
