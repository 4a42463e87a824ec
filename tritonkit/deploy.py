"""Kubernetes manifests for Triton replicas, rendered from one description so the GPU and CPU variants cannot drift.

`python -m tritonkit.deploy` rewrites `deploy/k8s/{gpu,cpu}.yaml` and the Grafana dashboard; tests check the
committed files equal this output, validate against the Kubernetes schemas, and that every PromQL expression
parses (promtool) and names metrics a real server exports.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import yaml

from tritonkit import paths
from tritonkit.server import CONTROL_HEADER, RESTRICTED_APIS

K8S_DIR = paths.ROOT / "deploy" / "k8s"
QUEUE_METRIC = "tritonkit_queue_us_per_request"
EXIT_TIMEOUT_S = 30


@dataclass(frozen=True)
class Variant:
    name: str
    cpu: str
    memory: str
    gpus: int
    # HPA target: mean queue time per request (µs) a pod may show before another replica is added.
    queue_target_us: int
    max_replicas: int


VARIANTS = {
    # A GPU replica absorbs bursts fast; scale before queueing reaches a few ms of a ~20 ms budget.
    "gpu": Variant("tritonkit", cpu="4", memory="12Gi", gpus=1, queue_target_us=5_000, max_replicas=8),
    # CPU replicas compute slower, so a larger share of the budget is queue before a new pod pays off.
    "cpu": Variant("tritonkit-cpu", cpu="4", memory="6Gi", gpus=0, queue_target_us=20_000, max_replicas=16),
}


def manifests(v: Variant, image: str = "tritonkit-tritonserver:24.10") -> list[dict]:
    labels = {"app.kubernetes.io/name": v.name, "app.kubernetes.io/part-of": "tritonkit"}
    resources = {"requests": {"cpu": v.cpu, "memory": v.memory}, "limits": {"memory": v.memory}}
    if v.gpus:
        resources["requests"]["nvidia.com/gpu"] = v.gpus
        resources["limits"]["nvidia.com/gpu"] = v.gpus
    restricted = f"{RESTRICTED_APIS}:{CONTROL_HEADER}=$(TRITONKIT_CONTROL_KEY)"
    container = {
        "name": "tritonserver",
        "image": image,
        "args": [
            "--model-control-mode=none",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            "--metrics-config=summary_latencies=true",
            f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}",
        ],
        "env": [
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
            {"name": "model-repository", "mountPath": "/models", "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": v.name, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "8002",
                                    "prometheus.io/path": "/metrics"},
                },
                "spec": {
                    # preStop + Triton's exit timeout must fit, or in-flight requests are cut.
                    "terminationGracePeriodSeconds": EXIT_TIMEOUT_S + 30,
                    "containers": [container],
                    "volumes": [
                        # Filled by a Job running `make build-engines` (or `make build` for CPU) into the claim.
                        {"name": "model-repository",
                         "persistentVolumeClaim": {"claimName": "tritonkit-model-repository", "readOnly": True}},
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
            "minReplicas": 1,
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
        "spec": {"minAvailable": 1, "selector": {"matchLabels": labels}},
    }
    return [deployment, service, hpa, pdb]


# Grafana panels: (title, unit, [(PromQL, legend)]). Recording rules come from deploy/prometheus/rules.yml.
PANELS = [
    ("Requests / s", "reqps", [("tritonkit:requests_per_second:rate1m", "{{pod}} {{model}}")]),
    ("p99 request latency", "µs", [('max by (model) (nv_inference_request_summary_us{quantile="0.99"})',
                                     "{{model}}")]),
    ("Queue vs compute per request", "µs", [
        ("tritonkit:queue_us_per_request:rate1m", "queue {{model}}"),
        ("tritonkit:compute_us_per_request:rate1m", "compute {{model}}"),
    ]),
    ("Pod queue time per request (HPA metric)", "µs", [("tritonkit:pod_queue_us_per_request:rate1m", "{{pod}}")]),
    ("Requests per model execution (batch size)", "none", [("tritonkit:batch_size:rate1m", "{{model}}")]),
    ("Failures / s", "reqps", [("tritonkit:failures_per_second:rate1m", "{{pod}} {{model}}")]),
    ("Response cache hit rate", "percentunit", [(
        "sum by (model) (rate(nv_cache_num_hits_per_model[5m])) / clamp_min(sum by (model) "
        "(rate(nv_cache_num_hits_per_model[5m]) + rate(nv_cache_num_misses_per_model[5m])), 1e-9)", "{{model}}")]),
    ("Ragged padding waste (embedded ORT backend)", "percentunit", [(
        "sum by (model) (rate(tritonkit_ort_padding_elements_total[5m])) / clamp_min(sum by (model) "
        "(rate(tritonkit_ort_input_elements_total[5m])), 1e-9)", "{{model}}")]),
]
DASHBOARD = paths.ROOT / "deploy" / "grafana" / "tritonkit.json"


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


def render_dashboard() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def render(variant: str) -> str:
    header = (f"# Generated by `python -m tritonkit.deploy` ({variant} variant); edit tritonkit/deploy.py instead.\n"
              "# Needs: a PVC `tritonkit-model-repository` holding model_repository/, a Secret\n"
              "# `tritonkit-control-key` (key: key), and prometheus-adapter with deploy/k8s/prometheus-adapter.yaml.\n")
    return header + yaml.safe_dump_all(manifests(VARIANTS[variant]), sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed files differ")
    args = parser.parse_args(argv)
    stale = []
    outputs = [(K8S_DIR / f"{variant}.yaml", render(variant)) for variant in VARIANTS]
    for path, text in [*outputs, (DASHBOARD, render_dashboard())]:
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
