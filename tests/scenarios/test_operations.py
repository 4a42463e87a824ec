"""Operations at scale: Kubernetes manifests (Kubernetes and Prometheus Operator schemas, kustomize), recording and
alerting rules (promtool unit tests on series shaped like Triton 2.51's), the Grafana dashboard, and a real
Prometheus computing the HPA metric from a real server serving a two-step ensemble."""

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

import jsonschema
import kubernetes_validate
import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from tritonclient.grpc import model_config_pb2 as mc

from tests.support.tiny_models import SLEEPY_MODEL_PY, build_smoke_repository
from tritonkit import deploy, paths, release
from tritonkit.repository import native_check, variants
from tritonkit.runtime.server import free_port

K8S_VERSION = "1.30.0"
CRD_SCHEMAS = Path(__file__).parents[1] / "fixtures" / "prometheus_operator"
CRD_FILES = {"PodMonitor": "podmonitors.v1.schema.json", "PrometheusRule": "prometheusrules.v1.schema.json"}


def _strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused, as `kubectl apply` (strict field validation) refuses them."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


def validate(doc: dict) -> None:
    """Against the Kubernetes API schemas, or for Prometheus Operator kinds against their CRD's schema."""
    if doc["kind"] in CRD_FILES:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        schema = _strict(json.loads((CRD_SCHEMAS / CRD_FILES[doc["kind"]]).read_text()))
        # The schema is OpenAPI v3 (close to draft 7); not checked as a draft-7 meta-schema, whose regex format
        # refuses the Go-syntax patterns some CRD fields carry.
        jsonschema.Draft7Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _variant(variant: str) -> dict[str, dict]:
    return {d["kind"]: d for d in _docs(deploy.K8S_DIR / variant / "tritonkit.yaml")}


def _monitoring() -> dict[str, dict]:
    return {d["kind"]: d for d in _docs(deploy.K8S_DIR / "common" / "monitoring.yaml")}


def test_committed_deploy_files_are_the_rendered_ones():
    assert deploy.main(["--check"]) == 0


def test_every_applied_manifest_validates():
    applied = [p for p in deploy.K8S_DIR.rglob("*.yaml") if p.name != "kustomization.yaml"]
    kinds = set()
    for path in applied:
        for doc in _docs(path):
            validate(doc)
            kinds.add(doc["kind"])
    assert kinds == {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                     "PersistentVolumeClaim", "PodMonitor", "PrometheusRule"}
    # Helm values are not a manifest: they live outside the folder users apply.
    assert not deploy.ADAPTER_VALUES.is_relative_to(deploy.K8S_DIR)


def test_schema_validation_can_fail():
    deployment = _variant("gpu")["Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProb"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinessProb"):
        validate(deployment)
    monitor = _monitoring()["PodMonitor"]
    monitor["spec"]["podMetricsEndpoint"] = monitor["spec"].pop("podMetricsEndpoints")
    with pytest.raises(jsonschema.ValidationError, match="podMetricsEndpoint"):
        validate(monitor)
    rule = _monitoring()["PrometheusRule"]
    rule["spec"]["groups"][0]["rules"][0]["recrod"] = rule["spec"]["groups"][0]["rules"][0].pop("record")
    with pytest.raises(jsonschema.ValidationError, match="recrod"):
        validate(rule)


@pytest.mark.parametrize("variant", list(deploy.VARIANTS))
def test_replicas_survive_drains_and_share_read_only_storage(variant):
    docs = _variant(variant)
    deployment, hpa, pdb = docs["Deployment"], docs["HorizontalPodAutoscaler"], docs["PodDisruptionBudget"]
    spec = deployment["spec"]
    assert spec["replicas"] >= 2 and hpa["spec"]["minReplicas"] >= 2
    budget = pdb["spec"]
    # A drain may evict a pod only when the budget allows at least one disruption at the smallest scale.
    allowed = budget["maxUnavailable"] if "maxUnavailable" in budget else hpa["spec"]["minReplicas"] - budget[
        "minAvailable"]
    assert allowed >= 1
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert "command" not in container  # NGC's entrypoint runs the args
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert ("nvidia.com/gpu" in container["resources"]["limits"]) == (variant == "gpu")
    claim = next(v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v)
    (pvc,) = _docs(deploy.K8S_DIR / "common" / "storage.yaml")
    assert claim == {"claimName": pvc["metadata"]["name"], "readOnly": True}
    assert pvc["spec"]["accessModes"] == ["ReadOnlyMany"]  # pods on many nodes mount it at once


def _gpu_only(cfg: mc.ModelConfig, configs: dict[str, mc.ModelConfig]) -> bool:
    if cfg.platform == "tensorrt_plan" or cfg.backend == "tensorrt":
        return True
    if any(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in cfg.instance_group):
        return True
    return any(_gpu_only(configs[s.model_name], configs) for s in cfg.ensemble_scheduling.step)


@pytest.mark.parametrize("variant", list(deploy.VARIANTS))
def test_each_variant_runs_the_image_command_on_its_own_view(variant):
    container = _variant(variant)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == deploy.server_command()
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/models")
    view = variants.NGC_REPOSITORY if variant == "gpu" else variants.NGC_CPU_REPOSITORY
    assert mount["subPath"] == view.name


def test_client_facing_models_are_ensembles_and_models_no_ensemble_uses(tmp_path):
    io = ('input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
          'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]\nmax_batch_size: 0\n')
    for name in ("step", "direct"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "onnxruntime"\n{io}')
    (tmp_path / "pipe").mkdir()
    (tmp_path / "pipe" / "config.pbtxt").write_text(
        f'name: "pipe"\nplatform: "ensemble"\n{io}ensemble_scheduling {{ step [ {{ model_name: "step" '
        'model_version: -1 input_map { key: "X" value: "X" } output_map { key: "Y" value: "Y" } } ] }\n')
    assert deploy.entry_models(tmp_path) == ["direct", "pipe"]


def test_cpu_view_has_no_gpu_only_model():
    """The CPU variant loads every model of the CPU view: none may need a GPU."""
    loaded = native_check.loaded_models(paths.MODEL_REPOSITORY, native_check.VIEWS["ngc-cpu"])
    assert loaded
    assert not [n for n, cfg in loaded.items() if _gpu_only(cfg, loaded)]


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its built-in kustomize) not installed")
@pytest.mark.parametrize("variant", list(deploy.VARIANTS))
def test_kustomize_build_sets_the_registry_from_one_place(variant):
    image_component = yaml.safe_load((deploy.K8S_DIR / "image" / "kustomization.yaml").read_text())
    (override,) = image_component["images"]
    assert override["name"] == release.IMAGE_NAME
    built = subprocess.run(["kubectl", "kustomize", str(deploy.K8S_DIR / variant)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    docs = [d for d in yaml.safe_load_all(built.stdout) if d]
    for doc in docs:
        validate(doc)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
                            "PersistentVolumeClaim", "PodMonitor", "PrometheusRule"])
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"{override['newName']}:{release.DEFAULT}"


# Linux /proc/cpuinfo flag -> the node-feature-discovery cpuid label name of the same feature (klauspost/cpuid).
NFD_NAMES = {"avx2": "AVX2", "avx512bw": "AVX512BW", "avx512_vnni": "AVX512VNNI", "avx_vnni": "AVXVNNI",
             "amx_int8": "AMXINT8", "avx512_bf16": "AVX512BF16"}


def _matches(terms: list[dict], labels: dict[str, str]) -> bool:
    """Kubernetes node selector semantics: any term, all of its expressions (In, DoesNotExist only here)."""
    def holds(e):
        return labels.get(e["key"]) in e["values"] if e["operator"] == "In" else e["key"] not in labels
    return any(all(holds(e) for e in t["matchExpressions"]) for t in terms)


@pytest.mark.parametrize("flags", [["avx2"], ["avx2", "avx512bw"], ["avx2", "avx512bw", "avx512_vnni"],
                                   ["avx2", "avx_vnni"], ["avx2", "avx512bw", "avx512_vnni", "amx_int8"]])
def test_nfd_labels_select_the_cpu_class_tritonkit_detects(flags):
    from tritonkit import envinfo

    labels = {f"feature.node.kubernetes.io/cpu-cpuid.{NFD_NAMES[f]}": "true" for f in flags}
    matched = [c for c in deploy.NFD_CLASSES if _matches(deploy.node_terms(c), labels)]
    assert matched == [envinfo.int8_class(flags)]


def test_cpu_replicas_prefer_nodes_of_classes_that_proved_int8_and_a_component_pins_one(tmp_path):
    from tritonkit import kinds
    from tritonkit.repository import replica

    spec = _variant("cpu")["Deployment"]["spec"]["template"]["spec"]
    prefer = spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    flags = {"vnni": ["avx2", "avx512bw", "avx512_vnni"], "avx512": ["avx2", "avx512bw"], "avx2": ["avx2"]}
    proven = {cpu for name in kinds.names() for cpu in replica.int8_classes(kinds.get(name))}
    # A node of a class that proved some spec's INT8, with native bf16 or without (it serves the INT8 file on ONNX
    # Runtime where its class's runtime computes in bf16).
    for cpu in proven:
        for bf16 in ([], ["avx512_bf16"]):
            labels = {f"feature.node.kubernetes.io/cpu-cpuid.{NFD_NAMES[f]}": "true" for f in flags[cpu] + bf16}
            assert any(_matches([p["preference"]], labels) for p in prefer), (cpu, bf16)
    node = {"feature.node.kubernetes.io/cpu-cpuid.AVX2": "true"}  # an AVX2-only node
    assert ("avx2" in proven) == any(_matches([p["preference"]], node) for p in prefer)
    assert "affinity" not in _variant("gpu")["Deployment"]["spec"]["template"]["spec"]
    import os

    here = {"cpu": deploy.K8S_DIR / "cpu", "pin": deploy.K8S_DIR / "cpu-class" / "avx2"}  # kustomize: relative only
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(here["cpu"], tmp_path)], "components": [os.path.relpath(here["pin"], tmp_path)]}))
    built = subprocess.run(["kubectl", "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(tmp_path)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (deployment,) = [d for d in yaml.safe_load_all(built.stdout) if d and d["kind"] == "Deployment"]
    validate(deployment)
    required = deployment["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert _matches(required, node) and not _matches(required, {**node, "feature.node.kubernetes.io/cpu-cpuid."
                                                                "AVX512BW": "true"})


# --- rules ----------------------------------------------------------------------------------------------------

def _rule_groups() -> list[dict]:
    return _monitoring()["PrometheusRule"]["spec"]["groups"]


def _records(groups: list[dict]) -> dict[str, str]:
    return {r["record"]: r["expr"] for g in groups for r in g["rules"] if "record" in r}


def test_pod_monitor_adds_the_labels_the_rules_group_by():
    monitor = _monitoring()["PodMonitor"]
    deployment = _variant("gpu")["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports[endpoint["port"]] == 8002
    produced = {r["targetLabel"] for r in endpoint["relabelings"]}
    grouped = {label for expr in _records(_rule_groups()).values()
               for by in re.findall(r"by \(([^)]*)\)", expr) for label in by.replace(" ", "").split(",")}
    assert grouped - {"model"} <= produced  # Triton itself exports model/version


def test_hpa_metric_is_served_by_the_adapter_from_a_recording_rule():
    adapter = yaml.safe_load(deploy.ADAPTER_VALUES.read_text())["rules"]["custom"][0]
    for variant in deploy.VARIANTS:
        hpa = _variant(variant)["HorizontalPodAutoscaler"]
        assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == adapter["name"]["as"]
    series = re.match(r"([\w:]+)\{", adapter["seriesQuery"]).group(1)
    assert series in _records(_rule_groups())
    assert {"namespace", "pod"} == set(adapter["resources"]["overrides"])


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    assert promtool, "promtool not found: `make setup` installs Debian's prometheus package"
    return subprocess.run([promtool, *args], capture_output=True, text=True)


def _write_rules(path: Path, groups: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"groups": groups}, allow_unicode=True))
    return path


def _dashboard_exprs() -> list[str]:
    dashboard = json.loads(deploy.DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_promql_expression_parses(tmp_path):
    adapter = yaml.safe_load(deploy.ADAPTER_VALUES.read_text())["rules"]["custom"][0]
    templated = adapter["metricsQuery"].replace("<<.GroupBy>>", "pod").replace(
        "<<.Series>>", adapter["seriesQuery"].split("{")[0]).replace("<<.LabelMatchers>>", 'namespace="x"')
    extra = [{"record": "tritonkit_check:adapter", "expr": templated}]
    extra += [{"record": f"tritonkit_check:panel_{i}", "expr": e} for i, e in enumerate(_dashboard_exprs())]
    groups = [*_rule_groups(), {"name": "check", "rules": extra}]
    result = _promtool("check", "rules", str(_write_rules(tmp_path / "rules.yml", groups)))
    assert result.returncode == 0, result.stdout + result.stderr
    broken = [{"name": "b", "rules": [{"record": "x:y", "expr": "sum by (model) (rate(nv_inference_count[1m])"}]}]
    assert _promtool("check", "rules", str(_write_rules(tmp_path / "broken.yml", broken))).returncode != 0


def _series(model: str, pod: str, metric: str, per_step: int, steps: int = 80) -> dict:
    """A Triton 2.51 counter as the PodMonitor labels it, growing by `per_step` every 15 s."""
    labels = f'model="{model}",version="1",namespace="ml",pod="{pod}",job="tritonkit"'
    return {"series": f"{metric}{{{labels}}}", "values": f"0+{per_step}x{steps}"}


def _rule_tests() -> dict:
    success, queue = "nv_inference_request_success", "nv_inference_queue_duration_us"
    series = [
        # Pod a: 150 client requests per 15 s through text_embedding (tokenizer -> text_encoder). Each request
        # waits 2000 µs at the tokenizer and 3000 µs at the encoder; the ensemble's own queue counter grows by
        # ~3 µs a request (measured on the embedded 2.51 server: it does not include its steps' queues).
        _series("text_embedding", "a", success, 150), _series("text_embedding", "a", queue, 450),
        _series("tokenizer", "a", success, 150), _series("tokenizer", "a", queue, 300_000),
        _series("text_encoder", "a", success, 150), _series("text_encoder", "a", queue, 450_000),
        # Pod b: a model clients call directly (no ensemble), 2000 µs of queue per request.
        _series("text_embedding_fused", "b", success, 30), _series("text_embedding_fused", "b", queue, 60_000),
        # Pod c: overloaded, 60 ms of queue per client request.
        _series("text_embedding", "c", success, 15), _series("text_embedding", "c", queue, 0),
        _series("tokenizer", "c", success, 15), _series("tokenizer", "c", queue, 900_000),
        {"series": 'up{job="tritonkit",namespace="ml",pod="a"}', "values": "1x80"},
        {"series": 'up{job="tritonkit",namespace="ml",pod="d"}', "values": "0x80"},
    ]
    per_pod = deploy.QUEUE_RULE
    return {
        "interval": "15s",
        "input_series": series,
        "promql_expr_test": [
            {"expr": per_pod, "eval_time": "5m", "exp_samples": [
                # One client request's queue time: (450 + 300000 + 450000) µs / 150 requests. Dividing by the
                # ensemble's and its steps' requests together (450) would give a third of it.
                {"labels": f'{per_pod}{{namespace="ml",pod="a"}}', "value": 5003},
                {"labels": f'{per_pod}{{namespace="ml",pod="b"}}', "value": 2000},
                {"labels": f'{per_pod}{{namespace="ml",pod="c"}}', "value": 60000},
            ]},
            {"expr": 'tritonkit:queue_us_per_request:rate1m{pod="a"}', "eval_time": "5m", "exp_samples": [
                {"labels": 'tritonkit:queue_us_per_request:rate1m{namespace="ml",pod="a",model="text_embedding"}',
                 "value": 3},
                {"labels": 'tritonkit:queue_us_per_request:rate1m{namespace="ml",pod="a",model="tokenizer"}',
                 "value": 2000},
                {"labels": 'tritonkit:queue_us_per_request:rate1m{namespace="ml",pod="a",model="text_encoder"}',
                 "value": 3000},
            ]},
            {"expr": 'tritonkit:client_requests_per_second:rate1m{pod="a"}', "eval_time": "5m", "exp_samples": [
                {"labels": 'tritonkit:client_requests_per_second:rate1m{namespace="ml",pod="a"}', "value": 10},
            ]},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "TritonkitQueueTimeHigh", "exp_alerts": [{
                "exp_labels": {"severity": "warning", "namespace": "ml", "pod": "c"},
                "exp_annotations": {"summary": "c: client requests wait 60kµs in queues for 10 min (the HPA is at "
                                               "its maximum or cannot add pods)"},
            }]},
            {"eval_time": "15m", "alertname": "TritonkitTargetDown", "exp_alerts": [{
                "exp_labels": {"severity": "critical", "job": "tritonkit", "namespace": "ml", "pod": "d"},
                "exp_annotations": {"summary": "d: Prometheus cannot scrape Triton's metrics port"},
            }]},
            {"eval_time": "15m", "alertname": "TritonkitRequestFailures", "exp_alerts": []},
        ],
    }


def test_rules_compute_one_client_requests_queue_time_and_alert(tmp_path):
    _write_rules(tmp_path / "rules.yml", _rule_groups())
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [_rule_tests()]}, allow_unicode=True))
    result = _promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_tests_can_fail(tmp_path):
    """The same tests on the rule as it was (ensemble and steps summed over their combined requests) fail."""
    groups = _rule_groups()
    for rule in groups[0]["rules"]:
        if rule.get("record") == deploy.QUEUE_RULE:
            rule["expr"] = ("sum by (namespace, pod) (rate(nv_inference_queue_duration_us[1m])) / clamp_min(sum by "
                            "(namespace, pod) (rate(nv_inference_request_success[1m])), 1e-9)")
    _write_rules(tmp_path / "rules.yml", groups)
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yml"], "evaluation_interval": "15s", "tests": [_rule_tests()]}, allow_unicode=True))
    result = _promtool("test", "rules", str(tmp_path / "tests.yml"))
    assert result.returncode != 0 and f"{deploy.QUEUE_RULE}" in result.stderr, result.stdout + result.stderr


# --- against the real server ----------------------------------------------------------------------------------

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
    exprs = [*_dashboard_exprs(), *(r["expr"] for g in _rule_groups() for r in g["rules"])]
    wanted = _metric_names(exprs)
    assert wanted, "no metric names found in the expressions"
    assert wanted <= exported, f"not exported: {sorted(wanted - exported)}"


def build_two_step_repository(repo: Path, delay_ms: int = 20) -> Path:
    """Ensemble `pipe` = step_a -> step_b, Python models of one instance that each take `delay_ms`: concurrent
    clients queue at both steps."""
    for name in ("step_a", "step_b"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(SLEEPY_MODEL_PY)
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]\n'
            'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]\n'
            'instance_group [ { count: 1 kind: KIND_CPU } ]\n'
            f'parameters {{ key: "delay_ms" value {{ string_value: "{delay_ms}" }} }}\n')
    (repo / "pipe" / "1").mkdir(parents=True)
    (repo / "pipe" / "config.pbtxt").write_text(
        'name: "pipe"\nplatform: "ensemble"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1, 1 ] } ]\n'
        'ensemble_scheduling { step [\n'
        '  { model_name: "step_a" model_version: -1 input_map { key: "X" value: "X" }'
        ' output_map { key: "Y" value: "mid" } },\n'
        '  { model_name: "step_b" model_version: -1 input_map { key: "X" value: "mid" }'
        ' output_map { key: "Y" value: "Y" } } ] }\n')
    return repo


def _drive_pipe(url: str, seconds: float) -> None:
    client = httpclient.InferenceServerClient(url)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        inp = httpclient.InferInput("X", [1, 1], "FP32")
        inp.set_data_from_numpy(np.ones((1, 1), np.float32))
        client.infer("pipe", [inp])
    client.close()


def test_real_prometheus_computes_queue_time_per_client_request(start_server, tmp_path):
    repo = build_two_step_repository(tmp_path / "repo")
    server = start_server(repo)
    binary = shutil.which("prometheus")
    assert binary, "prometheus not found: `make setup` installs Debian's prometheus package"
    groups = deploy.rule_groups(repo)  # the shipped rules, for this repository's entry models
    for group in groups:
        group["interval"] = "1s"  # same expressions, evaluated fast enough for a test
    _write_rules(tmp_path / "rules.yml", groups)
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(tmp_path / "rules.yml")],
        "scrape_configs": [{"job_name": "tritonkit", "static_configs": [
            {"targets": [f"127.0.0.1:{server.metrics_port}"], "labels": {"namespace": "ml", "pod": "p0"}}]}],
    }))
    prom = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    clients = [threading.Thread(target=_drive_pipe, args=(server.http_url, 15.0)) for _ in range(4)]
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        # The rules' 1m rates still cover the whole run; wait for an evaluation that saw it.
        query = f'{deploy.QUEUE_RULE}{{pod="p0"}}'
        value, deadline = None, time.monotonic() + 30
        while value is None and time.monotonic() < deadline:
            time.sleep(1)
            try:
                url = f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(query)}"
                result = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]["result"]
            except OSError:
                continue  # still starting
            if result and float(result[0]["value"][1]) > 0:
                value = float(result[0]["value"][1])
        assert value is not None, "Prometheus never produced the queue time per client request"
        # Triton's statistics API, a second view of the same counters: queue time of every model per pipe request.
        stats = json.loads(urllib.request.urlopen(f"http://{server.http_url}/v2/models/stats").read())["model_stats"]
        queue_us = {s["name"]: s["inference_stats"]["queue"]["ns"] / 1000 for s in stats}
        requests = {s["name"]: s["inference_stats"]["success"]["count"] for s in stats}
        per_client_request = sum(queue_us.values()) / requests["pipe"]
        # Four clients, one instance per 20 ms step: each request waits for most of the others at each step.
        assert per_client_request > 20_000
        assert queue_us["pipe"] / requests["pipe"] < 1_000  # the ensemble's own counter leaves the steps out
        assert 0.5 * per_client_request < value < 2 * per_client_request, (value, per_client_request)
    finally:
        prom.terminate()
        prom.wait(10)
