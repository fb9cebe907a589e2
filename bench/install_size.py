"""Installed size of each install profile: base, [sim], [gpu], [signing] and [dev], in fresh
venvs.

Builds the wheel once, installs it with each profile into its own virtualenv (pip and its
cache as configured, e.g. PIP_FIND_LINKS), and measures the bytes under site-packages
(pip, setuptools and wheel left out: every venv has them). In the base venv it also runs
``loraplane simulate`` to show the missing extra's answer (exit 2, the install line).
Prints one JSON object; writes nothing tracked.

    python -m bench.install_size [--profiles base,sim,gpu,signing,dev]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROFILES = {"base": "", "sim": "[sim]", "gpu": "[gpu]", "signing": "[signing]", "dev": "[dev]"}
TOOLING = ("pip", "setuptools", "wheel", "_distutils_hack", "pkg_resources")


def site_packages(venv: Path) -> Path:
    (found,) = venv.glob("lib/python*/site-packages")
    return found


def size_of(folder: Path) -> tuple[int, int]:
    """Bytes and top-level distributions under ``folder``, venv tooling left out."""
    total, dists = 0, 0
    for entry in folder.iterdir():
        name = entry.name.split("-")[0].lower()
        if name in TOOLING:
            continue
        dists += entry.name.endswith(".dist-info")
        total += (
            sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
            if entry.is_dir()
            else entry.stat().st_size
        )
    return total, dists


def install(work: Path, wheel: Path, profile: str) -> dict[str, Any]:
    venv = work / profile
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    started = time.monotonic()
    subprocess.run(
        [
            str(venv / "bin" / "pip"),
            "install",
            "-q",
            f"loraplane{PROFILES[profile]} @ {wheel.as_uri()}",
        ],
        check=True,
    )
    size, dists = size_of(site_packages(venv))
    return {
        "mb": round(size / 2**20, 1),
        "distributions": dists,
        "install_s": round(time.monotonic() - started, 1),
    }


def build_wheel(out: Path) -> Path:
    """The wheel of the working tree's files (tracked, or new and not ignored), built from a
    copy: setuptools' in-tree ``build/`` would keep modules deleted since the last build."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        .stdout.decode()
        .split("\0")
    )
    source = out / "source"
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "-w",
            str(out / "wheel"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = (out / "wheel").glob("loraplane-*.whl")
    return wheel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", default="base,sim,gpu,signing,dev")
    args = parser.parse_args(argv)
    names = [p for p in args.profiles.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="bench-install-") as tmp:
        work = Path(tmp)
        wheel = build_wheel(work)
        result: dict[str, Any] = {
            "benchmark": "install size per profile",
            "unit": "MiB",
            "command": "python -m bench.install_size "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "profiles": {},
        }
        for name in names:
            result["profiles"][name] = install(work, wheel, name)
            print(f"{name}: {result['profiles'][name]}", file=sys.stderr, flush=True)
        if "base" in names:
            scenario = ROOT / "bench" / "scenarios" / "zipf-steady.yaml"
            out = subprocess.run(
                [str(work / "base" / "bin" / "loraplane"), "simulate", "--scenario", str(scenario)],
                capture_output=True,
                text=True,
                env={**os.environ, "LORAPLANE_HOME": tmp},
            )
            result["base_simulate"] = {
                "exit_code": out.returncode,
                "stderr": out.stderr.strip()[-300:],
            }
        profiles = result["profiles"]
        for extra in ("sim", "signing"):
            if "base" in profiles and extra in profiles:
                result[f"{extra}_over_base"] = round(
                    profiles[extra]["mb"] / profiles["base"]["mb"], 2
                )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
