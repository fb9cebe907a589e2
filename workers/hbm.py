"""How full the worker's GPU memory is, from NVML, for its heartbeat (``WorkerState.hbm_usage``,
which the planner's HBM watermark rules read: streams/planner.py rules 5 and 8).

Why its own module: NVML (``pynvml``, from the optional ``nvidia-ml-py``) is imported lazily
and only here, so a worker without a GPU or without the package reports ``None`` and never
fails; tests fake the module. Used / total of the whole device, as NVML sees it: that
includes what vLLM reserves up front for its KV cache (``--gpu-memory-utilization``), so
that setting must stay below the policy's ``hbm_low_watermark`` (docs/worker.md).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any

__all__ = ["HbmProbe"]

log = logging.getLogger(__name__)


class HbmProbe:
    """``usage()``: HBM used / total of the worker's GPU, or None. The device is the first of
    ``CUDA_VISIBLE_DEVICES`` (an index or a ``GPU-``/``MIG-`` UUID; else device 0), the one
    vLLM runs on. NVML that cannot start (no package, no driver, no GPU) turns the probe off
    for good, logged once; a failed read is None for that heartbeat only."""

    def __init__(self, device: str | None = None, nvml: ModuleType | None = None) -> None:
        self._device = (
            device
            if device is not None
            else os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        )
        self._nvml = nvml
        self._handle: Any = None
        self._off = False

    def usage(self) -> float | None:
        if self._off:
            return None
        if self._handle is None and not self._start():
            return None
        assert self._nvml is not None  # _start set it
        try:
            info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            used, total = int(info.used), int(info.total)
        except Exception as exc:  # pynvml.NVMLError: a reset or a lost device, for now
            log.warning("NVML memory read failed: %s", exc)
            return None
        return min(1.0, max(0.0, used / total)) if total > 0 else None

    def _start(self) -> bool:
        try:
            nvml = self._nvml or importlib.import_module("pynvml")
            nvml.nvmlInit()
            device = self._device
            if device.startswith(("GPU-", "MIG-")):
                self._handle = nvml.nvmlDeviceGetHandleByUUID(device)
            else:
                self._handle = nvml.nvmlDeviceGetHandleByIndex(
                    int(device) if device.isdigit() else 0
                )
        except ImportError:
            log.info("nvidia-ml-py is not installed: hbm_usage is not reported")
            self._off = True
            return False
        except Exception as exc:  # pynvml.NVMLError_*: no driver, no GPU, a bad device
            log.info("NVML unavailable (%s): hbm_usage is not reported", exc)
            self._off = True
            return False
        self._nvml = nvml
        return True
