"""The systemd units of infra/systemd (docs/deploy.md) start real command lines: each
ExecStart, with the example environment files, parses with the CLI it starts; the worker
and its vLLM agree on port, slots, rank and model; ``systemd-analyze verify`` accepts the
units where it is installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from loraplane.infra.systemd_units import (
    INSTALL_ROOT,
    Unit,
    UnitError,
    command_words,
    environment_file,
    parse_cli,
    specifiers,
)

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "infra" / "systemd"
EXAMPLES = UNITS / "env"
COMMANDS = {  # unit -> the loraplane command it runs
    "loraplane-streams.service": "streams run",
    "loraplane-scoring@.service": "streams scoring",
    "loraplane-planner@.service": "streams planner",
    "loraplane-router.service": "router run",
    "loraplane-sink.service": "metrics sink",
    "loraplane-vllm@.service": "vllm serve",
    "loraplane-worker@.service": "worker run",
}
INSTANCE = {
    "loraplane-vllm@.service": "0",
    "loraplane-worker@.service": "0",
    "loraplane-scoring@.service": "1",
    "loraplane-planner@.service": "llama-3-1-8b-instruct",
}


def command_of(name: str) -> tuple[list[str], str, dict[str, object]]:
    unit = Unit.read(UNITS / name)
    instance = INSTANCE.get(name, "")
    files = {f: EXAMPLES / Path(f).name for f in unit.environment_files(instance)}
    words = unit.exec_start(files, instance, host="gpu-host-1")
    command, params = parse_cli(words[1:])
    return words, command, params


def test_every_unit_is_known_and_runs_the_venvs_loraplane() -> None:
    assert sorted(p.name for p in UNITS.glob("*.service")) == sorted(COMMANDS)
    for name in COMMANDS:
        assert command_of(name)[0][0] == f"{INSTALL_ROOT}/.venv/bin/loraplane", name


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_exec_start_parses_with_the_cli_it_starts(name: str) -> None:
    _words, command, _params = command_of(name)
    assert command == COMMANDS[name]


def test_the_worker_drives_its_own_vllm_and_writes_under_its_home() -> None:
    *_, worker = command_of("loraplane-worker@.service")
    *_, vllm = command_of("loraplane-vllm@.service")
    assert worker["vllm_url"] == f"http://127.0.0.1:{vllm['port']}"
    assert (worker["gpu_slots"], worker["max_lora_rank"], worker["model_dir"]) == (
        vllm["max_loras"],
        vllm["max_lora_rank"],
        vllm["model_dir"],
    )
    unit = Unit.read(UNITS / "loraplane-worker@.service")
    home = environment_file(EXAMPLES / "loraplane.env")["LORAPLANE_HOME"]
    assert unit.service["ReadWritePaths"] == [home]  # everything it writes lives there
    assert Path(str(worker["host_tier_dir"])).is_relative_to(home)


def test_a_unit_with_an_option_the_cli_lacks_is_refused(tmp_path: Path) -> None:
    text = (
        (UNITS / "loraplane-sink.service").read_text().replace("--metrics-port", "--metrics-prot")
    )
    (tmp_path / "bad.service").write_text(text)
    unit = Unit.read(tmp_path / "bad.service")
    words = unit.exec_start({f: EXAMPLES / Path(f).name for f in unit.environment_files()})
    with pytest.raises(Exception, match="No such option"):
        parse_cli(words[1:])


def test_exec_lines_expand_as_systemd_does() -> None:
    env = {"A": "x y", "P": "18100"}
    assert command_words("run ${A} $A --url http://h:${P}/v1 'q w'", env) == [
        "run",
        "x y",
        "x",
        "y",
        "--url",
        "http://h:18100/v1",
        "q w",
    ]
    assert specifiers("w-%i@%H 100%%", "3", "host") == "w-3@host 100%"
    with pytest.raises(UnitError, match="NOPE"):
        command_words("run ${NOPE}", env)
    with pytest.raises(UnitError, match="template"):
        Unit.read(UNITS / "loraplane-worker@.service").exec_start({})


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    """On copies whose install root is this checkout (verify checks the binary exists)."""
    for unit in UNITS.glob("*.service"):
        text = (
            unit.read_text()
            .replace(INSTALL_ROOT, str(ROOT))
            .replace("/etc/loraplane/", f"{EXAMPLES}/")
        )
        (tmp_path / unit.name).write_text(text)
    names = [f"./{n.replace('@.', f'@{INSTANCE.get(n)}.')}" for n in COMMANDS]
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *names],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_example_config_is_valid_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """extra="forbid": a misspelt key of the example would fail here, not on a host."""
    from loraplane.kernel.config import Settings

    for name in [n for n in os.environ if n.startswith("LORAPLANE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LORAPLANE_CONFIG", str(EXAMPLES / "loraplane.yaml"))
    s = Settings()
    assert str(s.home) == environment_file(EXAMPLES / "loraplane.env")["LORAPLANE_HOME"]
    assert s.kafka.bootstrap.split(",")[0] == "kafka.internal:9092"
    assert s.policy.gpu_slots_per_base_model == 64


def test_the_vllm_unit_s_options_reach_vllm_s_command_line() -> None:
    """What the GPU unit sets (context length, memory share) is what vLLM is started with;
    left out, vLLM keeps its own default."""
    from loraplane.workers.vllm_process import VllmProcess

    *_, vllm = command_of("loraplane-vllm@.service")
    proc = VllmProcess(
        Path(str(vllm["model_dir"])),
        int(str(vllm["port"])),
        Path("log"),
        python=Path("py"),
        max_loras=int(str(vllm["max_loras"])),
        max_lora_rank=int(str(vllm["max_lora_rank"])),
        max_model_len=int(str(vllm["max_model_len"])),
        gpu_memory_utilization=float(str(vllm["gpu_memory_utilization"])),
    )
    line = " ".join(proc.command())
    assert "--host 127.0.0.1 --port 18000" in line
    assert "--max-loras 16" in line and "--max-lora-rank 64" in line
    assert "--max-model-len 8192" in line and "--gpu-memory-utilization 0.78" in line
    assert "--gpu-memory-utilization" not in " ".join(
        VllmProcess(Path("m"), 1, Path("log"), python=Path("py")).command()
    )


GPU_UNITS = {"loraplane-vllm@.service", "loraplane-worker@.service"}
SANDBOX = {  # every unit: what a reviewer of a systemd service expects, as one line each
    "User": "loraplane",
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateMounts": "yes",
    "UMask": "0077",
    "CapabilityBoundingSet": "",
    "AmbientCapabilities": "",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectHostname": "yes",
    "ProtectProc": "invisible",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "RemoveIPC": "yes",
    "SystemCallArchitectures": "native",
    "SystemCallErrorNumber": "EPERM",
}
CONTROL_PLANE = {  # the units that touch no device and run no compiled-at-run-time code
    "ProtectClock": "yes",
    "PrivateDevices": "yes",
    "PrivateUsers": "yes",
    "MemoryDenyWriteExecute": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_unit_runs_sandboxed(name: str) -> None:
    """The directives of SANDBOX in every unit; the control plane's units also lose the
    devices, other users, W+X memory and every address family but local and IP. The GPU
    units keep the GPU's device nodes (vLLM runs on it, its worker reads HBM through NVML);
    vLLM keeps W+X memory (torch and Triton compile kernels at run time), netlink (NCCL
    lists interfaces) and the system calls of the CUDA driver."""
    unit = Unit.read(UNITS / name)
    one = {key: values[-1] for key, values in unit.service.items()}
    for key, value in SANDBOX.items():
        assert one.get(key) == value, (name, key)
    assert unit.service["ReadWritePaths"] == ["/var/lib/loraplane"], name
    if name in GPU_UNITS:
        assert "PrivateDevices" not in one and "PrivateUsers" not in one, name
        # before systemd 252 ProtectClock adds DeviceAllow=char-rtc: an allow-list of devices
        # that leaves the GPU's nodes out
        assert "ProtectClock" not in one and "DeviceAllow" not in one, name
    else:
        for key, value in CONTROL_PLANE.items():
            assert one.get(key) == value, (name, key)
    if name == "loraplane-vllm@.service":
        assert "MemoryDenyWriteExecute" not in one
        assert unit.service["SystemCallFilter"][0].startswith("~@clock ")  # a deny list
    else:
        assert one["MemoryDenyWriteExecute"] == "yes", name
        assert unit.service["SystemCallFilter"] == ["@system-service", "~@privileged"], name
        assert "AF_NETLINK" not in one["RestrictAddressFamilies"], name


def _offline_security() -> bool:
    if shutil.which("systemd-analyze") is None:
        return False
    done = subprocess.run(
        ["systemd-analyze", "security", "--help"], capture_output=True, text=True, timeout=30
    )
    return "--offline" in done.stdout


@pytest.mark.skipif(not _offline_security(), reason="no systemd-analyze security --offline")
def test_systemd_analyze_security_rates_every_unit_ok(tmp_path: Path) -> None:
    """systemd's own exposure score (0 best, 10 worst; 'OK' is below 3.9 there): at most 1.2
    for the control plane, 2.5 for the GPU units (no ProtectClock there: before systemd 252
    it hides the GPU's device nodes), vLLM's included."""
    scores = {}
    for name in COMMANDS:
        copy = tmp_path / name.replace("@.", "@0.")
        copy.write_text((UNITS / name).read_text())
        done = subprocess.run(
            ["systemd-analyze", "security", "--offline=yes", "--no-pager", f"./{copy.name}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", done.stdout)
        assert found, done.stdout + done.stderr
        scores[name] = float(found.group(1))
    assert max(v for k, v in scores.items() if k not in GPU_UNITS) <= 1.2, scores
    assert max(scores[k] for k in GPU_UNITS) <= 2.5, scores


_MDWE_PROBE = r"""
import asyncio, ctypes, importlib, mmap, pkgutil, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:  # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN
    print("no-mdwe"); sys.exit(0)
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    sys.exit("W+X memory was mapped: the filter is off")
except OSError:
    pass
import loraplane
for name in ("kernel", "schemas", "frontdoor", "eventlog", "registry", "router", "workers",
             "streams", "metrics", "commands"):
    pkg = importlib.import_module(f"loraplane.{name}")
    for mod in pkgutil.walk_packages(pkg.__path__, f"loraplane.{name}."):
        importlib.import_module(mod.name)
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
key = Ed25519PrivateKey.generate()
key.public_key().verify(key.sign(b"m"), b"m")
from aiohttp import ClientSession, web
async def main():
    app = web.Application()
    app.router.add_get("/", lambda r: web.json_response({"ok": True}))
    runner = web.AppRunner(app); await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0); await site.start()
    port = site._server.sockets[0].getsockname()[1]
    async with ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as r:
        assert (await r.json()) == {"ok": True}
    await runner.cleanup()
asyncio.run(main())
print("ok")
"""


def test_the_runtimes_run_with_memory_never_writable_and_executable() -> None:
    """What MemoryDenyWriteExecute=yes of every unit but vLLM's allows: under the kernel's
    own W^X rule (prctl PR_SET_MDWE, the rule systemd's filter enforces), every runtime
    module imports, signatures verify and aiohttp serves and fetches over loopback."""
    done = subprocess.run(
        [sys.executable, "-c", _MDWE_PROBE], capture_output=True, text=True, timeout=240
    )
    if done.stdout.strip() == "no-mdwe":
        pytest.skip("the kernel has no PR_SET_MDWE (Linux 6.3+)")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def unit_settings(name: str, monkeypatch: pytest.MonkeyPatch) -> object:
    """The settings a unit's process reads: its EnvironmentFiles (the examples) and its
    Environment lines, the example loraplane.yaml."""
    from loraplane.kernel.config import Settings

    unit = Unit.read(UNITS / name)
    instance = INSTANCE.get(name, "")
    env: dict[str, str] = {}
    for path in unit.environment_files(instance):
        env |= environment_file(EXAMPLES / Path(path.lstrip("-")).name)
    env |= unit.environment(instance, "gpu-host-1")
    env["LORAPLANE_CONFIG"] = str(EXAMPLES / "loraplane.yaml")
    for key in [n for n in os.environ if n.startswith("LORAPLANE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith("LORAPLANE_"):
            monkeypatch.setenv(key, value)
    return Settings()


def test_vllm_makes_its_key_where_its_unit_may_write_and_its_worker_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`loraplane vllm serve` makes its API key file on first start: under
    ProtectSystem=strict that file must be under ReadWritePaths, and the worker of the same
    GPU must read the same file."""
    port = int(environment_file(EXAMPLES / "worker-0.env")["VLLM_PORT"])
    paths = {}
    for name in ("loraplane-vllm@.service", "loraplane-worker@.service"):
        settings: Any = unit_settings(name, monkeypatch)
        paths[name] = settings.vllm_api_key_path(port)
        writable = Unit.read(UNITS / name).service["ReadWritePaths"]
        assert any(paths[name].is_relative_to(w) for w in writable), (name, paths[name])
    assert len(set(paths.values())) == 1, paths


def visible(unit: Unit, path: Path) -> bool:
    """Whether the unit's processes see ``path``: not under its TemporaryFileSystem or
    InaccessiblePaths, or bound back with BindReadOnlyPaths."""

    def entries(key: str) -> list[Path]:
        words = [w for line in unit.service.get(key, []) for w in line.split()]
        return [Path(w.lstrip("-").split(":")[0]) for w in words]

    hidden = entries("TemporaryFileSystem") + entries("InaccessiblePaths")
    bound = entries("BindReadOnlyPaths") + entries("BindPaths")
    return any(path.is_relative_to(b) for b in bound) or not any(
        path.is_relative_to(h) for h in hidden
    )


def test_each_unit_sees_its_own_secrets_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit runs as the one `loraplane` user, so file modes cannot keep a router from
    the planner's signing key or the sink's ClickHouse password on a shared host; the mount
    namespace does: each unit's secret files (from the settings its process reads) are
    visible to it, every other secret file of the host is not. vLLM sees none but its key."""
    from loraplane.kernel.kafka import Principal

    port = int(environment_file(EXAMPLES / "worker-0.env")["VLLM_PORT"])
    s: Any = unit_settings("loraplane-worker@.service", monkeypatch)
    kafka = {p: s.kafka.credentials_dir / f"{p}.password" for p in Principal}
    needs = {
        "loraplane-router.service": {s.router_secret_path, kafka["router"]},
        "loraplane-streams.service": {kafka["streams"], s.planner_key_path},
        "loraplane-planner@.service": {kafka["streams"], s.planner_key_path},
        "loraplane-scoring@.service": {kafka["streams"]},
        "loraplane-sink.service": {
            kafka["metrics"],
            s.clickhouse.password_file(s.clickhouse.user),
        },
        "loraplane-worker@.service": {
            kafka["worker"],
            s.router_secret_path,
            s.s3.credentials_file,
            s.gateway_secret_path,
            s.vllm_api_key_path(port),
        },
        "loraplane-vllm@.service": {s.vllm_api_key_path(port)},
    }
    every = set().union(*needs.values()) | set(kafka.values())
    every.add(s.clickhouse.password_file(s.clickhouse.reader_user))
    assert sorted(needs) == sorted(COMMANDS)
    for name, own in needs.items():
        unit = Unit.read(UNITS / name)
        for path in sorted(every):
            assert visible(unit, path) == (path in own), (name, str(path))
