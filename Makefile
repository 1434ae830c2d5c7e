# The two commands README.md promises: `make run` (serve on a local Ray) and `make test`.
VENV ?= .venv
PROMPT ?= Write a haiku about paged memory.

.PHONY: setup run generate test lint bench bench-serving bench-serving-peers bench-soak bench-lm-eval protos device-wheels device-rehearsal

setup:
	./scripts/setup.sh

run: setup
	$(VENV)/bin/kvserve serve

generate: setup
	$(VENV)/bin/kvserve generate "$(PROMPT)" --max-tokens 64

test: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m pytest -q --durations=15 --timeout=120 --max-suite-minutes=35 --max-memory-gb=12 tests

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: setup
	bash bench/setup_vllm.sh
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench.offline

bench-serving: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench.serving

bench-serving-peers: setup
	bash bench/setup_vllm.sh
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench.serving_peers

bench-soak: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench.soak

# lm-eval's loglikelihood path against `kvserve serve`, checked against HF fp32. lm-eval is
# no kvserve dependency: `$(VENV)/bin/pip install lm_eval torch==2.13.0` first.
bench-lm-eval: setup
	HF_HUB_OFFLINE=1 $(VENV)/bin/python -m bench.lm_eval_loglikelihood

# The GPU kit (README "Running on a GPU"): .whl/ and .device/ for the GPU machine, then
# the GPU run rehearsed on this CPU in a venv of the GPU image's versions (about 6 minutes
# the first time, 3 after).
device-wheels: setup
	bash scripts/device_wheels.sh

device-rehearsal: device-wheels
	bash scripts/device_check.sh --rehearse

# Regenerate the gRPC modules from router/api/protos/kvserve.proto (tests fail when they are stale).
protos: setup
	$(VENV)/bin/python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. router/api/protos/kvserve.proto
