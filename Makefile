# One entry point for users and CI. `make demo` and `make test` work on a fresh Debian 12 machine
# with Python 3.11: they create .venv and install everything they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch 2.13.0 (an unpinned torch would pull a multi-GB CUDA build). GPU users
# install their own torch first; the project itself only requires torch>=2.6.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv sysdeps demo test test-fast lint format bench bench-tier0 soak clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# Real services the tests run: Ceph RADOS Gateway (S3). Installed with apt when missing (CI runs as root).
sysdeps:
	scripts/install-system-deps.sh

demo: venv
	PYTHONWARNINGS=ignore $(BIN)/pretrain demo --workdir runs/demo

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# pytest-xdist workers: one more than the CPUs. The suite waits on timeouts, restarts and services
# (23 min with one worker, 13.5 with two and a standby process shared by each worker's jobs): with
# two on this 2-core machine the CPUs were 78 % busy, and a third worker took the full suite from
# 1,452-1,480 s to 1,283 s and test-fast from 252 s to 189 s (docs/testing.md). Tests that share a
# machine-wide service run on one worker per service, in turn (tests/leftover_guard.py). At 4
# CPUs and more (nproc counts the host's where a cgroup quota allows fewer) as many workers as
# CPUs: each keeps a standby process, and the tests with timing assertions run beside them.
# `TEST_WORKERS=N` overrides it; `TEST_WORKERS=1` runs everything in turn.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n + 1 : n )))
PYTEST := PYTHONWARNINGS=ignore $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --durations=30
# pytest's wall time with the machine it ran on (CPU count, load average at the end), pytest's exit code kept.
TIMED = start=$$(date +%s); $(PYTEST) $(1); rc=$$?; \
	echo "$(2): pytest took $$(( $$(date +%s) - start )) s on $$(nproc) CPUs, load average $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	exit $$rc

test: venv sysdeps lint
	@$(call TIMED,tests,make test)

test-fast: venv
	@$(call TIMED,tests -m "not slow",make test-fast)

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Speed targets as ratios measured side by side (not part of make test): ~300 MB and ~2 GB states,
# writes bench/results/<date>.json and .png. Takes several minutes.
bench: venv sysdeps
	scripts/bench.sh

# Tier 0 against raw tmpfs reads/writes of the same bytes (docs/memory-tier.md); a minute or two.
bench-tier0: venv
	$(BIN)/python -m bench.memory_tier_numbers --sizes-mb 300 --repeats 5 > bench/results/tier0-$$(date -u +%F).json

# The long soak (docs/soak.md): >= 50 random faults covering every kind against the tiny config and a
# fault-free baseline; an hour or more on 2 cores. The report is copied to bench/results/. The kind
# s3-unreachable needs an object store to cut off: a throwaway Ceph RGW (scripts/ceph/with-rgw.sh,
# stopped whatever happens). The uploaders promote every staged step: one every 200 steps keeps both
# runs' ~5.6 MB steps (2 x 60) within the RGW's 6 GB memory store.
# Faults are paced in seconds: the run must train through 54 gaps of 30 s on average (the tiny config
# trains ~21 steps/s here; 45000 steps leave two standard deviations of the gaps' sum to spare).
SOAK_ARGS ?= --faults 54 --mtti 30 --seed 1 --steps 45000
SOAK_S3 = --set checkpoint.s3.uri=s3://$$RGW_BUCKET/soak --set checkpoint.s3.endpoint_url=$$S3_ENDPOINT_URL \
	--set checkpoint.reshardable.interval=200 --set checkpoint.s3.interval=200
soak: venv sysdeps
	PYTHON=$(BIN)/python scripts/ceph/with-rgw.sh sh -c \
	  'PYTHONWARNINGS=ignore $(BIN)/pretrain soak $(SOAK_ARGS) --workdir runs/soak-long $(SOAK_S3)'
	cp runs/soak-long/soak-report.json bench/results/soak-$$(date -u +%F).json
	cp runs/soak-long/soak-report.md bench/results/soak-$$(date -u +%F).md

# The prepared single-GPU check (tests/gpu/, one JSON report): on the GPU machine, with wheels/
# carried from `make gpu-wheels`; `make gpu-check GPU_CHECK_ARGS=--cpu` is the CPU dry run that
# make test also runs (tests/test_gpu_check_dry_run.py). See docs/gpu-check.md.
gpu-check:
	scripts/gpu-check.sh $(GPU_CHECK_ARGS)

# cp312 manylinux wheels of the newest megatron-core and NVRx (+ what the GPU machine lacks) into
# wheels/ (git-ignored), sizes printed, at most 64 MiB.
gpu-wheels: venv
	PYTHON=$(BIN)/python scripts/fetch-gpu-wheels.sh

clean:
	rm -rf runs .pytest_cache .ruff_cache .gpu-check gpu-check-report.json
