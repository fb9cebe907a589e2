"""Every open of a file by its path in the product is one of a known few (source audit, AST:
no import runs).

``open``, ``Path.open``, ``read_text``, ``read_bytes``, ``json.load`` and ``yaml.safe_load``
on a path block for good on a FIFO without a writer and read a link to ``/dev/zero`` or a
huge file until memory runs out. A file an operator names or another process may replace
(a keyring, a PEM, a config, a manifest, a spool segment, a log) is therefore opened with
``kernel.local_files`` (``read_regular``: non-blocking, regular files only, read to a cap;
``open_regular`` for a file streamed or appended to). The calls below are the only others,
each on a path nobody but the package or the kernel controls; a new one fails this test
until it is either moved to ``local_files`` or listed here with why it is safe.

Writes are audited the same way: a file the product writes itself goes through
``kernel.atomic_file`` (whole or not at all, never through a planted link), or is listed in
``WRITES_ALLOWED`` with why.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from tests.unit.test_layers import FOLDERS, ROOT

_READS = {"read_text", "read_bytes"}
_LOADS = {("json", "load"), ("yaml", "safe_load"), ("yaml", "load"), ("yaml", "safe_load_all")}
_BY_NAME = {"upload_file", "download_file"}  # boto3 opens the path it is handed itself

PROC = "/proc/<pid>/..., the kernel's"
ALLOWED: dict[tuple[str, str], str] = {
    ("loraplane/demo/supervisor.py", "_stat"): PROC,
    ("loraplane/demo/system.py", "memory_available_bytes"): PROC,
    ("loraplane/metrics/migrations.py", "discover"): "the migrations the package ships",
    ("loraplane/metrics/queries.py", "load"): "a query the package ships, by its listed name",
    ("loraplane/router/server.py", "serve_router"): "ApiKeysFile.open reads with read_regular",
    ("workers/runner.py", "_serve_worker"): "ApiKeysFile.open reads with read_regular",
    ("loraplane/testing/fake_vllm.py", "_weights_digest"): "the test double's own files",
    ("loraplane/testing/fake_vllm.py", "_tensor_names"): "the test double's own files",
    ("loraplane/testing/fake_vllm.py", "FakeVllm.load"): "the test double's own files",
    ("loraplane/testing/fake_vllm.py", "main"): "the test double's own files",
    ("loraplane/vllm_plugin.py", "_map_package_dirs"): "the project's own pyproject.toml",
    ("schemas/export.py", "drift"): "the repository's exported schemas (a dev check)",
    ("workers/artifact_fetch.py", "ArtifactFetcher._download.attempt"): (
        "writes a download into the folder it made for it (mkdir exist_ok=False)"
    ),
    ("infra/helm_chart.py", "render"): "helm's standard output, not a file",
    ("infra/kafka.py", "Kafka.version"): PROC,
    ("infra/s3.py", "S3.version"): PROC,
    ("infra/processes.py", "_cmdline_contains"): PROC,
    ("infra/processes.py", "_alive"): PROC,
    ("infra/maven.py", "jars"): "the classpath file mvn wrote into the tool cache",
    ("infra/prometheus.py", "Prometheus.api"): "an HTTP reply, not a file",
    ("infra/systemd_units.py", "Unit.read"): "the unit files the repository ships",
    ("infra/systemd_units.py", "environment_file"): "the env example the repository ships",
    ("dashboards/web.py", "Dashboard.get"): "the page the package ships",
    ("dashboards/web.py", "Dashboard._static"): "a file the package ships, by its listed name",
}


def _kind(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Name) and func.id == "open":
        return "open"
    if not isinstance(func, ast.Attribute):
        return None
    receiver = func.value.id if isinstance(func.value, ast.Name) else None
    if func.attr in _READS or func.attr in _BY_NAME:
        return func.attr
    if func.attr == "open" and receiver != "os":
        return f"{receiver or '<expr>'}.open"
    if (receiver, func.attr) in _LOADS:
        return f"{receiver}.{func.attr}"
    return None


def _calls(
    kind_of: Callable[[ast.Call], str | None], skip: tuple[str, ...] = ()
) -> dict[tuple[str, str], list[str]]:
    """(file, enclosing qualified name) -> the calls made there that ``kind_of`` names."""
    found: dict[tuple[str, str], list[str]] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in skip:
                continue

            def visit(node: ast.AST, scope: str, rel: str = rel) -> None:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    scope = f"{scope}.{node.name}" if scope else node.name
                if isinstance(node, ast.Call) and (kind := kind_of(node)):
                    found.setdefault((rel, scope or "<module>"), []).append(
                        f"{kind} (line {node.lineno})"
                    )
                for child in ast.iter_child_nodes(node):
                    visit(child, scope)

            visit(ast.parse(path.read_text(), rel), "")
    return found


def _opens() -> dict[tuple[str, str], list[str]]:
    """(file, enclosing qualified name) -> the path-opening calls made there."""
    return _calls(_kind)


def test_every_open_of_a_path_is_bounded_or_listed() -> None:
    found = _opens()
    unlisted = {site: calls for site, calls in found.items() if site not in ALLOWED}
    assert not unlisted, (
        "read these with loraplane.kernel.local_files (read_regular / open_regular), or list "
        f"them in ALLOWED with why nobody else controls the path: {unlisted}"
    )
    assert not set(ALLOWED) - set(found), "ALLOWED names a place that opens no file any more"


# --- writes: the same audit for the files the product writes itself -------------------------

_WRITES = {"write_text", "write_bytes", "savefig"}
_WRITERS = ("loraplane/kernel/atomic_file.py", "loraplane/kernel/local_files.py")
"""The owners: ``write_atomic`` / ``write_new`` for a whole file, ``open_regular`` for one
streamed or appended to (a log, a spool segment)."""

OPERATOR = "the file the operator names on the command line, written where it points"
WRITES_ALLOWED: dict[tuple[str, str], str] = {
    ("loraplane/simulator/report.py", "write_json"): OPERATOR,
    ("loraplane/simulator/report.py", "plot"): OPERATOR,
    ("loraplane/simulator/capacity.py", "plot"): OPERATOR,
    ("schemas/export.py", "export"): "the repository's exported schemas (a dev command)",
    ("dashboards/grafana_export.py", "<module>"): "the repository's dashboard (a dev script)",
    ("loraplane/artifact/model_signing_bundle.py", "_private_file"): (
        "a new file (O_EXCL) in a TemporaryDirectory of its own"
    ),
    ("workers/vllm_resolver.py", "_copy_fd"): (
        "a new file (O_EXCL|O_NOFOLLOW) in the resolver's own 0700 snapshot folder"
    ),
}


def _write_kind(call: ast.Call) -> str | None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    if func.attr in _WRITES:
        return func.attr
    receiver = func.value.id if isinstance(func.value, ast.Name) else None
    if (receiver, func.attr) == ("os", "open") and "O_CREAT" in ast.unparse(call):
        return "os.open(O_CREAT)"
    return None


def _writes() -> dict[tuple[str, str], list[str]]:
    """(file, enclosing qualified name) -> the calls there that write a file by its path."""
    return _calls(_write_kind, _WRITERS)


def test_every_write_of_a_path_is_atomic_or_listed() -> None:
    """``write_text`` / ``write_bytes`` follow a link planted at the path and leave a torn
    file when the process dies mid-write, which the next start reads back (a ClickHouse
    users.xml, a host-tier record.json, a signing key). A file the product writes itself
    goes through ``kernel.atomic_file``; the calls listed are the only others."""
    found = _writes()
    unlisted = {site: calls for site, calls in found.items() if site not in WRITES_ALLOWED}
    assert not unlisted, (
        "write these with loraplane.kernel.atomic_file (write_atomic / write_new), or list "
        f"them in WRITES_ALLOWED with why a link or a torn file there does no harm: {unlisted}"
    )
    assert not set(WRITES_ALLOWED) - set(found), "WRITES_ALLOWED names a place that writes none"
