"""The wheel a platform team installs: its licence metadata and what it carries."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from bench.install_size import build_wheel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(build_wheel(tmp_path_factory.mktemp("wheel")))


def _metadata(wheel: zipfile.ZipFile) -> dict[str, list[str]]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = Parser().parsestr(wheel.read(name).decode())
    return {key: message.get_all(key) or [] for key in set(message.keys())}


def test_the_wheel_declares_apache_2_and_carries_its_licence_files(wheel: zipfile.ZipFile) -> None:
    meta = _metadata(wheel)
    assert meta["License-Expression"] == ["Apache-2.0"]
    assert sorted(meta["License-File"]) == ["LICENSE", "NOTICE"]
    names = wheel.namelist()
    licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    text = wheel.read(licence).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub
    assert (ROOT / "LICENSE").read_text() == text


def test_the_notice_names_every_shipped_file_under_another_licence(wheel: zipfile.ZipFile) -> None:
    """The Azure traces (CC BY 4.0) ship in the wheel: their attribution must travel too."""
    notice = next(n for n in wheel.namelist() if n.endswith(".dist-info/licenses/NOTICE"))
    text = wheel.read(notice).decode()
    traces = [
        n
        for n in wheel.namelist()
        if n.startswith("loraplane/demo/azure_traces/") and n.endswith(".csv")
    ]
    assert traces
    for path in traces:
        assert path in text
    assert "CC BY 4.0" in text and "Splitwise" in text


def test_the_wheel_carries_no_tests_or_benchmarks(wheel: zipfile.ZipFile) -> None:
    tops = {n.split("/", 1)[0] for n in wheel.namelist()}
    assert tops == {"loraplane", next(t for t in tops if t.endswith(".dist-info"))}


SIM_LIBRARIES = ("scipy", "matplotlib", "networkx")
RUNTIMES = (
    "loraplane.cli",
    "loraplane.router.server",
    "loraplane.workers.runner",
    "loraplane.workers.gateway",
    "loraplane.streams.app",
    "loraplane.streams.planner_runtime",
    "loraplane.streams.score_keeper",
    "loraplane.metrics.sink",
    "loraplane.commands.demo",
    "loraplane.demo.flow",
)
BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        return None
sys.meta_path.insert(0, Block())
"""


def _without_sim(
    code: str, blocked: tuple[str, ...] = SIM_LIBRARIES, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a Python where the simulator's libraries (or ``blocked``) cannot be
    imported."""
    script = BLOCK.format(blocked=blocked) + code
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=env,
    )


def test_the_base_install_needs_no_simulator_library(wheel: zipfile.ZipFile) -> None:
    """scipy, matplotlib and networkx come only with [sim]; [dev] pulls [sim] in."""
    requires = _metadata(wheel)["Requires-Dist"]
    for name in SIM_LIBRARIES:
        lines = [r for r in requires if r.split("[")[0].split("<")[0].split(">")[0].strip() == name]
        assert lines and all('extra == "sim"' in r for r in lines), (name, lines)
    assert any(r.startswith("loraplane[sim]") and 'extra == "dev"' in r for r in requires)
    assert any(r.startswith("nvidia-ml-py") and 'extra == "gpu"' in r for r in requires)
    out = _without_sim(
        f"import importlib\nfor m in {RUNTIMES!r}:\n    importlib.import_module(m)\n"
    )
    assert out.returncode == 0, out.stderr


def test_a_command_that_needs_an_extra_names_it_and_exits_2() -> None:
    scenario = ROOT / "bench" / "scenarios" / "zipf-steady.yaml"
    out = _without_sim(
        "import sys\nfrom loraplane.cli import main\n"
        f"sys.argv = ['loraplane', 'simulate', '--scenario', {str(scenario)!r}]\n"
        "main()\n"
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "pip install 'loraplane[sim]'" in out.stderr
    assert "scipy, matplotlib, networkx not installed" in out.stderr


SIGNING_LIBRARIES = ("model_signing", "sigstore", "OpenSSL", "tuf")


def test_model_signing_is_the_signing_extra_and_no_runtime_imports_it(
    wheel: zipfile.ZipFile,
) -> None:
    """model-signing (and the pyOpenSSL it imports undeclared) come only with [signing];
    [dev] pulls it in for the tests; every runtime starts without them."""
    requires = _metadata(wheel)["Requires-Dist"]
    for name in ("model-signing", "pyopenssl"):
        lines = [r for r in requires if r.lower().startswith(name)]
        assert lines and all('extra == "signing"' in r for r in lines), (name, lines)
    assert any(r.startswith("loraplane[signing]") and 'extra == "dev"' in r for r in requires)
    out = _without_sim(
        f"import importlib\nfor m in {RUNTIMES!r}:\n    importlib.import_module(m)\n",
        blocked=SIGNING_LIBRARIES,
    )
    assert out.returncode == 0, out.stderr


def test_publishing_a_signed_folder_without_the_extra_names_it_and_exits_2(tmp_path: Path) -> None:
    from loraplane.schemas.keyring import Keyring, save_keyring
    from loraplane.schemas.signing import SigningKey
    from loraplane.tiny_model import TINY_BASE_MODEL, build_adapter
    from tests.model_signing_kit import ec_key, key_signer, sign_with_key

    folder = build_adapter(tmp_path / "adapter", seed=1)
    key = ec_key(tmp_path / "keys", "acme")
    sign_with_key(folder, key)
    home = tmp_path / "home"
    save_keyring(
        Keyring(model_signers=[key_signer("acme-models", ["acme"], key)]), home / "keyring.yaml"
    )
    SigningKey.generate("ci-acme", "ci-acme-1").save(tmp_path / "ci.key")
    out = _without_sim(
        "import sys\nfrom loraplane.cli import main\n"
        f"sys.argv = ['loraplane', 'publish', '--adapter-id', 'chat', '--tenant', 'acme', "
        f"'--base-model', {TINY_BASE_MODEL!r}, '--version', '1', '--artifact', "
        f"{str(folder)!r}, '--key', {str(tmp_path / 'ci.key')!r}]\nmain()\n",
        blocked=SIGNING_LIBRARIES,
        env={
            **os.environ,
            "LORAPLANE_HOME": str(home),
            "LORAPLANE_KEYRING_PATH": str(home / "keyring.yaml"),
        },
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert (
        "carries a model-signing bundle and the model-signing library is not installed: "
        "pip install 'loraplane[signing]'" in out.stderr
    )


def test_the_wheel_says_it_is_typed(wheel: zipfile.ZipFile) -> None:
    """PEP 561: type checkers use loraplane's inline annotations (schemas for producers)."""
    assert "loraplane/py.typed" in wheel.namelist()
