"""Attack tests: a file an operator names on the command line or in the environment (a PEM,
an events file, a registry state, the settings file, a scenario, a trace, a model's
config.json, a folder of secrets) that is a FIFO without a writer, a link to an endless
device or a huge sparse file is refused with one line naming it, never a hang or a read
until memory runs out (``kernel.local_files``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from loraplane.cli import app

Plant = Callable[[Path], None]


def _huge(path: Path) -> None:
    with path.open("wb") as fh:
        fh.truncate(16 * 1024**3)  # sparse: no disk, but a plain read would want 16 GiB


HOSTILE: dict[str, Plant] = {
    "fifo": lambda p: os.mkfifo(p),
    "endless-device": lambda p: p.symlink_to("/dev/zero"),
    "huge": _huge,
}
KINDS = sorted(HOSTILE)


def _planted(tmp_path: Path, kind: str, name: str = "planted") -> Path:
    path = tmp_path / name
    HOSTILE[kind](path)
    return path


def _keyring(tmp_path: Path) -> Path:
    from loraplane.schemas.keyring import Keyring, save_keyring

    path = tmp_path / "keyring.yaml"
    save_keyring(Keyring(), path)
    return path


def _one_line_error(args: list[str], planted: Path) -> None:
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 1, done.output
    assert done.exception is None or isinstance(done.exception, SystemExit)
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(planted) in lines[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("option", ["--public-key", "--ca-certificates"])
@pytest.mark.parametrize("kind", KINDS)
def test_keys_model_signer_refuses_a_hostile_pem(tmp_path: Path, kind: str, option: str) -> None:
    planted = _planted(tmp_path, kind)
    args = ["keys", "model-signer", "--keyring", str(tmp_path / "k.yaml")]
    args += ["--signer-id", "s", "--tenant", "acme", option, str(planted)]
    if option == "--ca-certificates":
        args += ["--certificate-subject", "CN=s"]
    _one_line_error(args, planted)
    assert not (tmp_path / "k.yaml").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_lifecycle_verify_refuses_a_hostile_events_file(tmp_path: Path, kind: str) -> None:
    planted = _planted(tmp_path, kind)
    args = ["lifecycle", "verify", str(planted), "--keyring", str(_keyring(tmp_path))]
    _one_line_error(args, planted)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_lifecycle_verify_refuses_a_hostile_state(tmp_path: Path, kind: str) -> None:
    planted = _planted(tmp_path, kind)
    events = tmp_path / "events.jsonl"
    events.write_text("{}\n")
    args = ["lifecycle", "verify", str(events), "--keyring", str(_keyring(tmp_path))]
    _one_line_error([*args, "--state", str(planted)], planted)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_settings_file_is_a_settings_error(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplane.kernel.config import SettingsError, get_settings

    planted = _planted(tmp_path, kind)
    monkeypatch.setenv("LORAPLANE_CONFIG", str(planted))
    get_settings.cache_clear()
    try:
        with pytest.raises(SettingsError, match="planted"):
            get_settings()
    finally:
        get_settings.cache_clear()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_scenario_json_or_trace_is_refused(tmp_path: Path, kind: str) -> None:
    from loraplane.artifact.model_config import read_model_config
    from loraplane.kernel.local_files import read_json
    from loraplane.simulator.scenario import load_scenario
    from loraplane.simulator.trace import load_trace

    planted = _planted(tmp_path, kind)
    for read in (load_scenario, read_json, read_model_config):
        with pytest.raises(ValueError, match="planted"):
            read(planted)
    with pytest.raises((OSError, ValueError)):  # no regular file; a line of 16 GiB
        load_trace(planted)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["huge", "fifo"])
def test_a_hostile_file_among_secrets_to_install_is_a_secret_error(
    tmp_path: Path, kind: str
) -> None:
    from loraplane.kernel.secrets import SecretError, install_private

    source = tmp_path / "volume"
    source.mkdir()
    _planted(source, kind, "password")
    if kind == "fifo":  # skipped as no file before the read, and refused if it is one
        assert install_private(source, tmp_path / "out") == []
        return
    with pytest.raises(SecretError, match="password"):
        install_private(source, tmp_path / "out")


def _model_folder(tmp_path: Path, kind: str) -> Path:
    """A model folder whose config.json is hostile (``KINDS``), a list, or no Llama."""
    folder = tmp_path / "model"
    folder.mkdir()
    config = folder / "config.json"
    if kind == "list":
        config.write_text("[1, 2]")
    elif kind == "no-llama":
        config.write_text('{"num_hidden_layers": "many"}')
    else:
        HOSTILE[kind](config)
    return folder


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", [*KINDS, "list", "no-llama"])
def test_the_worker_refuses_a_hostile_model_config_naming_it(tmp_path: Path, kind: str) -> None:
    """The worker's host tier and vLLM's resolver read the model's config.json as the CLI
    does (``artifact.model_config``): one ValueError naming the file, never a hang, an
    OSError or an AttributeError from deep inside the shape code."""
    from loraplane.workers.runner import WorkerOptions, base_model_shape
    from loraplane.workers.vllm_resolver import HostTierResolver, ResolverConfig

    folder = _model_folder(tmp_path, kind)
    options = WorkerOptions(
        worker_id="w1",
        base_model="b",
        vllm_url="",
        gateway_port=0,
        metrics_port=None,
        host_tier_dir=tmp_path / "host",
        host_budget_bytes=1,
        model_dir=folder,
    )
    with pytest.raises(ValueError, match=r"config\.json"):
        base_model_shape(options.model_dir, None)
    if kind in ("fifo", "endless-device"):
        return  # no file: the resolver serves a hub model's name without a local config
    with pytest.raises(ValueError, match=r"config\.json"):
        HostTierResolver(ResolverConfig(tmp_path / "host", "b", str(folder), 8))
