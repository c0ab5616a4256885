# The set-up commands: `make serve` (a local PD cluster: router + 1 prefill + 1 decode), `make
# test` (the suite) and `make bench` (the README's headline figures beside vLLM, one run).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  ?= models/kvfence-tiny
PORT   ?= 8000

.PHONY: serve test lint bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,mooncake]' || \
		{ echo "mooncake unavailable"; $(PY) -m pip install --quiet -e '.[test]'; }
	$(PY) -m kvfence.model.kernels
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/kvfence up --prefill 1 --decode 1 --model $(MODEL) --port $(PORT) --kv-pool-tokens 65536

# Two parts: the suite in $(TEST_PROCS) processes (whole files to each, so a module's cluster
# starts once), then the tests marked `serial` alone (pyproject.toml says which and why). Both
# run whatever the other's result; either failing fails the target.
TEST_PROCS ?= 2

test: $(STAMP)
	$(PY) -m pytest -n $(TEST_PROCS) --dist loadfile -m 'not serial'; a=$$?; \
		$(PY) -m pytest -m serial; b=$$?; \
		test $$a -eq 0 && test $$b -eq 0

# The headline workloads side by side with vLLM's CPU build (pinned, in a venv of its own, made
# when absent): benchmarks/results/headline.json and .png, the workloads' own JSON under
# benchmarks/results/headline/, and README's table rendered from it. ~30 minutes on 2 cores; run
# it on a quiet machine. BENCH_ARGS=--quick smokes the wiring at tiny sizes into a temp folder
# (and leaves README alone).
VLLM_VENV  ?= /work/vllm-venv
BENCH_ARGS ?=

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	vllm_py=$$(benchmarks/setup_vllm.sh $(VLLM_VENV)) && \
		VLLM_PYTHON=$$vllm_py $(PY) -m benchmarks.headline run $(BENCH_ARGS)
	case "$(BENCH_ARGS)" in *--quick*) ;; *) $(PY) -m benchmarks.headline readme ;; esac

lint: $(STAMP)
	$(VENV)/bin/ruff check kvfence tests scripts formal benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
