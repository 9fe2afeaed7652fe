"""docker-compose.yml: one `docker compose up` on a GPU host must give a working farm, so every
service runs a real CLI command with real settings, and the services agree on hosts, ports,
bucket and secrets."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from farm.cells import parse_cells as cells_of
from tests.deploy.consistency import (
    DEPLOY,
    REPO,
    check_env,
    check_farm_command,
    host_port,
    interpolate,
)

FARM_SERVICES = ("web", "worker", "stream")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return dict(compose["services"])


def _env(service: dict[str, Any]) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in service.get("environment", {}).items()}


def _healthcheck_port(service: dict[str, Any]) -> int:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)/", test)
    assert match, f"healthcheck {test!r} probes no local HTTP port"
    return int(match[1])


def test_every_farm_service_runs_a_cli_command_with_valid_settings(
    services: dict[str, dict[str, Any]],
) -> None:
    farm_services = [n for n, s in services.items() if s.get("image", "").startswith("tessera")]
    assert sorted(farm_services) == sorted(FARM_SERVICES)
    for name in FARM_SERVICES:
        service = services[name]
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (REPO / service["build"]["dockerfile"]).is_file()
        check_farm_command(f"compose service {name}", service["command"])
        check_env(f"compose service {name}", service["environment"])


def test_every_long_running_service_has_a_healthcheck_and_dependencies_exist(
    services: dict[str, dict[str, Any]], compose: dict[str, Any]
) -> None:
    for name, service in services.items():
        if service.get("restart") != "no":  # one-shot jobs (minio-init) end, they do not serve
            assert "healthcheck" in service, f"{name} has no healthcheck"
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown service {dep}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits on {dep}'s missing health"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"


def test_redis_keeps_an_append_only_file_and_never_evicts(
    services: dict[str, dict[str, Any]],
) -> None:
    command = " ".join(services["redis"]["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    for name in FARM_SERVICES:
        host, port = host_port(_env(services[name])["FARM_REDIS_URL"])
        assert (host, port) == ("redis", 6379), f"{name} looks for Redis at {host}:{port}"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_storage_is_the_minio_bucket_created_at_start(services: dict[str, dict[str, Any]]) -> None:
    init = " ".join(services["minio-init"]["command"])
    created = re.search(r"mc mb --ignore-existing local/([\w.-]+)", init)
    assert created, "minio-init creates no bucket"
    assert services["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    minio_env = _env(services["minio"])
    for name in ("web", "worker"):
        env = _env(services[name])
        assert env["FARM_STORAGE_URL"].startswith(f"s3://{created[1]}/")
        assert host_port(env["FARM_S3_ENDPOINT_URL"]) == ("minio", 9000)
        assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
        assert env["AWS_SECRET_ACCESS_KEY"] == minio_env["MINIO_ROOT_PASSWORD"]
        dep = services[name]["depends_on"]["minio-init"]
        assert dep["condition"] == "service_completed_successfully"
    # the stream service stores nothing; the web and the worker share one store
    assert _env(services["web"])["FARM_STORAGE_URL"] == _env(services["worker"])["FARM_STORAGE_URL"]


def test_ports_hosts_and_healthchecks_agree_with_each_services_settings(
    services: dict[str, dict[str, Any]],
) -> None:
    web = check_env("web", _env(services["web"]))
    assert web.web_host == "0.0.0.0"  # reachable through the published port
    # the host port defaults to the web's own (WEB_PORT moves it: the stack test picks a free one)
    ports = [interpolate(p) for p in services["web"]["ports"]]
    assert f"{web.web_port}:{web.web_port}" in ports
    assert _healthcheck_port(services["web"]) == web.web_port

    worker = check_env("worker", _env(services["worker"]))
    assert worker.metrics_port > 0 and worker.metrics_host == "0.0.0.0"
    assert _healthcheck_port(services["worker"]) == worker.metrics_port
    assert worker.device == "gpu" and worker.nvml == "real"

    stream = check_env("stream", _env(services["stream"]))
    assert stream.stream_host == "0.0.0.0"
    assert _healthcheck_port(services["stream"]) == stream.stream_port
    assert host_port(stream.stream_url) == ("stream", stream.stream_port)


def test_the_worker_and_the_stream_service_reserve_the_gpu(
    services: dict[str, dict[str, Any]],
) -> None:
    for name in ("worker", "stream"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    # a worker on SIGTERM hands its tile back within FARM_STOP_GRACE_S; compose waits longer
    grace_s = int(services["worker"]["stop_grace_period"].removesuffix("s"))
    assert grace_s > check_env("worker", _env(services["worker"])).stop_grace_s


def test_turn_credentials_and_port_match_coturn(services: dict[str, dict[str, Any]]) -> None:
    coturn = [interpolate(a) for a in services["coturn"]["command"]]
    secret = next(a.split("=", 1)[1] for a in coturn if a.startswith("--static-auth-secret="))
    port = next(a.split("=", 1)[1] for a in coturn if a.startswith("--listening-port="))
    assert "--use-auth-secret" in coturn
    stream = check_env("stream", _env(services["stream"]))
    assert stream.turn_secret == secret
    for url in stream.turn_urls.split(","):
        assert re.fullmatch(rf"turn:[\w.-]+:{port}(\?transport=(udp|tcp))?", url), url


def test_prometheus_scrapes_each_farm_service_where_it_serves_metrics(
    services: dict[str, dict[str, Any]],
) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}  # fmt: skip
    web = check_env("web", _env(services["web"]))
    worker = check_env("worker", _env(services["worker"]))
    stream = check_env("stream", _env(services["stream"]))
    assert targets == {
        f"web:{web.web_port}",
        f"worker:{worker.metrics_port}",
        f"stream:{stream.stream_port}",
    }
    assert services["prometheus"]["profiles"] == ["monitoring"]
    # /metrics of the web and the stream service needs a token: the one Prometheus sends
    bearer = {job["job_name"]: job.get("authorization", {}) for job in config["scrape_configs"]}
    token_file = "/prometheus/metrics-token"
    for job in ("tessera-web", "tessera-stream"):
        assert bearer[job] == {"type": "Bearer", "credentials_file": token_file}, job
    raw = [services[s]["environment"] for s in ("web", "stream", "prometheus")]
    assert raw[0]["FARM_METRICS_TOKEN"] == raw[1]["FARM_METRICS_TOKEN"] == raw[2]["METRICS_TOKEN"]
    assert token_file in " ".join(services["prometheus"]["entrypoint"])


def test_the_image_holds_every_package_and_starts_a_farm_command() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    include = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert include, "pyproject.toml lists no packages"
    for package in re.findall(r'"(\w+)\*"', include[1]):
        assert re.search(rf"^COPY {package} \./{package}$", dockerfile, re.M), package
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.M)
    assert cmd, "the image has no CMD"
    check_farm_command("deploy/Dockerfile CMD", yaml.safe_load(cmd[1]))


def test_the_cells_overlay_is_a_second_whole_cell_behind_a_front_door(
    services: dict[str, dict[str, Any]], compose: dict[str, Any]
) -> None:
    """deploy/compose/cells.yml: c1 is the base farm, c2 its own Redis, web and worker, the
    front door names each cell's web where it serves and reads the accounts where c1 keeps
    them."""
    cells = yaml.safe_load((DEPLOY / "compose" / "cells.yml").read_text())
    overlay = cells["services"]
    merged = {name: {**services.get(name, {}), **s} for name, s in overlay.items()}
    every = {**services, **merged}
    for name in ("web", "worker", "stream"):
        assert overlay[name]["environment"] == {"FARM_CELL": "c1"}
    for name in ("web-c2", "worker-c2", "frontdoor"):
        service = overlay[name]
        assert service["image"] == services["web"]["image"]
        check_farm_command(f"cells service {name}", service["command"])
        settings = check_env(f"cells service {name}", service["environment"])
        assert "healthcheck" in service
        for dep in service.get("depends_on", {}):
            assert dep in every, f"{name} depends on unknown service {dep}"
        if name != "frontdoor":
            assert settings.cell == "c2"
            assert host_port(settings.redis_url)[0] == "redis-c2"
            assert settings.storage_url != _env(services["web"])["FARM_STORAGE_URL"]
    door = check_env("frontdoor", overlay["frontdoor"]["environment"])
    control = host_port(door.control_redis_url)
    assert control == host_port(_env(services["web"])["FARM_REDIS_URL"])  # c1's Redis
    assert (
        host_port(check_env("web-c2", overlay["web-c2"]["environment"]).control_redis_url)
        == control
    )
    webs = {"c1": "web", "c2": "web-c2"}
    for cell, url in cells_of(door.cells).items():
        host, port = host_port(url)
        assert host == webs[cell]
        assert port == _healthcheck_port(every[host])
    assert (DEPLOY / "compose" / "cells-standins.yml").is_file()
    for volume in overlay["redis-c2"]["volumes"]:
        assert volume.split(":")[0] in cells["volumes"]
