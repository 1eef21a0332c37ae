"""The deploy files point at what the server really has: the Kubernetes
manifests' probes, port, environment and preStop hook (run for real, as the
pod would run it, against a server process started with the manifest's
environment), the times (terminationGracePeriodSeconds covers the hook and
the server's grace), the Dockerfile (non-root, exec form, a HEALTHCHECK on
liveness) and the Grafana dashboard (its first two panels are stop latency
p95 and tokens billed after stop; every metric it queries is one
``GET /metrics`` serves)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from server_process import Server

from web.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kubernetes" / "turnkeeper.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "turnkeeper.json"
SECRETS = {"api_tokens": "default:tok-deploy-0123456789", "admin_token": "admin-deploy-0123456789"}


def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def server_container() -> tuple[dict[str, Any], dict[str, Any]]:
    (deployment,) = [d for d in docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "turnkeeper"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return deployment, container


def container_env(container: dict[str, Any], **override: str) -> dict[str, str]:
    """The container's environment as the pod gets it: secrets filled in
    (test values), ``$(VAR)`` references expanded."""
    env: dict[str, str] = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), ""), item["value"])
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = SECRETS[item["valueFrom"]["secretKeyRef"]["key"]]
        else:
            env[item["name"]] = "127.0.0.1"  # the pod's IP
    env.update(override)
    return env


def test_the_manifests_probe_real_endpoints_on_the_real_port() -> None:
    deployment, c = server_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    env = container_env(c)
    assert ports["http"] == int(env["TURNKEEPER_PORT"]) == 8080
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    (service,) = [d for d in docs() if d["kind"] == "Service" and d["metadata"]["name"] == "turnkeeper"]
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    redis_services = {d["metadata"]["name"]: d for d in docs() if d["kind"] == "Service"}
    store = env["TURNKEEPER_STORE"]
    host, port = re.fullmatch(r"redis://([\w-]+):(\d+)/\d+", store).groups()  # type: ignore[union-attr]
    assert int(port) in {p["port"] for p in redis_services[host]["spec"]["ports"]}
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_the_manifests_environment_is_settings_the_server_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    _, c = server_container()
    for name, value in container_env(c).items():
        if name.startswith("TURNKEEPER_"):
            monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.host == "0.0.0.0" and settings.port == 8080 and settings.store.startswith("redis://")
    assert settings.admin_token and settings.api_tokens


def test_the_grace_periods_nest() -> None:
    """The hook's wait outlasts the server's grace, and Kubernetes waits
    longer than the hook: the server exits on its own, never SIGKILLed."""
    deployment, c = server_container()
    grace_s = float(container_env(c).get("TURNKEEPER_SHUTDOWN__GRACE_S", Settings().shutdown.grace_s))
    hook = c["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["turnkeeper", "drain"] and "--wait" in hook
    hook_timeout_s = float(hook[hook.index("--timeout") + 1])
    termination_s = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s < hook_timeout_s < termination_s


async def test_the_prestop_hook_drains_a_server_started_with_the_manifests_environment(tmp_path: Path) -> None:
    """The hook's command, exactly as written, in the container's
    environment (the store a local SQLite file instead of the cluster's
    Redis): readiness goes 503 while liveness holds, the server exits 0 and
    the hook returns 0 once it has."""
    _, c = server_container()
    server = Server({}, tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    pod_env = container_env(c, TURNKEEPER_PORT=str(server.port), TURNKEEPER_HOST="127.0.0.1",
                            TURNKEEPER_STORE=f"sqlite:///{tmp_path}/t.db", TURNKEEPER_SHUTDOWN__LB_DELAY_S="1")
    server.env = {**base, "PYTHONPATH": str(ROOT), **pod_env}
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/readyz", "/healthz"):
                async with http.get(server.url + path) as r:
                    assert r.status == 200, path
            hook = c["lifecycle"]["preStop"]["exec"]["command"]
            cli = [sys.executable, "-m", "web.cli", *hook[1:]]  # the console script, from this checkout
            proc = await asyncio.create_subprocess_exec(*cli, env=server.env, cwd=tmp_path,
                                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            async with asyncio.timeout(10):
                while True:
                    async with http.get(server.url + "/readyz") as r:
                        if r.status == 503:
                            break
                    await asyncio.sleep(0.05)
            async with http.get(server.url + "/healthz") as r:
                assert r.status == 200  # liveness holds through the drain
            out, _ = await asyncio.wait_for(proc.communicate(), 40)
            assert proc.returncode == 0, out.decode()
        assert server.proc is not None
        assert await asyncio.to_thread(server.proc.wait, 10) == 0, server.log()[-2000:]
    finally:
        server.stop()


def test_the_dockerfile_runs_unprivileged_in_exec_form_with_a_healthcheck() -> None:
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()]
    (user,) = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert user not in ("0", "root")
    cmd = [ln for ln in lines if ln.startswith("CMD ")][-1]  # the image's command (the last CMD)
    assert json.loads(cmd[4:]) == ["turnkeeper", "serve"]  # exec form: PID 1 gets SIGTERM
    health = (ROOT / "Dockerfile").read_text().split("HEALTHCHECK", 1)[1].split("\n# ", 1)[0]
    assert "/healthz" in health and "CMD [" in health


def dashboard_metrics() -> tuple[list[str], set[str]]:
    board = json.loads(DASHBOARD.read_text())
    titles = [p["title"] for p in board["panels"]]
    names = {m for p in board["panels"] for t in p["targets"] for m in re.findall(r"\bturnkeeper_\w+", t["expr"])}
    return titles, names


async def test_the_dashboard_queries_what_metrics_serves(tmp_path: Path) -> None:
    from conftest import start_app

    from web.app import create_app

    titles, names = dashboard_metrics()
    assert titles[0].startswith("Stop latency p95") and titles[1] == "Tokens billed after stop"
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db"))
    # a histogram and the labelled counters show samples once observed: observe one of each
    from datetime import UTC, datetime

    from turn.models import EventRecord
    from web.metrics import METRICS
    metrics = app[METRICS]
    at = datetime.now(UTC)
    for type_, payload in [
        ("turn", {"status": "CANCELLED", "stop_reason": {"kind": "user_cancel", "at": at.isoformat()}}),
        ("usage", {"prompt_tokens": 1, "completion_tokens": 1}),
        ("barge_in", {"initiator": "vad", "onset_to_fence_ms": 1.0}),
        ("false_interruption", {"paused_ms": 0.0}), ("backchannel", {"paused_ms": 0.0}),
        ("tool.done", {}), ("agent.restart", {"reason": "adopted"}),
    ]:
        metrics.observe(EventRecord(session_id="s", seq=1, type=type_, turn_id=None, generation=1, at=at, payload=payload))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
            served = set(re.findall(r"^(turnkeeper_\w+?)(?:\{| )", await r.text(), re.M))
    finally:
        await runner.cleanup()
    assert names and names <= served, names - served
