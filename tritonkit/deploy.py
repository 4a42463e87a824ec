"""Kubernetes manifests, Prometheus Operator objects and the container command, rendered from one description.

`python -m tritonkit.deploy` (`make manifests`) rewrites the generated files under deploy/ (see OUTPUTS); tests check
the committed files equal this output and validate them against the Kubernetes and Prometheus Operator schemas,
run the rules through `promtool test rules`, and check the metric names against a real server.

Users apply one variant with `kubectl apply -k deploy/k8s/gpu` (or `cpu`); the image registry is set in one place,
deploy/k8s/image/kustomization.yaml (hand-edited, not generated).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from tritonkit import paths, release
from tritonkit.repository import variants
from tritonkit.repository.config import load_repository

DEPLOY = paths.ROOT / "deploy"
K8S_DIR = DEPLOY / "k8s"
ADAPTER_VALUES = DEPLOY / "helm" / "prometheus-adapter-values.yaml"
# The custom metric the HorizontalPodAutoscalers scale on, and the recording rule prometheus-adapter serves it from.
QUEUE_METRIC = "tritonkit_queue_us_per_client_request"
QUEUE_RULE = "tritonkit:pod_queue_us_per_client_request:rate1m"
EXIT_TIMEOUT_S = 30
MODEL_REPOSITORY_CLAIM = "tritonkit-model-repository"
# Pods of every variant carry these; the PodMonitor selects them.
SERVER_LABELS = {"app.kubernetes.io/part-of": "tritonkit", "app.kubernetes.io/component": "tritonserver"}
SCRAPE_JOB = "tritonkit"


@dataclass(frozen=True)
class Variant:
    name: str
    cpu: str
    memory: str
    gpus: int
    # HPA target: mean queue time (µs) per client request a pod may show before another replica is added.
    queue_target_us: int
    max_replicas: int
    # Rolling update: GPU nodes rarely have a spare GPU for a surge pod, so GPU replicas are replaced one at a time.
    max_surge: int
    max_unavailable: int
    # Folder of the repository volume this variant serves: the NGC view `make check-native` writes under build/.
    # The CPU view has no TensorRT model, so a CPU replica loads everything in its folder.
    repository: str


VARIANTS = {
    # A GPU replica absorbs bursts fast; scale before queueing reaches a few ms of a ~20 ms budget.
    "gpu": Variant("tritonkit", cpu="4", memory="12Gi", gpus=1, queue_target_us=5_000, max_replicas=8,
                   max_surge=0, max_unavailable=1, repository=variants.NGC_REPOSITORY.name),
    # CPU replicas compute slower, so a larger share of the budget is queue before a new pod pays off.
    "cpu": Variant("tritonkit-cpu", cpu="4", memory="6Gi", gpus=0, queue_target_us=20_000, max_replicas=16,
                   max_surge=1, max_unavailable=0, repository=variants.NGC_CPU_REPOSITORY.name),
}


# node-feature-discovery's CPU labels (`feature.node.kubernetes.io/cpu-cpuid.<FLAG>: "true"` where the CPU has
# FLAG) that tell tritonkit.envinfo.int8_class's classes apart: per class, node selector terms (any one matches), each
# a list of (flag, present).
NFD_CPUID = "feature.node.kubernetes.io/cpu-cpuid."
_VNNI = ("AVX512VNNI", "AVXVNNI", "AMXINT8")
NFD_CLASSES = {
    "vnni": [[(flag, True)] for flag in _VNNI],
    "avx512": [[("AVX512BW", True), *((flag, False) for flag in _VNNI)]],
    "avx2": [[("AVX2", True), ("AVX512BW", False), *((flag, False) for flag in _VNNI)]],
}
# Scheduler preference per spec whose INT8 a class proved (a node of that class serves it as INT8, others FP32).
PREFERENCE_PER_MODEL = 20


def node_terms(cpu_class: str) -> list[dict]:
    """The nodeSelectorTerms that select nodes of `cpu_class` by their NFD labels."""
    return [{"matchExpressions": [{"key": NFD_CPUID + flag, "operator": "In", "values": ["true"]} if present
                                  else {"key": NFD_CPUID + flag, "operator": "DoesNotExist"} for flag, present in term]}
            for term in NFD_CLASSES[cpu_class]]


def class_preferences() -> list[dict]:
    """preferredDuringScheduling terms: nodes of each class where specs' INT8 is proven, weighted by how many
    (tritonkit.repository.replica.int8_classes); every node of the class, since one without native bf16 serves INT8
    proven on a bf16 runtime on ONNX Runtime (tritonkit.serving.runtimes.without_bf16)."""
    from tritonkit import kinds
    from tritonkit.repository import replica

    proven: dict[str, int] = {}
    for name in kinds.names():
        for cpu in replica.int8_classes(kinds.get(name)):
            proven[cpu] = proven.get(cpu, 0) + 1
    return [{"weight": min(100, PREFERENCE_PER_MODEL * count), "preference": term}
            for cpu, count in sorted(proven.items()) if cpu in NFD_CLASSES for term in node_terms(cpu)]


def class_component(cpu_class: str) -> dict:
    """A kustomize Component that holds the CPU variant's replicas to nodes of `cpu_class` (required affinity)."""
    patch = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": VARIANTS["cpu"].name},
             "spec": {"template": {"spec": {"affinity": {"nodeAffinity": {
                 "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": node_terms(cpu_class)}}}}}}}
    return {"apiVersion": "kustomize.config.k8s.io/v1alpha1", "kind": "Component",
            "patches": [{"patch": yaml.dump(patch, Dumper=_Dumper, sort_keys=False)}]}


def entry_models(repository: Path = paths.MODEL_REPOSITORY) -> list[str]:
    """Models clients call: ensembles and every model no ensemble uses as a step."""
    configs = load_repository(repository)
    steps = {s.model_name for c in configs.values() for s in c.ensemble_scheduling.step}
    return sorted(set(configs) - steps)


def server_command() -> list[str]:
    """The container's command: tritonserver under tritonkit.runtime.supervisor (which reloads a model whose Python stub
    died, through the repository API; explicit model control is what allows that, `*` loads every model)."""
    return [
        "python3", "-m", "tritonkit.runtime.supervisor", "--",
        "tritonserver", "--model-repository=/models", "--model-control-mode=explicit", "--load-model=*",
        "--strict-readiness=true", f"--exit-timeout-secs={EXIT_TIMEOUT_S}", "--metrics-config=summary_latencies=true",
    ]


def manifests(v: Variant) -> list[dict]:
    labels = {"app.kubernetes.io/name": v.name, **SERVER_LABELS}
    resources = {"requests": {"cpu": v.cpu, "memory": v.memory}, "limits": {"memory": v.memory}}
    if v.gpus:
        resources["requests"]["nvidia.com/gpu"] = v.gpus
        resources["limits"]["nvidia.com/gpu"] = v.gpus
    container = {
        "name": "tritonserver",
        # The registry is prefixed by the kustomize component deploy/k8s/image (the one place to set it).
        "image": release.IMAGE,
        # `args`, not `command`: NGC's entrypoint (driver compatibility checks) stays and runs them.
        "args": server_command(),
        "env": [
            # tritonkit.runtime.supervisor restricts the repository, trace and logging APIs to this key.
            {"name": "TRITONKIT_CONTROL_KEY",
             "valueFrom": {"secretKeyRef": {"name": "tritonkit-control-key", "key": "key"}}},
        ],
        "ports": [
            {"name": "http", "containerPort": 8000},
            {"name": "grpc", "containerPort": 8001},
            {"name": "metrics", "containerPort": 8002},
        ],
        # Model loading can take minutes (TensorRT plans, Python stubs): liveness waits for startup.
        "startupProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                         "periodSeconds": 5, "failureThreshold": 120},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3},
        # Ready only when every model is (the server runs with strict readiness).
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                           "periodSeconds": 5, "failureThreshold": 2},
        # Let the Service drop this pod before SIGTERM starts the drain.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "resources": resources,
        "volumeMounts": [
            {"name": "model-repository", "mountPath": "/models", "subPath": v.repository, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    # CPU replicas lean towards nodes of the classes that proved INT8; any node still serves (FP32 where unproven).
    prefer = [] if v.gpus else class_preferences()
    affinity = {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": prefer}}} \
        if prefer else {}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": v.name, "labels": labels},
        "spec": {
            # Two replicas, so a node drain (PDB maxUnavailable 1) never takes the service down.
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": v.max_surge, "maxUnavailable": v.max_unavailable}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # preStop + Triton's exit timeout must fit, or in-flight requests are cut.
                    "terminationGracePeriodSeconds": EXIT_TIMEOUT_S + 30,
                    # Replicas on different nodes, so one node going away leaves the others serving.
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": labels},
                    }],
                    "containers": [container],
                    **affinity,
                    "volumes": [
                        {"name": "model-repository",
                         "persistentVolumeClaim": {"claimName": MODEL_REPOSITORY_CLAIM, "readOnly": True}},
                        # The Python backend moves tensors through /dev/shm; the container default is 64 MB.
                        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": v.name, "labels": labels},
        "spec": {
            "selector": labels,
            "ports": [{"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]}
                      for p in container["ports"]],
        },
    }
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": v.name, "labels": labels},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": v.name},
            "minReplicas": 2,
            "maxReplicas": v.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": QUEUE_METRIC},
                    "target": {"type": "AverageValue", "averageValue": str(v.queue_target_us)},
                },
            }],
            "behavior": {
                # Queue time grows fast under a burst: add pods at once, remove them slowly.
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 30}]},
                "scaleDown": {"stabilizationWindowSeconds": 300,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}]},
            },
        },
    }
    pdb = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": v.name, "labels": labels},
        # One pod at a time may be evicted: drains proceed, the other replicas keep serving.
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
    }
    return [deployment, service, hpa, pdb]


def storage() -> list[dict]:
    """The model repository volume every replica mounts read-only, on whichever node it runs."""
    return [{
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": MODEL_REPOSITORY_CLAIM, "labels": {"app.kubernetes.io/part-of": "tritonkit"}},
        "spec": {
            # Holds build/ngc_repository and build/ngc_cpu_repository (each variant mounts its own). Replicas spread
            # over nodes: the volume must attach to many nodes at once (NFS, CephFS, cloud file shares, or a PV
            # pre-populated from a snapshot); ReadWriteOnce block volumes cannot do that.
            "accessModes": ["ReadOnlyMany"],
            "resources": {"requests": {"storage": "10Gi"}},
        },
    }]


def _ratio(numerator: str, denominator: str) -> str:
    return f"{numerator}\n/ clamp_min({denominator}, 1e-9)"


def rule_groups(repository: Path = paths.MODEL_REPOSITORY) -> list[dict]:
    """Recording and alerting rules over Triton's own counters (model/version labels; namespace/pod come from the
    PodMonitor's relabelings)."""
    by_model = "sum by (namespace, pod, model)"
    entries = "|".join(entry_models(repository))
    client_requests = f'sum by (namespace, pod) (rate(nv_inference_request_success{{model=~"{entries}"}}[1m]))'
    records = [
        # Mean time a request waited in one model's scheduler queue (µs / request of that model).
        ("tritonkit:queue_us_per_request:rate1m", _ratio(f"{by_model} (rate(nv_inference_queue_duration_us[1m]))",
                                                         f"{by_model} (rate(nv_inference_request_success[1m]))")),
        # Compute time per request, to tell "not enough instances" (queue) from "slow model" (compute).
        ("tritonkit:compute_us_per_request:rate1m",
         _ratio(f"{by_model} (rate(nv_inference_compute_infer_duration_us[1m]))",
                f"{by_model} (rate(nv_inference_request_success[1m]))")),
        ("tritonkit:requests_per_second:rate1m", f"{by_model} (rate(nv_inference_request_success[1m]))"),
        ("tritonkit:failures_per_second:rate1m", f"{by_model} (rate(nv_inference_request_failure[1m]))"),
        # Mean requests per model execution: how well dynamic batching merges.
        ("tritonkit:batch_size:rate1m", _ratio(f"{by_model} (rate(nv_inference_count[1m]))",
                                               f"{by_model} (rate(nv_inference_exec_count[1m]))")),
        # Requests clients sent (entry models only: a step's requests are the same client requests again).
        ("tritonkit:client_requests_per_second:rate1m", client_requests),
        # The HPA metric: queue time one client request spent in all the queues it passed, per pod. An ensemble's
        # own queue counter does not include its steps' queues (Triton 2.51), so every model's queue time is
        # summed and divided by client requests only.
        (QUEUE_RULE, _ratio("sum by (namespace, pod) (rate(nv_inference_queue_duration_us[1m]))", client_requests)),
    ]
    alerts = [
        {"alert": "TritonkitQueueTimeHigh",
         "expr": f"{QUEUE_RULE} > 50000",
         "for": "10m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $labels.pod }}: client requests wait {{ $value | humanize }}µs in queues "
                                    "for 10 min (the HPA is at its maximum or cannot add pods)"}},
        {"alert": "TritonkitRequestFailures",
         "expr": _ratio(f"{by_model} (rate(nv_inference_request_failure[5m]))",
                        f"{by_model} (rate(nv_inference_request_success[5m]) + rate(nv_inference_request_failure[5m]))"
                        ) + " > 0.01",
         "for": "5m",
         "labels": {"severity": "warning"},
         "annotations": {"summary": "{{ $labels.pod }}: over 1 % of requests to {{ $labels.model }} fail"}},
        {"alert": "TritonkitTargetDown",
         "expr": f'up{{job="{SCRAPE_JOB}"}} == 0',
         "for": "5m",
         "labels": {"severity": "critical"},
         "annotations": {"summary": "{{ $labels.pod }}: Prometheus cannot scrape Triton's metrics port"}},
    ]
    return [
        {"name": "tritonkit.rules", "interval": "15s",
         "rules": [{"record": name, "expr": expr} for name, expr in records]},
        {"name": "tritonkit.alerts", "rules": alerts},
    ]


def monitoring(repository: Path = paths.MODEL_REPOSITORY) -> list[dict]:
    """PodMonitor (scrapes every Triton pod, adds the namespace/pod labels the rules group by) and PrometheusRule."""
    labels = {"app.kubernetes.io/part-of": "tritonkit"}
    pod_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "tritonkit", "labels": labels},
        "spec": {
            "selector": {"matchLabels": SERVER_LABELS},
            "podMetricsEndpoints": [{
                "port": "metrics", "path": "/metrics", "interval": "15s",
                # Set here rather than relying on the operator's defaults, which differ between setups.
                "relabelings": [
                    {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "namespace"},
                    {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "pod"},
                    {"targetLabel": "job", "replacement": SCRAPE_JOB},
                ],
            }],
        },
    }
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "tritonkit", "labels": labels},
        "spec": {"groups": rule_groups(repository)},
    }
    return [pod_monitor, rule]


def adapter_values() -> dict:
    """prometheus-adapter Helm values (chart prometheus-community/prometheus-adapter, key `rules.custom`)."""
    return {"rules": {"default": False, "custom": [{
        "seriesQuery": f'{QUEUE_RULE}{{namespace!="",pod!=""}}',
        "resources": {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}},
        "name": {"matches": f"^{QUEUE_RULE}$", "as": QUEUE_METRIC},
        "metricsQuery": "max by (<<.GroupBy>>) (<<.Series>>{<<.LabelMatchers>>})",
    }]}}


# Grafana panels: (title, unit, [(PromQL, legend)]). Recording rules come from rule_groups().
PANELS = [
    ("Requests / s", "reqps", [("tritonkit:requests_per_second:rate1m", "{{pod}} {{model}}")]),
    ("p99 request latency", "µs", [('max by (model) (nv_inference_request_summary_us{quantile="0.99"})',
                                     "{{model}}")]),
    ("Queue vs compute per request", "µs", [
        ("tritonkit:queue_us_per_request:rate1m", "queue {{model}}"),
        ("tritonkit:compute_us_per_request:rate1m", "compute {{model}}"),
    ]),
    ("Queue time per client request (HPA metric)", "µs", [(QUEUE_RULE, "{{pod}}")]),
    ("Requests per model execution (batch size)", "none", [("tritonkit:batch_size:rate1m", "{{model}}")]),
    ("Failures / s", "reqps", [("tritonkit:failures_per_second:rate1m", "{{pod}} {{model}}")]),
    ("Response cache hit rate", "percentunit", [(
        "sum by (model) (rate(nv_cache_num_hits_per_model[5m])) / clamp_min(sum by (model) "
        "(rate(nv_cache_num_hits_per_model[5m]) + rate(nv_cache_num_misses_per_model[5m])), 1e-9)", "{{model}}")]),
    ("Ragged padding waste (embedded ORT backend)", "percentunit", [(
        "sum by (model) (rate(tritonkit_ort_padding_elements_total[5m])) / clamp_min(sum by (model) "
        "(rate(tritonkit_ort_input_elements_total[5m])), 1e-9)", "{{model}}")]),
]
DASHBOARD = DEPLOY / "grafana" / "tritonkit.json"


def dashboard() -> dict:
    panels = []
    for i, (title, unit, targets) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(targets)],
        })
    return {
        "title": "tritonkit / Triton Inference Server", "uid": "tritonkit", "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "tags": ["triton", "tritonkit"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]},
        "panels": panels,
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks; no YAML anchors for repeated label maps."""

    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s
                                                             else None))


def _yaml(docs: list[dict], what: str) -> str:
    header = f"# Generated by `python -m tritonkit.deploy` ({what}); edit tritonkit/deploy.py instead.\n"
    return header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


def _kustomization(resources: list[str], components: list[str] | None = None) -> str:
    doc: dict = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}
    if components:
        doc["components"] = components
    return _yaml([doc], "kustomize entry point")


def outputs() -> dict[Path, str]:
    """Every generated file under deploy/ and its content."""
    files = {
        K8S_DIR / "common" / "kustomization.yaml": _kustomization(["storage.yaml", "monitoring.yaml"]),
        K8S_DIR / "common" / "storage.yaml": _yaml(storage(), "model repository volume"),
        K8S_DIR / "common" / "monitoring.yaml": _yaml(monitoring(), "PodMonitor and PrometheusRule"),
        ADAPTER_VALUES: "# Helm values for prometheus-community/prometheus-adapter: serves the HPA metric.\n"
                        + _yaml([adapter_values()], "prometheus-adapter values").split("\n", 1)[1],
        DASHBOARD: json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n",
    }
    for variant, v in VARIANTS.items():
        files[K8S_DIR / variant / "kustomization.yaml"] = _kustomization(["tritonkit.yaml", "../common"], ["../image"])
        files[K8S_DIR / variant / "tritonkit.yaml"] = _yaml(manifests(v), f"{variant} variant")
    for cpu_class in NFD_CLASSES:  # add one to deploy/k8s/cpu's components to pin its replicas to that class
        files[K8S_DIR / "cpu-class" / cpu_class / "kustomization.yaml"] = _yaml(
            [class_component(cpu_class)], f"CPU variant on {cpu_class} nodes only")
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(paths.ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(paths.ROOT)}")
    if stale:
        print(f"stale: {', '.join(stale)}; run `python -m tritonkit.deploy`")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
