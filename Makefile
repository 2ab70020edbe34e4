# Two commands matter on a fresh machine: `make run` and `make test`. Both install first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
PROTO_SRC := proto/kvindex/v1/kvindex.proto

.PHONY: install install-bench proto run test bench soak sample-log lint fmt clean

$(STAMP): pyproject.toml
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
	$(PY) -m kvindex.demo $(ARGS)

serve: $(STAMP)
	$(VENV)/bin/kvindex serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_index.py
	$(PY) benchmarks/bench_score.py

# Hundreds of randomized fault schedules, then sustained load (see kvindex/testing/soak.py for knobs).
soak: $(STAMP)
	$(PY) -m kvindex.testing.soak $(ARGS)

# A ten-second event log of a simulated fleet with a flaky worker (docs/capture.md), then its replay.
sample-log: $(STAMP)
	$(PY) -m kvindex.capture.sample --out docs/sample.kvlog --query-out docs/sample-prompt.json
	$(VENV)/bin/kvindex replay docs/sample.kvlog --query docs/sample-prompt.json

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

fmt: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
