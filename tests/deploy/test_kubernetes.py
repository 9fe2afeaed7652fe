"""deploy/k8s: the example manifests run real CLI commands with real settings, request GPUs
where they render or encode, wire Services to pods, and KEDA watches the queue the farm fills."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from rq import Queue

from farm import keys, queue
from farm.models import TileTask
from farm.settings import Settings
from tests.deploy.consistency import (
    DEPLOY,
    check_env,
    check_farm_command,
    host_port,
    load_all,
)

K8S = DEPLOY / "k8s"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    kustomization = load_all(K8S / "kustomization.yaml")[0]
    out: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        out += load_all(K8S / name)
    # every manifest in the folder is listed, so `kubectl apply -k` applies them all
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk
    return out


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _config(docs: list[dict[str, Any]]) -> dict[str, str]:
    config = dict(_one(docs, "ConfigMap", "tessera-config")["data"])
    config.update(_one(docs, "Secret", "tessera-secrets")["stringData"])
    return config


def _container_env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_one(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            env.update(_one(docs, "Secret", source["secretRef"]["name"])["stringData"])
    for var in container.get("env", []):
        env[var["name"]] = str(var.get("value", ""))
    pod_ip = "10.0.0.7"  # $(POD_IP) as the kubelet expands it
    return {k: v.replace("$(POD_IP)", pod_ip) for k, v in env.items()}


def _farm_container(docs: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], Settings]:
    workload = _one(docs, "Deployment", name)
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    check_farm_command(f"Deployment {name}", container["command"])
    return container, check_env(f"Deployment {name}", _container_env(docs, container))


def _port(container: dict[str, Any], name: str) -> int:
    return int(next(p["containerPort"] for p in container["ports"] if p["name"] == name))


def test_every_workload_runs_a_cli_command_with_valid_settings(docs: list[dict[str, Any]]) -> None:
    config = check_env("ConfigMap tessera-config", _config(docs))
    assert host_port(config.redis_url) == ("redis.tessera.svc.cluster.local", 6379)
    for name in ("web", "render-worker", "stream"):
        _farm_container(docs, name)


def test_render_workers_and_stream_services_each_request_one_gpu(
    docs: list[dict[str, Any]],
) -> None:
    for name in ("render-worker", "stream"):
        container, settings = _farm_container(docs, name)
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert settings.device == "gpu" and settings.gpu_index == 0
    worker = _one(docs, "Deployment", "render-worker")["spec"]["template"]["spec"]
    _container, settings = _farm_container(docs, "render-worker")
    assert worker["terminationGracePeriodSeconds"] > settings.stop_grace_s
    web, _ = _farm_container(docs, "web")
    assert "nvidia.com/gpu" not in web.get("resources", {}).get("limits", {})


def test_ports_probes_and_scrape_annotations_match_the_settings(
    docs: list[dict[str, Any]],
) -> None:
    expected = {"web": ("http", "web_port"), "render-worker": ("metrics", "metrics_port"),
                "stream": ("http", "stream_port")}  # fmt: skip
    for name, (port_name, attr) in expected.items():
        container, settings = _farm_container(docs, name)
        port = _port(container, port_name)
        assert port == getattr(settings, attr), f"{name}: port {port} but {attr} differs"
        assert container["readinessProbe"]["httpGet"]["port"] == port_name
        template = _one(docs, "Deployment", name)["spec"]["template"]
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    _c, stream = _farm_container(docs, "stream")
    assert host_port(stream.stream_url) == ("10.0.0.7", stream.stream_port)
    _c, worker = _farm_container(docs, "render-worker")
    assert worker.metrics_host == "0.0.0.0"


def test_every_service_selects_pods_and_targets_a_named_port(docs: list[dict[str, Any]]) -> None:
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for service in (d for d in docs if d["kind"] == "Service"):
        selector = service["spec"]["selector"]
        templates = [w["spec"]["template"] for w in workloads]
        pods = [t for t in templates if selector.items() <= t["metadata"]["labels"].items()]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        names = {p["name"] for pod in pods for c in pod["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"{service['metadata']['name']}: {port}"
    for workload in workloads:
        assert workload["spec"]["selector"]["matchLabels"].items() <= (
            workload["spec"]["template"]["metadata"]["labels"].items()
        )


def test_redis_keeps_an_append_only_file_and_never_evicts(docs: list[dict[str, Any]]) -> None:
    (container,) = _one(docs, "StatefulSet", "redis")["spec"]["template"]["spec"]["containers"]
    args = " ".join(container["args"])
    assert "--appendonly yes" in args and "--maxmemory-policy noeviction" in args
    assert container["volumeMounts"][0]["mountPath"] == "/data"


def test_keda_scales_the_render_workers_on_the_gpu_queue(docs: list[dict[str, Any]]) -> None:
    scaled = _one(docs, "ScaledObject", "render-worker")
    target = scaled["spec"]["scaleTargetRef"]
    assert target["kind"] == "Deployment"
    _one(docs, target["kind"], target["name"])
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis"
    meta = trigger["metadata"]
    # the list rq keeps the GPU render queue's waiting tasks in
    assert meta["listName"] == Queue(keys.render_queue("gpu"), connection=redis.Redis()).key
    config = check_env("config", _config(docs))
    assert meta["address"] == "{}:{}".format(*host_port(config.redis_url))
    assert int(meta["listLength"]) >= 1
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_list_keda_reads_holds_exactly_the_waiting_tiles(
    docs: list[dict[str, Any]], redis_url: str
) -> None:
    list_name = _one(docs, "ScaledObject", "render-worker")["spec"]["triggers"][0]["metadata"][
        "listName"
    ]
    conn = queue.connect(redis_url)
    try:
        q = queue.RenderQueue(conn, "gpu")
        q.stage_tiles([TileTask("job", 1, i, 1) for i in range(5)], 60)
        queue.RenderQueue(conn, "cpu").stage_tiles([TileTask("job", 1, 9, 1)], 60)
        assert conn.llen(list_name) == 5 == q.depth() == queue.depths(conn)["tessera-render-gpu"]
    finally:
        conn.close()
