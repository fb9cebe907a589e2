"""The systemd units of infra/systemd (docs/deploy.md) start real command lines: each
ExecStart, with the example environment files, parses with the CLI it starts; the worker
and its vLLM agree on port, slots, rank and model; ``systemd-analyze verify`` accepts the
units where it is installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

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
