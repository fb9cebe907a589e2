"""Headless Chromium as the dashboard tests run it: one path and one set of flags (no
sandbox, GPU, network chatter or first-run work), installed by scripts/setup.d/30-chromium.sh."""

from __future__ import annotations

from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")


def chromium_argv(profile: Path, *args: str) -> list[str]:
    """The command line: ``profile`` as its user-data folder, then ``args``."""
    return [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        *args,
    ]


def require_chromium() -> None:
    if not CHROMIUM.exists():
        pytest.skip("chromium missing: bash scripts/setup.d/30-chromium.sh")
