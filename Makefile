# tritonkit — `make` lists the targets. Every target runs from any shell; the venv is used explicitly.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PY := .venv/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
PYTEST_ARGS ?=

.PHONY: help setup lock demo serve build int8-search add-model build-engines serve-docker gateway manifests perf tune lint test test-all test-zoo check-configs check-cpu-classes clean

help: ## list targets with one-line help
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

setup: ## install apt + pinned Python deps into .venv and prepare the server backend dir (idempotent)
	@scripts/setup.sh

lock: ## re-pin requirements.txt's dependencies into requirements.lock with hashes (UPGRADE=1: newest allowed)
	@scripts/lock.sh

demo: ## build what it serves (served INT8 form; TensorRT forms come with build-engines), serve both pipelines, embed + rank texts, classify photos, stop
	@$(PY) scripts/demo.py

serve: ## start the embedded tritonserver on 127.0.0.1 (HTTP_PORT/GRPC_PORT/METRICS_PORT, PROFILE=name); Ctrl-C stops
	@scripts/serve --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) \
		$(if $(PROFILE),--profile $(PROFILE))

build: ## every spec (or MODEL=name): export ONNX, INT8 from its committed recipe (searched if none, in MINUTES=15 per model), reports, configs
	@$(PY) -m tritonkit.build $(or $(MODEL),all) $(if $(MINUTES),--budget-minutes $(MINUTES))

int8-search: ## re-run the accuracy-aware INT8 search for MODEL=name [MINUTES=cap of the whole build that searches, both forms: default 15, 0 none] [FORM=served|tensorrt] [FRESH=1: do not judge the committed candidates first] (rewrites models/<name>.int8.json; commit it)
	@test -n "$(MODEL)" || { echo "usage: make int8-search MODEL=<name> [MINUTES=n] [FORM=served|tensorrt]" >&2; exit 2; }
	@$(PY) -m tritonkit.build $(MODEL) --search $(if $(MINUTES),--budget-minutes $(MINUTES)) $(if $(FORM),--form $(FORM)) $(if $(FRESH),--fresh)

add-model: ## write a spec: KIND=text-embedding NAME=x SOURCE=dir (see python -m tritonkit.add --help)
	@test -n "$(KIND)" -a -n "$(NAME)" -a -n "$(SOURCE)" || { echo "usage: make add-model KIND=text-embedding NAME=<name> SOURCE=<dir>" >&2; exit 2; }
	@$(PY) -m tritonkit.add $(KIND) --name $(NAME) --source $(SOURCE)

build-engines: build ## `build`, then TensorRT INT8/FP16 plans + their configs where TensorRT and a GPU exist
	@$(PY) -m tritonkit.tensorrt.engines

serve-docker: ## serve the generated NGC view (build/ngc_repository) in the NGC tritonserver container (Docker + NVIDIA runtime)
	@docker info >/dev/null 2>&1 || { echo "error: no Docker engine reachable; use \`make serve\` (embedded server)" >&2; exit 2; }
	@$(PY) -m tritonkit.repository.variants ngc
	HTTP_PORT=$(HTTP_PORT) GRPC_PORT=$(GRPC_PORT) METRICS_PORT=$(METRICS_PORT) docker compose -f docker/compose.yaml up --build

perf: ## perf lab: sweeps + baselines → perf/results/<stamp>/ (CSV, JSON, MD, PNG); MODEL=name (default both first), QUICK=1
	@$(PY) perf/lab.py $(if $(QUICK),--quick) $(if $(MODEL),--pipelines $(MODEL))

perf-peers: ## perf lab with peers in their best form for this CPU (Infinity, sentence-transformers qint8 / OpenVINO FP32 / NNCF INT8), venvs installed from perf/peers/*.lock; fails if one cannot be had; MODEL=name (default text), QUICK=1, SKIP='infinity ...'
	@$(PY) perf/lab.py --peers $(if $(QUICK),--quick) --pipelines $(or $(MODEL),text) $(if $(SKIP),--skip-peer '$(SKIP)')

tune: ## config search under a p99 budget: MODEL=text_embedding P99_MS=50 [PROFILE=tuned MINUTES=15]
	@test -n "$(MODEL)" -a -n "$(P99_MS)" || { echo "usage: make tune MODEL=<ensemble> P99_MS=<ms> [PROFILE=name]" >&2; exit 2; }
	@$(PY) -m tritonkit.perf.tune $(MODEL) --p99-ms $(P99_MS) --profile $(or $(PROFILE),tuned) --minutes $(or $(MINUTES),15)

gateway: ## OpenAI-compatible POST /v1/embeddings on 127.0.0.1:8080 in front of a running server's gRPC port
	@$(PY) -m tritonkit_client.gateway --port 8080 --triton 127.0.0.1:$(GRPC_PORT)

manifests: ## re-render deploy/ (kustomize bases, monitoring, Helm values, Grafana) from tritonkit/deploy.py
	@$(PY) -m tritonkit.deploy

check-configs: ## generated configs match their specs; every config.pbtxt valid against Triton's schema, ensembles too
	@$(PY) -m tritonkit.repository.generate --check && $(PY) -m tritonkit.repository.config
check-native: ## generate the NGC views (build/ngc_repository, build/ngc_cpu_repository) + check Triton's native load rules
	@rc=0; for c in "native_check model_repository --view embedded --skip-unbuilt" "variants ngc" "variants ngc --cpu"; do $(PY) -m tritonkit.repository.$$c || rc=1; done; exit $$rc
check-cpu-classes: ## each built INT8 file run on an AVX2 CPU's own kernels (natively on such a host, else qemu-user; numerics): static INT8 must compute what it computes here, run-time quantized INT8 must keep its gates; MODEL=name, ROWS=16
	@$(PY) -m tritonkit.int8.emulated check $(MODEL) $(if $(ROWS),--rows $(ROWS))
build-engines-docker: ## TensorRT plans built inside the NGC image that serves them (TRITONKIT_NGC_RELEASE; needs Docker + GPU)
	@scripts/build-engines-docker

lint: ## ruff over the whole project
	@$(PY) -m ruff check .

# pytest's "no tests collected" (5) must fail, never pass silently.
define run_pytest
	@set +e; $(PY) -m pytest $(1) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "error: pytest collected no tests" >&2; exit 1; fi; exit $$rc
endef

# The quick tier's tests mostly wait on servers they start: two workers, a test file each (its servers are per file).
test: lint ## lint, then the quick tier (not slow) against real tritonserver instances with tiny models, in 2 processes
	$(call run_pytest,-m "not slow" -n 2 --dist loadfile)

test-all: lint ## lint, then every test (CI): the quick tier plus real model builds, the perf gate and the soak
	$(call run_pytest,-m "not zoo")

test-zoo: ## the larger pretrained specs (all-mpnet-base-v2, EfficientNet-Lite1): build, serve, compare with PyTorch
	$(call run_pytest,-m zoo)

clean: ## remove build outputs (model artefacts, backend dir); keeps .venv
	rm -rf .build build/artifacts perf/results
	find model_repository -path '*/[0-9]*/*.onnx' -delete
