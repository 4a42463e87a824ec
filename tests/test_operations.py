"""Operations at scale: Kubernetes manifests (schema-validated offline), recording rules, the Grafana dashboard,
and a real Prometheus scraping the embedded server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import kubernetes_validate
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from tiny_models import build_smoke_repository

from tritonkit import deploy, paths
from tritonkit.server import free_port

K8S_VERSION = "1.30.0"
RULES = paths.ROOT / "deploy" / "prometheus" / "rules.yml"
ADAPTER = paths.ROOT / "deploy" / "k8s" / "prometheus-adapter.yaml"


def _docs(variant: str) -> list[dict]:
    return list(yaml.safe_load_all((deploy.K8S_DIR / f"{variant}.yaml").read_text()))


def test_committed_manifests_and_dashboard_are_the_rendered_ones():
    assert deploy.main(["--check"]) == 0


@pytest.mark.parametrize("variant", list(deploy.VARIANTS))
def test_manifests_validate_against_kubernetes_schemas(variant):
    docs = _docs(variant)
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    container = docs[0]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert ("nvidia.com/gpu" in container["resources"]["limits"]) == (variant == "gpu")


def test_schema_validation_can_fail():
    deployment = _docs("gpu")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProb"):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def _rules() -> dict[str, str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {r["record"]: r["expr"] for g in groups for r in g["rules"]}


def test_hpa_metric_is_served_by_the_adapter_from_a_recording_rule():
    adapter = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"][0]
    for variant in deploy.VARIANTS:
        hpa = _docs(variant)[2]
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == adapter["name"]["as"]
    series = re.match(r"([\w:]+)\{", adapter["seriesQuery"]).group(1)
    assert series in _rules()


def _promtool(tmp_path: Path, exprs: dict[str, str]) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: `make setup` installs Debian's prometheus package"
    rules = {"groups": [{"name": "check", "rules": [{"record": k, "expr": v} for k, v in exprs.items()]}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(deploy.DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_promql_expression_parses(tmp_path):
    adapter = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"][0]
    templated = adapter["metricsQuery"].replace("<<.GroupBy>>", "pod").replace(
        "<<.Series>>", adapter["seriesQuery"].split("{")[0]).replace("<<.LabelMatchers>>", 'namespace="x"')
    exprs = {**_rules(), "tritonkit_check:adapter": templated}
    exprs.update({f"tritonkit_check:panel_{i}": e for i, e in enumerate(_dashboard_exprs())})
    result = _promtool(tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = _promtool(tmp_path, {"tritonkit_check:broken": "sum by (model) (rate(nv_inference_count[1m])"})
    assert broken.returncode != 0  # the check can fail


def _metric_names(exprs) -> set[str]:
    return {m for e in exprs for m in re.findall(r"\b((?:nv|tritonkit)_[a-z_]+)\b", e)}


def _drive(url: str, seconds: float, model: str = "smoke_linear") -> int:
    client = httpclient.InferenceServerClient(url, concurrency=4)
    x = np.ones((1, 4), np.float32)
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        batch = []
        for i in range(8):
            inp = httpclient.InferInput("X", [1, 4], "FP32")
            inp.set_data_from_numpy(x * (sent + i % 3))  # some repeats, so the cache sees hits
            batch.append(client.async_infer(model, [inp]))
        for request in batch:
            request.get_result()
        sent += len(batch)
    client.close()
    return sent


@pytest.fixture(scope="module")
def monitored_server(start_server, tmp_path_factory):
    repo = build_smoke_repository(tmp_path_factory.mktemp("monitored"))
    config = repo / "smoke_linear" / "config.pbtxt"
    config.write_text(config.read_text() + "response_cache { enable: true }\n")
    return start_server(repo, extra_args=["--cache-config=local,size=1048576"])


def test_dashboard_and_rules_name_metrics_the_server_exports(monitored_server):
    _drive(monitored_server.http_url, 1.0)
    exported = set(re.findall(r"^(\w+)", urllib.request.urlopen(monitored_server.metrics_url).read().decode(), re.M))
    wanted = _metric_names([*_dashboard_exprs(), *_rules().values()])
    assert wanted, "no metric names found in the expressions"
    assert wanted <= exported, f"not exported: {sorted(wanted - exported)}"


def test_real_prometheus_computes_queue_time_per_request(monitored_server, tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: `make setup` installs Debian's prometheus package"
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"  # same expressions, evaluated fast enough for a test
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yml")],
        "scrape_configs": [{"job_name": "triton", "static_configs": [
            {"targets": [f"127.0.0.1:{monitored_server.metrics_port}"]}]}],
    }))
    prom = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        load = threading.Thread(target=_drive, args=(monitored_server.http_url, 12.0))
        load.start()
        query = "tritonkit:queue_us_per_request:rate1m"
        value = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and value is None:
            time.sleep(1)
            try:
                url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(query)}"
                body = json.loads(urllib.request.urlopen(url, timeout=5).read())
            except OSError:
                continue  # still starting
            series = [r for r in body["data"]["result"] if r["metric"].get("model") == "smoke_linear"]
            if series and float(series[0]["value"][1]) > 0:
                value = float(series[0]["value"][1])
        load.join()
        assert value is not None, "Prometheus never produced queue time per request for smoke_linear"
        assert 0 < value < 10_000_000  # µs per request: positive and sane
    finally:
        prom.terminate()
        prom.wait(10)
