# The two set-up commands: `make serve` (a local PD cluster: router + 1 prefill + 1 decode) and
# `make test` (the suite).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
MODEL  ?= models/kvfence-tiny
PORT   ?= 8000

.PHONY: serve test lint clean

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

lint: $(STAMP)
	$(VENV)/bin/ruff check kvfence tests scripts formal benchmarks

clean:
	rm -rf $(VENV) .pytest_cache
