"""deploy/k8s as `kubectl apply -k` applies it: valid against the Kubernetes API schemas and
KEDA's, and held to the code (CLI commands, settings, endpoints, the queue KEDA reads), with
the operational rules: pinned image, probes, PDBs, securityContext, memory limits, Redis with a
password, maxmemory and a NetworkPolicy, one exporter of the farm-wide metrics, scale-out that
never stops a busy worker, resumable uploads across web replicas, no Secret in the apply.

Nothing here talks to a cluster: what ran is kustomize (kubectl's, offline) and the schemas."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
from aiohttp.test_utils import TestClient, TestServer

from encoder.routes import PUBLIC as STREAM_PUBLIC
from farm import keys, queue
from farm.metrics import FARM_FAMILIES, FarmCollector
from farm.models import TileTask
from farm.settings import Settings
from tests.deploy.consistency import (
    DEPLOY,
    check_env,
    check_farm_command,
    host_port,
    load_all,
)
from tests.deploy.kustomize import by_key, containers, kubectl_kustomize, render, resolve
from web import intake
from web.app import create_app
from web.routes import table

K8S = DEPLOY / "k8s"
KEDA_SCHEMA = Path(__file__).parent / "schemas" / "keda.json"
#: the oldest Kubernetes the manifests are for (pod-level appArmorProfile is 1.30's)
KUBERNETES_VERSION = "1.30"
#: the secret every farm pod takes its keys from, which the operator creates
SECRET = "tessera-secrets"
#: pods that run members' programs in farm/sandbox.py's bubblewrap sandboxes
SANDBOXED = {"render-worker", "render-burst", "stream"}
#: how long a worker's exit may take beyond its stop grace (a busy one took 2.8 s more; the
#: commit's upload may need the rest)
EXIT_MARGIN_S = 30
POD_IP = "10.0.0.7"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    (kustomization,) = load_all(K8S / "kustomization.yaml")
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    # every manifest in the folder is applied (examples/ is the operator's to adapt)
    assert listed == on_disk
    return render(K8S)


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _pods(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod templates by workload name: Deployments, StatefulSets and KEDA's ScaledJob."""
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out[d["metadata"]["name"]] = d["spec"]["template"]
        elif d["kind"] == "ScaledJob":
            out[d["metadata"]["name"]] = d["spec"]["jobTargetRef"]["template"]
    return out


def _example_secret() -> dict[str, str]:
    (secret,) = load_all(K8S / "examples" / "secret.yaml")
    assert secret["metadata"]["name"] == SECRET
    return dict(secret["stringData"])


def _container_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The environment the kubelet gives the container, secrets from the example Secret."""
    secret = _example_secret()
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert "secretRef" not in source, "a pod takes only the secret keys it needs"
        env.update(_one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        ref = var.get("valueFrom", {})
        if "secretKeyRef" in ref:
            assert ref["secretKeyRef"]["name"] == SECRET
            value = secret[ref["secretKeyRef"]["key"]]
        elif "fieldRef" in ref:
            assert ref["fieldRef"]["fieldPath"] == "status.podIP"
            value = POD_IP
        else:
            # $(VAR) expands from the variables defined before it
            value = re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], str(var["value"]))
        env[var["name"]] = value
    return env


def _farm(docs: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], Settings]:
    """The workload's farm container and the settings it runs with."""
    (container,) = _pods(docs)[name]["spec"]["containers"]
    # args, not command: the image's entry point (tini, the cgroup set-up) stays in front
    assert "command" not in container, f"{name}: `command` replaces the image's entry point"
    check_farm_command(name, container["args"])
    return container, check_env(name, _container_env(docs, container))


def _farm_pods(docs: list[dict[str, Any]]) -> list[str]:
    return [
        name
        for name, pod in _pods(docs).items()
        if pod["spec"]["containers"][0].get("args", [""])[0] == "farm"
    ]


def _port(container: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1 << 20, "k": 1e3 / (1 << 20),
             "M": 1e6 / (1 << 20), "G": 1e9 / (1 << 20), "": 1 / (1 << 20)}  # fmt: skip
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", quantity)
    assert m and m[2] in units, f"{quantity} is not a memory quantity"
    return float(m[1]) * units[m[2]]


# --- what applies -----------------------------------------------------------------------------


def test_every_object_is_valid_for_the_kubernetes_api(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")


def test_keda_objects_are_valid_for_keda_and_their_job_for_kubernetes(
    docs: list[dict[str, Any]],
) -> None:
    schema = json.loads(KEDA_SCHEMA.read_text())
    keda = [d for d in docs if d["apiVersion"].startswith("keda.sh/")]
    assert {d["kind"] for d in keda} == {"ScaledJob"}
    for doc in keda:
        validator = jsonschema.Draft202012Validator({**schema, "$ref": f"#/$defs/{doc['kind']}"})
        errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: {errors}"
    scaled = _one(docs, "ScaledJob", "render-burst")
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "render-burst"},
           "spec": scaled["spec"]["jobTargetRef"]}  # fmt: skip
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def test_the_resolver_renders_what_kustomize_renders() -> None:
    built = kubectl_kustomize(K8S)
    if built is None:
        pytest.skip("kubectl is not installed: the manifests were rendered by the resolver")
    assert by_key(resolve(K8S)) == by_key(built)


def test_the_secret_is_the_operators_and_the_example_names_every_key(
    docs: list[dict[str, Any]],
) -> None:
    # an applied Secret would overwrite the real one at every `kubectl apply -k`
    assert not [d for d in docs if d["kind"] == "Secret"]
    used = set()
    for pod in _pods(docs).values():
        for container in pod["spec"]["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    used.add(ref["key"])
    for auth in (d for d in docs if d["kind"] == "TriggerAuthentication"):
        used |= {ref["key"] for ref in auth["spec"]["secretTargetRef"]}
    assert used == set(_example_secret()), "examples/secret.yaml and the manifests differ"


def test_every_farm_container_runs_the_image_the_kustomization_names(
    docs: list[dict[str, Any]],
) -> None:
    (kustomization,) = load_all(K8S / "kustomization.yaml")
    (entry,) = [i for i in kustomization["images"] if i["name"] == "tessera"]
    image = f"{entry['newName']}:{entry['newTag']}"
    assert entry["newTag"] != "latest"
    for name in _farm_pods(docs):
        (container,) = _pods(docs)[name]["spec"]["containers"]
        assert container["image"] == image, f"{name} runs {container['image']}"
    for doc in docs:
        for container in containers(doc):
            assert ":" in container["image"] and not container["image"].endswith(":latest")


# --- the farm's processes ---------------------------------------------------------------------


def test_every_workload_runs_a_cli_command_with_valid_settings(docs: list[dict[str, Any]]) -> None:
    assert set(_farm_pods(docs)) == {"web", "farm-metrics", "render-worker", "render-burst",
                                     "stream"}  # fmt: skip
    for name in _farm_pods(docs):
        _container, settings = _farm(docs, name)
        assert host_port(settings.redis_url) == ("redis.tessera.svc.cluster.local", 6379)


def test_render_workers_and_stream_services_each_request_one_gpu(
    docs: list[dict[str, Any]],
) -> None:
    for name in ("render-worker", "render-burst", "stream"):
        container, settings = _farm(docs, name)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert settings.device == "gpu" and settings.gpu_index == 0
    for name in ("web", "farm-metrics"):
        container, _settings = _farm(docs, name)
        assert "nvidia.com/gpu" not in container["resources"]["limits"]


def test_a_stopping_worker_has_time_to_hand_its_tile_back(docs: list[dict[str, Any]]) -> None:
    for name in ("render-worker", "render-burst"):
        _container, settings = _farm(docs, name)
        grace = _pods(docs)[name]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= settings.stop_grace_s + EXIT_MARGIN_S, f"{name}: {grace} s"


def test_probes_ask_endpoints_the_services_serve_without_a_token(
    docs: list[dict[str, Any]], redis_url: str, tmp_path: Path
) -> None:
    public = {r.path for r in table() if r.method == "GET" and r.public}
    for name in ("web", "farm-metrics"):
        container, settings = _farm(docs, name)
        for probe_name in ("readinessProbe", "livenessProbe"):
            get = container[probe_name]["httpGet"]
            assert get["path"] in public and _port(container, get["port"]) == settings.web_port
    # the web really answers it, with no token and whatever else it needs
    path = _farm(docs, "web")[0]["readinessProbe"]["httpGet"]["path"]

    async def probe() -> int:
        settings = Settings().with_(redis_url=redis_url, storage_dir=tmp_path, work_dir=tmp_path)
        async with TestClient(TestServer(create_app(settings))) as client:
            return (await client.get(path)).status

    assert asyncio.run(probe()) == 200
    stream, settings = _farm(docs, "stream")
    for probe_name in ("readinessProbe", "livenessProbe"):
        get = stream[probe_name]["httpGet"]
        assert get["path"] in STREAM_PUBLIC and _port(stream, get["port"]) == settings.stream_port
    for name in ("render-worker", "render-burst"):
        worker, settings = _farm(docs, name)
        get = worker["readinessProbe"]["httpGet"]
        assert get["path"] == "/metrics" and _port(worker, get["port"]) == settings.metrics_port
        assert settings.metrics_host == "0.0.0.0"
    _c, stream_settings = _farm(docs, "stream")
    assert host_port(stream_settings.stream_url) == (POD_IP, stream_settings.stream_port)


def test_the_farm_wide_metrics_come_from_one_pod(docs: list[dict[str, Any]]) -> None:
    exporters = []
    for name in ("web", "farm-metrics"):
        container, settings = _farm(docs, name)
        annotations = _pods(docs)[name]["metadata"]["annotations"]
        # the scrape port is the token-free one the web serves /metrics on
        assert int(annotations["prometheus.io/port"]) == settings.web_metrics_port
        assert _port(container, "metrics") == settings.web_metrics_port
        if settings.web_farm_metrics == "on":
            exporters.append(name)
    assert exporters == ["farm-metrics"]
    assert _one(docs, "Deployment", "farm-metrics")["spec"]["replicas"] == 1
    for name in ("render-worker", "render-burst"):
        _container, settings = _farm(docs, name)
        port = _pods(docs)[name]["metadata"]["annotations"]["prometheus.io/port"]
        assert int(port) == settings.metrics_port


def test_resumable_uploads_share_one_volume_across_web_replicas(
    docs: list[dict[str, Any]], tmp_path: Path
) -> None:
    container, settings = _farm(docs, "web")
    assert _one(docs, "Deployment", "web")["spec"]["replicas"] > 1
    # where the web keeps upload chunks and scratch files, read off the code
    folder = intake.scratch_dir(tmp_path).parent.relative_to(tmp_path)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == str(
        settings.work_dir / folder))  # fmt: skip
    volumes = {v["name"]: v for v in _pods(docs)["web"]["spec"]["volumes"]}
    claim = volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert "ReadWriteMany" in _one(docs, "PersistentVolumeClaim", claim)["spec"]["accessModes"]


# --- running safely ---------------------------------------------------------------------------


def test_every_container_is_locked_down_as_far_as_its_work_allows(
    docs: list[dict[str, Any]],
) -> None:
    for name, pod in _pods(docs).items():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False, f"{name}: needs no API token"
        (container,) = spec["containers"]
        ctx = container["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True, name
        if name in SANDBOXED:
            # bubblewrap mounts and unshares as root, then drops members' programs to
            # FARM_SANDBOX_UID with no capabilities (farm/sandbox.py)
            assert ctx["runAsUser"] == 0, name
            assert ctx["capabilities"]["add"] == ["SYS_ADMIN", "NET_ADMIN"], name
            assert spec["securityContext"]["seccompProfile"]["type"] == "Unconfined"
            assert spec["securityContext"]["appArmorProfile"]["type"] == "Unconfined"
            _container, settings = _farm(docs, name)
            assert settings.sandbox != "none", f"{name} turns the sandbox off"
        else:
            assert spec["securityContext"]["runAsNonRoot"] is True, name
            assert spec["securityContext"]["runAsUser"] != 0, name
            assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["capabilities"] == {"drop": ["ALL"]}, name
        if name in _farm_pods(docs):
            # a read-only root: what the process writes is on volumes
            _container, settings = _farm(docs, name)
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert {"/tmp", str(settings.work_dir)} <= mounts, name


def test_every_container_requests_and_is_limited_in_memory(docs: list[dict[str, Any]]) -> None:
    for name, pod in _pods(docs).items():
        for container in pod["spec"]["containers"]:
            res = container["resources"]
            request, limit = _mib(res["requests"]["memory"]), _mib(res["limits"]["memory"])
            assert 0 < request <= limit, f"{name}: memory {request} MiB of {limit} MiB"


def test_disruption_budgets_cover_the_web_the_streams_and_redis(
    docs: list[dict[str, Any]],
) -> None:
    budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    covered = set()
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        for pdb in budgets:
            if pdb["spec"]["selector"]["matchLabels"].items() <= labels.items():
                covered.add(workload["metadata"]["name"])
                if "minAvailable" in pdb["spec"] and workload["spec"]["replicas"] > 1:
                    assert pdb["spec"]["minAvailable"] < workload["spec"]["replicas"]
    assert {"web", "stream", "redis"} <= covered


def test_every_service_selects_pods_and_targets_a_named_port(docs: list[dict[str, Any]]) -> None:
    templates = list(_pods(docs).values())
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        pods = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        names = {p["name"] for pod in pods for c in pod["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"{service['metadata']['name']}: {port}"
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        assert workload["spec"]["selector"]["matchLabels"].items() <= (
            workload["spec"]["template"]["metadata"]["labels"].items()
        )


# --- Redis ------------------------------------------------------------------------------------


def test_redis_has_a_password_a_memory_cap_an_append_only_file_and_never_evicts(
    docs: list[dict[str, Any]],
) -> None:
    (container,) = _pods(docs)["redis"]["spec"]["containers"]
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert args[0] == "redis-server"
    assert flags["--appendonly"] == "yes" and flags["--maxmemory-policy"] == "noeviction"
    # noeviction means nothing without a cap; the cap leaves room for an AOF rewrite's fork
    maxmemory = _mib(flags["--maxmemory"].upper().replace("B", "i"))
    assert 0 < maxmemory <= 0.8 * _mib(container["resources"]["limits"]["memory"])
    password = _container_env(docs, container)
    assert (
        re.sub(r"\$\((\w+)\)", lambda m: password[m[1]], flags["--requirepass"])
        == (_example_secret()["REDIS_PASSWORD"])
    )
    assert container["volumeMounts"][0]["mountPath"] == "/data"
    for name in _farm_pods(docs):
        _c, settings = _farm(docs, name)
        assert urlsplit(settings.redis_url).password == _example_secret()["REDIS_PASSWORD"]


def test_only_farm_pods_reach_redis(docs: list[dict[str, Any]]) -> None:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    redis_labels = _pods(docs)["redis"]["metadata"]["labels"]
    selects = [p["spec"]["podSelector"]["matchLabels"].items() for p in policies]
    (policy,) = [p for p, s in zip(policies, selects, strict=True) if s <= redis_labels.items()]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "only pods of this namespace"
    clients = peer["podSelector"]["matchLabels"]
    allowed = {name for name, pod in _pods(docs).items()
               if clients.items() <= pod["metadata"]["labels"].items()}  # fmt: skip
    # exactly the pods that hold FARM_REDIS_URL: the farm's, none other
    assert allowed == set(_farm_pods(docs))


# --- KEDA ---------------------------------------------------------------------------------------

#: the PromQL KEDA may ask: the sum of one gauge's series for one queue label
_QUERY = re.compile(r'sum\((\w+)\{queue="([\w-]+)"\}\)')


def test_keda_starts_burst_workers_that_finish_what_they_take(docs: list[dict[str, Any]]) -> None:
    scaled = _one(docs, "ScaledJob", "render-burst")
    container, _settings = _farm(docs, "render-burst")
    # a burst worker quits when the queue is empty: nothing stops it in the middle of a tile
    assert container["args"] == ["farm", "worker", "--burst"]
    assert scaled["spec"]["jobTargetRef"]["template"]["spec"]["restartPolicy"] == "Never"
    assert scaled["spec"]["rollout"]["strategy"] == "gradual"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and int(trigger["metadata"]["threshold"]) >= 1
    m = _QUERY.fullmatch(trigger["metadata"]["query"])
    assert m, trigger["metadata"]["query"]
    # the farm-wide gauge of the GPU class, which only the scraped farm-metrics pod exports
    assert m[1] == "tessera_queue_depth" and m[1] in FARM_FAMILIES
    assert m[2] == keys.render_queue("gpu")
    # the steady workers and the burst ones are the same pod but for the command
    steady = _pods(docs)["render-worker"]["spec"]
    burst = dict(scaled["spec"]["jobTargetRef"]["template"]["spec"])
    burst.pop("restartPolicy")
    burst["containers"] = [{**container, "args": ["farm", "worker"]}]
    assert burst == steady


def test_the_gauge_keda_reads_counts_every_waiting_tile_of_every_priority(
    docs: list[dict[str, Any]], redis_url: str
) -> None:
    trigger = _one(docs, "ScaledJob", "render-burst")["spec"]["triggers"][0]
    m = _QUERY.fullmatch(trigger["metadata"]["query"])
    assert m
    conn = queue.connect(redis_url)
    try:
        gpu = queue.RenderQueue(conn, "gpu")
        for priority, job in ((0, "a"), (5, "b"), (-2, "c")):
            tiles = [TileTask(job, 1, i, 1) for i in range(3)]
            gpu.stage_tiles(tiles, 60, priority=priority)
        queue.RenderQueue(conn, "cpu").stage_tiles([TileTask("d", 1, 0, 1)], 60, priority=0)
        collector = FarmCollector(Settings().with_(redis_url=redis_url))
        try:
            samples = {
                (s.name, s.labels.get("queue")): s.value
                for family in collector.collect()
                for s in family.samples
            }
        finally:
            collector.conn.close()
            collector.rq_conn.close()
        # nine tiles wait (wakes for blocked workers are not tiles, and none is blocked)
        assert samples[(m[1], m[2])] == 9 == gpu.depth()
    finally:
        conn.close()
