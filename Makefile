# Set-up and everyday commands. Every target does its own set-up on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench bench-quick clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch pinned exactly: these machines carry the 2.13.0 CPU wheel; a looser pin pulls CUDA builds.
	# pyproject.toml declares ranges; constraints-cpu.txt pins the tested set for every install below
	# --no-compile, then one parallel compileall below: pip compiles each file on one core (23 s of the set-up here)
	$(PY) -m pip install --quiet --no-compile -c constraints-cpu.txt "torch==2.13.0"
	$(PY) -m pip install --quiet --no-compile -c constraints-cpu.txt -e ".[test,torchrec-cpu,torchft]"
	# torchrec without its declared deps: they name the CUDA fbgemm-gpu; the [torchrec-cpu] extra brings the CPU
	# build (fbgemm-gpu-cpu) and the rest. torchrec/fbgemm 1.8 pair with torch 2.13 (README, "Install")
	$(PY) -m pip install --quiet --no-compile -c constraints-cpu.txt --no-deps "torchrec==1.8.0"
	# bytecode for every installed module, on every core (16 s here): each test process imports torch from it
	# (PYTHONDONTWRITEBYTECODE=1, as on these machines, would otherwise compile it again in every process).
	# A file some package ships for another Python (torch's testing/_internal/py312_intrinsics.py) does not
	# compile and is left as source: compileall then exits 1, which is not a failed set-up.
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $(STAMP)

demo: $(STAMP)
	$(PY) tools/train_dlrm.py

# test workers (pytest-xdist): 4 on CI's 2-core machine, as many tests wait on their subprocesses, fsync and
# sleeps (here, 2026-11-29: 423 s of tests with 4 workers, 433-442 s with 3; earlier 409 s with 3, 438 s with 2);
# TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 4

test: $(STAMP)
	CNRSTORE_REQUIRE_TORCHREC=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal

bench: $(STAMP)  # every benchmark, ~30 min on 2 cores: rewrites benchmarks/RESULTS.md and its PNGs
	$(PY) -m pip install --quiet matplotlib  # for the plots only
	$(PY) benchmarks/make_results.py

bench-quick: $(STAMP)  # reduced runs of each, a few minutes: writes benchmarks/RESULTS-quick.md
	$(PY) -m pip install --quiet matplotlib
	$(PY) benchmarks/make_results.py --quick

clean:
	rm -rf $(VENV) build *.egg-info
