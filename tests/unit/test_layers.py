"""The import contract of docs/architecture.md, checked on the source tree (AST, no imports run).

Layers point one way: kernel (0) <- pure decisions (1) <- runtimes (2) <- applications (3).
A module may import its own layer or lower ones; runtimes do not import one another; pure
decision code imports no network, process or broker library; no module-level import cycle.
Lazy imports inside functions count too: they are the ones that hid cycles before.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[2]
# The package-dir mapping of pyproject.toml: folder -> import prefix.
FOLDERS = {
    "loraplane": "loraplane",
    "schemas": "loraplane.schemas",
    "streams": "loraplane.streams",
    "workers": "loraplane.workers",
    "infra": "loraplane.infra",
    "dashboards": "loraplane.dashboards",
}

KERNEL, DECISIONS, RUNTIMES, APPLICATIONS = 0, 1, 2, 3
LAYER_NAMES = {0: "kernel", 1: "decisions", 2: "runtimes", 3: "applications"}
# First match wins; every module must match one pattern (a new module is placed on purpose).
CONTRACT: list[tuple[str, int]] = [
    # what a cache command does to a copy: shared by the planner and the worker agent
    ("loraplane.kernel.command_effects", KERNEL),
    # the one live tail of a compacted topic: the worker's and the router's registry
    ("loraplane.kernel.topic_tail", KERNEL),
    # every Prometheus series name: the worker, the router, the streams app, the rules' tests
    ("loraplane.kernel.metric_names", KERNEL),
    ("loraplane.kernel", KERNEL),
    ("loraplane.kernel.*", KERNEL),
    ("loraplane.schemas", KERNEL),
    ("loraplane.schemas.*", KERNEL),
    # --- the registry: the wire model is schemas.registry; here its pure decisions and the
    # runtime side every consumer shares (a library of the runtimes, not a runtime)
    ("loraplane.registry.fold", DECISIONS),  # lifecycle events -> versions
    ("loraplane.registry.evidence", DECISIONS),  # a view re-derived from its signed events
    ("loraplane.registry.vouch", DECISIONS),  # does a verified view name this lora name
    ("loraplane.registry", RUNTIMES),
    ("loraplane.registry.*", RUNTIMES),  # topic, live, ...
    # --- artifacts: pure verification, and the three that read files for it
    ("loraplane.artifact.directory", RUNTIMES),  # reads a folder for the pure verifier
    # reads a base model's config.json for the pure shape check
    ("loraplane.artifact.model_config", RUNTIMES),
    # runs the model-signing library on a bundle file for the pure model_signature check
    ("loraplane.artifact.model_signing_bundle", RUNTIMES),
    ("loraplane.artifact", DECISIONS),
    ("loraplane.artifact.*", DECISIONS),
    # --- the front door, shared by the router and the worker's gateway: the admission of a
    # request and its version, fields and caps, the signed forward (pure); API keys and the
    # upstream client (a library of both runtimes)
    ("loraplane.frontdoor.admission", DECISIONS),
    ("loraplane.frontdoor.version_choice", DECISIONS),
    ("loraplane.frontdoor.request_fields", DECISIONS),
    ("loraplane.frontdoor.forwarded", DECISIONS),
    ("loraplane.frontdoor.gateway_proof", DECISIONS),
    ("loraplane.frontdoor", RUNTIMES),
    ("loraplane.frontdoor.*", RUNTIMES),
    # --- the event log every runtime writes through (sink, spool, journal): a library
    ("loraplane.eventlog", RUNTIMES),
    ("loraplane.eventlog.*", RUNTIMES),
    # --- streams: pure scores and planning
    ("loraplane.streams.scores", DECISIONS),
    ("loraplane.streams.score_fold", DECISIONS),
    ("loraplane.streams.planner", DECISIONS),
    # which request logs may hold a score key: the registry's live versions, nothing else
    ("loraplane.streams.score_admission", DECISIONS),
    ("loraplane.streams.planner_columns", DECISIONS),
    ("loraplane.streams.planner_candidates", DECISIONS),
    ("loraplane.streams.schedules", DECISIONS),
    ("loraplane.streams", RUNTIMES),
    ("loraplane.streams.*", RUNTIMES),
    # --- the worker (one per GPU host): pure reconcile and its rules, then the runtime
    ("loraplane.workers.reconcile", DECISIONS),
    # which request's load may take a copy's slot: the agent's fold and the simulator's
    ("loraplane.workers.demand_admission", DECISIONS),
    # what a load costs the batch beside it, measured, and the budget that follows
    ("loraplane.workers.load_interference", DECISIONS),
    # a host-tier entry's layout and record: the tier writes it, vLLM's resolver reads it,
    # reconcile vouches for the resolver's copies
    ("loraplane.workers.host_tier_entry", DECISIONS),
    # which vLLM routes answer without the key (the judged table) and the guard vLLM runs
    ("loraplane.workers.vllm_routes", DECISIONS),
    ("loraplane.workers.vllm_guard", DECISIONS),
    ("loraplane.workers.command_trust", DECISIONS),  # verifies a command before the fold
    ("loraplane.workers", RUNTIMES),
    ("loraplane.workers.*", RUNTIMES),
    # --- the fleet router (its own process): pure routing, liveness, flow control and the
    # fleet view (also what `loraplane fleet status` shows), then its HTTP front
    ("loraplane.router.routing", DECISIONS),
    ("loraplane.router.liveness", DECISIONS),
    ("loraplane.router.flow_control", DECISIONS),
    ("loraplane.router.fleet_view", DECISIONS),
    ("loraplane.router", RUNTIMES),
    ("loraplane.router.*", RUNTIMES),
    ("loraplane.lifecycle_events", DECISIONS),
    ("loraplane.metrics", RUNTIMES),
    ("loraplane.metrics.*", RUNTIMES),
    # the systemd units' ExecStart, parsed by the CLI they start: a tool over the CLI
    ("loraplane.infra.systemd_units", APPLICATIONS),
    # the Helm chart rendered by a real Helm, its containers parsed by the CLI: the same
    ("loraplane.infra.helm_chart", APPLICATIONS),
    ("loraplane.infra.prometheus", RUNTIMES),  # a loopback Prometheus server and promtool
    ("loraplane.infra", RUNTIMES),
    ("loraplane.infra.*", RUNTIMES),
    # vLLM's entry point (imports vllm): only vLLM's Python imports it, nothing here does
    ("loraplane.vllm_plugin", APPLICATIONS),
    # request-log rows and worker states -> the simulator's workload and fleet (pure)
    ("loraplane.simulator.replay", APPLICATIONS),
    ("loraplane", APPLICATIONS),
    ("loraplane.*", APPLICATIONS),  # the fake vLLM is testing.*
]
# Runtimes are separate processes: none imports another's modules, pure or not; they share
# code only through the packages below them (kernel, schemas, registry, frontdoor, eventlog).
RUNTIME_PACKAGES = (
    "loraplane.streams",
    "loraplane.workers",
    "loraplane.router",
    "loraplane.metrics",
    "loraplane.infra",
)
# The processes of streams/: the registry agent (in the Faust app), the scoring keepers
# (`streams scoring`, or a thread of the Faust app) and the planner (`streams planner`, or a
# thread of the Faust app). `streams.app` is the Faust app that hosts them; one process's
# runtime modules never import another's (their pure modules are shared decisions).
STREAMS_PROCESSES = {
    "registry agent": ("loraplane.streams.registry_agent",),
    "scoring keeper": ("loraplane.streams.score_keeper", "loraplane.streams.scoring_agent"),
    "planner": (
        "loraplane.streams.planner_runtime",
        "loraplane.streams.planner_lease",
        "loraplane.streams.planner_agent",
    ),
}
IO_LIBRARIES = (
    "aiohttp",
    "boto3",
    "botocore",
    "clickhouse_driver",
    "confluent_kafka",
    "faust",
    "aiokafka",
    "httptools",
    "requests",
    "socket",
    "subprocess",
    "urllib.request",
    "http.client",
    "asyncio",
)


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int
    runtime: bool  # False under `if TYPE_CHECKING:`


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    prefix = FOLDERS[parts[0]]
    name = ".".join([prefix, *parts[1:]])
    return name.removesuffix(".__init__")


def source_files() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out[module_of(path)] = path
    return out


def layer_of(module: str) -> int:
    for pattern, layer in CONTRACT:
        if fnmatchcase(module, pattern):
            return layer
    raise AssertionError(f"{module} is in no layer of the contract")


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def imports_of(module: str, path: Path, known: set[str]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    typing_only = _type_checking_lines(tree)
    found: list[Import] = []
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else base)
        for target in targets:
            found.append(Import(module, target, node.lineno, node.lineno not in typing_only))
    return found


def all_imports() -> tuple[dict[str, Path], list[Import]]:
    files = source_files()
    known = set(files)
    edges = [imp for module, path in files.items() for imp in imports_of(module, path, known)]
    return files, edges


def _internal(target: str, known: set[str]) -> str | None:
    """The project module an import names (a package counts as its __init__)."""
    name = target
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _runtime_package(module: str) -> str | None:
    return next((p for p in RUNTIME_PACKAGES if module == p or module.startswith(p + ".")), None)


def violations() -> list[str]:
    files, edges = all_imports()
    known = set(files)
    out: list[str] = []
    for imp in edges:
        where = f"{files[imp.source].relative_to(ROOT)}:{imp.line}"
        src_layer = layer_of(imp.source)
        if src_layer == DECISIONS and any(
            imp.target == lib or imp.target.startswith(lib + ".") for lib in IO_LIBRARIES
        ):
            out.append(f"{where}: pure decision module {imp.source} imports {imp.target} (I/O)")
        target = _internal(imp.target, known)
        if target is None or target == imp.source:
            continue
        dst_layer = layer_of(target)
        if dst_layer > src_layer:
            out.append(
                f"{where}: {imp.source} ({LAYER_NAMES[src_layer]}) imports {target} "
                f"({LAYER_NAMES[dst_layer]}), a higher layer"
            )
        src_rt, dst_rt = _runtime_package(imp.source), _runtime_package(target)
        if src_rt and dst_rt and src_rt != dst_rt:
            out.append(f"{where}: runtime {imp.source} imports another runtime's {target}")
        src_proc, dst_proc = _streams_process(imp.source), _streams_process(target)
        if src_proc and dst_proc and src_proc != dst_proc:
            out.append(
                f"{where}: {imp.source} (streams {src_proc}) imports {target} "
                f"(streams {dst_proc}), another process's"
            )
    return out


def _streams_process(module: str) -> str | None:
    return next((name for name, modules in STREAMS_PROCESSES.items() if module in modules), None)


def cycles() -> list[list[str]]:
    files, edges = all_imports()
    known = set(files)
    graph = nx.DiGraph()
    for imp in edges:
        target = _internal(imp.target, known)
        # `import a.b.c` also runs a and a.b, but package __init__ files here import nothing.
        if (
            imp.runtime
            and target
            and target != imp.source
            and not _is_package_of(target, imp.source)
        ):
            graph.add_edge(imp.source, target)
    return [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]


def _is_package_of(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_every_module_has_a_layer() -> None:
    for module in source_files():
        layer_of(module)


def test_imports_point_down_the_layers() -> None:
    assert violations() == []


def test_no_import_cycles() -> None:
    assert cycles() == []


def test_every_streams_process_module_exists() -> None:
    modules = set(source_files())
    for process in STREAMS_PROCESSES.values():
        assert set(process) <= modules


def test_the_checker_sees_a_bad_import(tmp_path: Path) -> None:
    """The contract bites: a kernel module importing a runtime, or a pure module importing a
    broker client, is reported (checked on synthetic sources through the same functions)."""
    bad = tmp_path / "bad.py"
    bad.write_text("import confluent_kafka\nfrom loraplane.workers import agent\n")
    known = {"loraplane.workers.agent", "loraplane.streams.planner"}
    found = imports_of("loraplane.streams.planner", bad, known)
    assert [i.target for i in found] == ["confluent_kafka", "loraplane.workers.agent"]
    assert layer_of("loraplane.kernel.config") < layer_of("loraplane.workers.agent")
    assert layer_of("loraplane.streams.planner") == DECISIONS
    assert layer_of("loraplane.streams.planner_agent") == RUNTIMES
    assert layer_of("loraplane.demo.flow") == APPLICATIONS


def test_one_import_name_in_the_package_config() -> None:
    """Every package setuptools installs is under `loraplane` (bench/ and tests/ stay out)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "loraplane" or p.startswith("loraplane.") for p in config["packages"])
    for package in config["packages"]:
        top = package.split(".")[1] if "." in package else "loraplane"
        folder = config["package-dir"].get(package) or config["package-dir"].get(
            f"loraplane.{top}", "loraplane"
        )
        assert (ROOT / folder).is_dir(), package
    packaged = {p for p in config["packages"]}
    on_disk = {m for m, path in source_files().items() if path.name == "__init__.py"}
    assert on_disk == packaged, on_disk ^ packaged


def test_the_readmes_what_runs_where_is_the_contract() -> None:
    """README's process table names exactly the runtime packages and the streams processes
    of the contract, so the two cannot drift."""
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| process | command | code | runs on |") :]
    lines = table.splitlines()[2:]
    rows = lines[: next((i for i, r in enumerate(lines) if not r.startswith("|")), len(lines))]
    named: dict[str, set[str]] = {}
    for row in rows:
        process, _, code, _ = (c.strip() for c in row.strip("|").split("|"))
        named[process] = set(re.findall(r"`(loraplane[\w.]*)`", code))
    streams = {name: set(modules) for name, modules in STREAMS_PROCESSES.items()}
    assert {n: m for n, m in named.items() if n in streams} == streams
    packages = set().union(*(m for n, m in named.items() if n not in streams))
    assert packages == set(RUNTIME_PACKAGES) - {"loraplane.streams"}
    assert set(named) - set(streams) and set(streams) <= set(named)
