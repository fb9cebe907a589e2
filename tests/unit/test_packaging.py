"""The wheel a platform team installs: its licence metadata and what it carries."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True)
    (built,) = out.glob("loraplane-*.whl")
    return zipfile.ZipFile(built)


def _metadata(wheel: zipfile.ZipFile) -> dict[str, list[str]]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = Parser().parsestr(wheel.read(name).decode())
    return {key: message.get_all(key) or [] for key in set(message.keys())}


def test_the_wheel_declares_apache_2_and_carries_its_licence_files(
        wheel: zipfile.ZipFile) -> None:
    meta = _metadata(wheel)
    assert meta["License-Expression"] == ["Apache-2.0"]
    assert sorted(meta["License-File"]) == ["LICENSE", "NOTICE"]
    names = wheel.namelist()
    licence = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    text = wheel.read(licence).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a stub
    assert (ROOT / "LICENSE").read_text() == text


def test_the_notice_names_every_shipped_file_under_another_licence(
        wheel: zipfile.ZipFile) -> None:
    """The Azure traces (CC BY 4.0) ship in the wheel: their attribution must travel too."""
    notice = next(n for n in wheel.namelist() if n.endswith(".dist-info/licenses/NOTICE"))
    text = wheel.read(notice).decode()
    traces = [n for n in wheel.namelist() if n.startswith("loraplane/demo/azure_traces/")
              and n.endswith(".csv")]
    assert traces
    for path in traces:
        assert path in text
    assert "CC BY 4.0" in text and "Splitwise" in text


def test_the_wheel_carries_no_tests_or_benchmarks(wheel: zipfile.ZipFile) -> None:
    tops = {n.split("/", 1)[0] for n in wheel.namelist()}
    assert tops == {"loraplane", next(t for t in tops if t.endswith(".dist-info"))}
