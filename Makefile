# The two commands the README documents: `make demo` and `make test`. Each creates its own venv
# with the pinned versions in constraints.txt (torch 2.13.0 CPU) on a machine with only Python +
# pip: .venv-demo holds what the demo needs (the `demo` extra), .venv everything the tests need
# (the `dev` extra: every framework, the test tools, the docs tooling).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_VENV := .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed

.PHONY: dev demo test docs bench fuzz clean

$(STAMP): pyproject.toml constraints.txt
	@echo "Installing ckptshim and everything its tests use into $(VENV): torch 2.13.0 (CPU), jax,"
	@echo "flax, orbax-checkpoint, transformers, DeepSpeed (built from its sdist), Lightning, torchao,"
	@echo "pytest, mkdocs-material, playwright. About 5 to 8 minutes the first time (from pip's cache)."
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

$(DEMO_STAMP): pyproject.toml constraints.txt
	@echo "Installing what the demo needs into $(DEMO_VENV): torch 2.13.0 (CPU), jax, flax,"
	@echo "orbax-checkpoint, tensorstore, transformers, safetensors. About 3 to 5 minutes the first time"
	@echo "(from pip's cache); later runs start at once."
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet -c constraints.txt --upgrade pip
	$(DEMO_VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[demo]'
	touch $(DEMO_STAMP)

dev: $(STAMP)

demo: $(DEMO_STAMP)
	@echo "Running examples/demo.py: eight stories, about a minute."
	$(DEMO_VENV)/bin/python examples/demo.py

# Two pytest-xdist workers, each taking whole test files (a module's fixtures, such as DeepSpeed's
# saved engines, are built once): most tests wait on child processes, servers or pip, so two
# workers on two cores take about half the time of one. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# The documentation site, as published, in site/ (tests/test_docs.py builds it too, and checks
# each page's layout in headless Chromium).
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) bench/bench_import.py
	$(PY) bench/bench_plan.py

# Every byte parser fuzzed for FUZZ_SECONDS each (see bench/README.md); atheris (libFuzzer) is
# installed here, on demand, not by `make dev`. Example: make fuzz FUZZ_SECONDS=60 FUZZ=safetensors
FUZZ_SECONDS ?= 300
FUZZ ?=
fuzz: $(STAMP)
	$(PY) -m pip install --quiet atheris==2.3.0
	$(PY) bench/fuzz.py --seconds $(FUZZ_SECONDS) $(FUZZ)

clean:
	rm -rf $(VENV) $(DEMO_VENV) site .pytest_cache .hypothesis
