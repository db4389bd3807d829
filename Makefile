# Set-up and everyday commands. Every target does its own set-up on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-quick clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch pinned exactly: these machines carry the 2.13.0 CPU wheel; a looser pin pulls CUDA builds
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,torchrec]"
	# torchrec without its declared deps: they name the CUDA fbgemm-gpu; the [torchrec] extra brings the CPU
	# build (fbgemm-gpu-cpu) and the rest. torchrec/fbgemm 1.8 pair with torch 2.13 (README, "TorchRec")
	$(PY) -m pip install --quiet --no-deps "torchrec==1.8.0"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/train_dlrm.py

test: $(STAMP)
	CNRSTORE_REQUIRE_TORCHREC=1 $(PY) -m pytest -q

bench: $(STAMP)  # every benchmark, ~30 min on 2 cores: rewrites benchmarks/RESULTS.md and its PNGs
	$(PY) -m pip install --quiet matplotlib  # for the plots only
	$(PY) benchmarks/make_results.py

bench-quick: $(STAMP)  # reduced runs of each, a few minutes: writes benchmarks/RESULTS-quick.md
	$(PY) -m pip install --quiet matplotlib
	$(PY) benchmarks/make_results.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
