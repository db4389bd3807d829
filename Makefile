# Set-up and everyday commands. Every target does its own set-up on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch pinned exactly: these machines carry the 2.13.0 CPU wheel; a looser pin pulls CUDA builds
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/train_dlrm.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install --quiet matplotlib  # for bench_policies' plot only
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_codecs.py
	$(PY) benchmarks/bench_policies.py --plot benchmarks/policies.png

clean:
	rm -rf $(VENV) build *.egg-info
