"""The Helm chart of ``infra/helm/loraplane`` (docs/deploy.md, "On Kubernetes"), rendered by
a real Helm and read back: each container's command line worked out as the kubelet would
(``$(VAR)`` from the container's environment, the downward API's fields filled in for one
example pod), so the chart is checked against the CLI it starts (tests/unit) and can be
looked at by hand:

    python -m loraplane.infra.helm_chart commands [-f values-production.yaml]

Helm itself is built from its Go module at set-up (scripts/setup.d/60-helm.sh runs
``python -m loraplane.infra.helm_chart install``) into the stack's cache folder.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CHART",
    "EXAMPLE_POD_IP",
    "HELM_MODULE",
    "HELM_VERSION",
    "NAMESPACE",
    "RELEASE",
    "WORKLOADS",
    "ChartError",
    "Container",
    "container_env",
    "container_words",
    "containers",
    "expand",
    "helm",
    "helm_path",
    "install",
    "main",
    "ordinals",
    "pod_fields",
    "render",
]

CHART = Path(__file__).resolve().parent / "helm" / "loraplane"
HELM_MODULE = "helm.sh/helm/v4/cmd/helm"
HELM_VERSION = "v4.3.2"
RELEASE = "loraplane"
NAMESPACE = "loraplane"
EXAMPLE_POD_IP = "10.244.1.17"
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
WORKLOADS = ("Deployment", "StatefulSet")


class ChartError(RuntimeError):
    """Helm failed (its output says why), or a manifest the kubelet would not run as is."""


def helm_path(home: Path) -> Path:
    """Where set-up builds Helm: the stack's cache folder, one folder per version."""
    return home / "cache" / f"helm-{HELM_VERSION}" / "helm"


def install(home: Path) -> Path:
    """Build Helm ``HELM_VERSION`` with ``go install`` into ``helm_path(home)``; nothing to
    do when it is there. ChartError when Go is missing or the build fails."""
    target = helm_path(home)
    if target.is_file():
        return target
    go = shutil.which("go")
    if go is None:
        raise ChartError("no Go toolchain on PATH: Helm is built from its Go module")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        done = subprocess.run(
            [go, "install", f"{HELM_MODULE}@{HELM_VERSION}"],
            env={**os.environ, "GOBIN": tmp},
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise ChartError(
                f"go install {HELM_MODULE}@{HELM_VERSION} failed:\n{done.stdout}{done.stderr}"
            )
        os.replace(Path(tmp) / "helm", target)  # whole or not at all
    return target


def helm(binary: Path, *args: str) -> str:
    """Run Helm (no repositories, no cluster: its home in a throwaway folder); its stdout."""
    with tempfile.TemporaryDirectory() as home:
        env = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": home,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
        }
        done = subprocess.run(
            [str(binary), *args], env=env, capture_output=True, text=True, timeout=120, check=False
        )
    if done.returncode != 0:
        raise ChartError(f"helm {' '.join(args)}:\n{done.stdout}{done.stderr}")
    return done.stdout


def render(
    binary: Path, values: Sequence[Path] = (), sets: Sequence[str] = (), chart: Path = CHART
) -> list[dict[str, Any]]:
    """``helm template`` of the chart as release ``RELEASE`` in ``NAMESPACE``: its
    manifests."""
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE]
    for path in values:
        args += ["--values", str(path)]
    for item in sets:
        args += ["--set", item]
    return [doc for doc in yaml.safe_load_all(helm(binary, *args)) if doc]


@dataclass(frozen=True)
class Container:
    workload: dict[str, Any]
    pod: dict[str, Any]  # the pod template's spec
    spec: dict[str, Any]
    init: bool

    @property
    def name(self) -> str:
        return f"{self.workload['metadata']['name']}/{self.spec['name']}"

    def command(self, ordinal: int | None = None) -> list[str]:
        """Its command line as the kubelet runs it in the example pod ``ordinal`` (a
        StatefulSet's first when None)."""
        return container_words(self.spec, pod_fields(self.workload, ordinal))


def containers(manifests: Sequence[Mapping[str, Any]]) -> Iterator[Container]:
    """Every container and init container of every workload."""
    for doc in manifests:
        if doc["kind"] not in WORKLOADS:
            continue
        pod = doc["spec"]["template"]["spec"]
        for key, init in (("initContainers", True), ("containers", False)):
            for spec in pod.get(key, []):
                yield Container(dict(doc), pod, spec, init)


def ordinals(workload: Mapping[str, Any]) -> range:
    """A StatefulSet's pod ordinals (``spec.ordinals.start`` on); a Deployment has none."""
    spec = workload["spec"]
    start = int(spec.get("ordinals", {}).get("start", 0))
    return range(start, start + int(spec.get("replicas", 1)))


def pod_fields(workload: Mapping[str, Any], ordinal: int | None = None) -> dict[str, str]:
    """The downward API's values in one example pod of ``workload``, by field path."""
    meta, spec = workload["metadata"], workload["spec"]
    labels = dict(spec["template"]["metadata"].get("labels", {}))
    if workload["kind"] == "StatefulSet":
        index = ordinals(workload).start if ordinal is None else ordinal
        name = f"{meta['name']}-{index}"
        labels["apps.kubernetes.io/pod-index"] = str(index)
    else:
        name = f"{meta['name']}-7c9f5b8d4-x2x4z"
    fields = {
        "metadata.name": name,
        "metadata.namespace": NAMESPACE,
        "status.podIP": EXAMPLE_POD_IP,
        "spec.nodeName": "node-1",
    }
    fields |= {f"metadata.labels['{k}']": str(v) for k, v in labels.items()}
    return fields


def container_env(spec: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, str]:
    """The container's ``env``, in order (a value may name an earlier one); a Secret's or a
    ConfigMap's value reads as ``<secret NAME/KEY>``."""
    env: dict[str, str] = {}
    for item in spec.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
            continue
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            if path not in fields:
                raise ChartError(f"{item['name']}: the pod has no field {path}")
            env[item["name"]] = fields[path]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[item["name"]] = f"<secret {ref['name']}/{ref['key']}>"
        else:
            raise ChartError(f"{item['name']}: unsupported valueFrom {sorted(source)}")
    return env


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion (``$$`` is one ``$``); a reference to a variable
    the container lacks is an error here (the kubelet would pass it on literally)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        if name not in env:
            raise ChartError(f"$({name}) names no variable of the container")
        return env[name]

    return _REFERENCE.sub(one, text)


def container_words(spec: Mapping[str, Any], fields: Mapping[str, str]) -> list[str]:
    """``command`` + ``args``, each word expanded (no shell: a word stays one word)."""
    env = container_env(spec, fields)
    return [expand(str(w), env) for w in [*spec.get("command", []), *spec.get("args", [])]]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="action", required=True)
    sub.add_parser("install", help=f"build Helm {HELM_VERSION} into the cache (idempotent)")
    show = sub.add_parser("commands", help="each container's command line, one pod each")
    show.add_argument("-f", "--values", type=Path, action="append", default=[])
    show.add_argument("--set", action="append", default=[])
    ns = ap.parse_args(argv)
    from loraplane.kernel.config import get_settings

    home = get_settings().home
    if ns.action == "install":
        print(f"helm {HELM_VERSION} at {install(home)}")
        return 0
    binary = helm_path(home)
    if not binary.is_file():
        ap.error(f"no helm at {binary}: run `python -m loraplane.infra.helm_chart install`")
    for container in containers(render(binary, ns.values, ns.set)):
        print(f"# {container.name}{' (init)' if container.init else ''}")
        print(shlex.join(container.command()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
