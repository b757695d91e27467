# The two commands the README documents: `make demo` and `make test`. Each creates .venv with
# the pinned versions in constraints.txt (torch 2.13.0 CPU) on a machine with only Python + pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: dev demo test bench fuzz clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

dev: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q tests

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
	rm -rf $(VENV) .pytest_cache .hypothesis
