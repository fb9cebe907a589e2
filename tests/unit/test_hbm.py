"""The worker's HBM probe (workers/hbm.py) on a fake ``pynvml``: used / total of the device
vLLM runs on, and None, never an exception, without the package, a driver or a GPU."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from loraplane.workers.hbm import HbmProbe


class NVMLError(Exception):
    pass


def fake_nvml(used: int = 30, total: int = 100, *, init_fails: bool = False) -> Any:
    nvml: Any = ModuleType("pynvml")
    nvml.calls = []
    nvml.NVMLError = NVMLError
    nvml.broken = False

    def init() -> None:
        nvml.calls.append("init")
        if init_fails:
            raise NVMLError("Driver Not Loaded")

    def memory(handle: str) -> SimpleNamespace:
        nvml.calls.append(("memory", handle))
        if nvml.broken:
            raise NVMLError("GPU is lost")
        return SimpleNamespace(used=used, total=total, free=total - used)

    nvml.nvmlInit = init
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"index{i}"
    nvml.nvmlDeviceGetHandleByUUID = lambda u: f"uuid:{u}"
    nvml.nvmlDeviceGetMemoryInfo = memory
    return nvml


def test_usage_is_used_over_total_of_the_first_visible_device() -> None:
    nvml = fake_nvml(used=82, total=100)
    probe = HbmProbe("3", nvml)
    assert probe.usage() == pytest.approx(0.82)
    assert probe.usage() == pytest.approx(0.82)
    assert nvml.calls == ["init", ("memory", "index3"), ("memory", "index3")]  # init once
    uuid = fake_nvml()
    assert HbmProbe("GPU-5a1b", uuid).usage() == pytest.approx(0.3)
    assert uuid.calls[-1] == ("memory", "uuid:GPU-5a1b")
    default = fake_nvml()
    assert HbmProbe("", default).usage() == pytest.approx(0.3)
    assert default.calls[-1] == ("memory", "index0")


def test_the_device_comes_from_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    nvml = fake_nvml()
    HbmProbe(nvml=nvml).usage()
    assert nvml.calls[-1] == ("memory", "index2")


def test_no_driver_or_gpu_is_none_for_good() -> None:
    nvml = fake_nvml(init_fails=True)
    probe = HbmProbe("0", nvml)
    assert probe.usage() is None and probe.usage() is None
    assert nvml.calls == ["init"]  # not retried every heartbeat


def test_a_failed_read_is_none_that_time_only() -> None:
    nvml = fake_nvml(used=50, total=100)
    probe = HbmProbe("0", nvml)
    assert probe.usage() == pytest.approx(0.5)
    nvml.broken = True
    assert probe.usage() is None
    nvml.broken = False
    assert probe.usage() == pytest.approx(0.5)


def test_without_the_package_it_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    probe = HbmProbe("0")
    assert probe.usage() is None and probe.usage() is None


def test_a_zero_total_is_none_and_usage_stays_in_range() -> None:
    assert HbmProbe("0", fake_nvml(used=0, total=0)).usage() is None
    assert HbmProbe("0", fake_nvml(used=120, total=100)).usage() == 1.0
