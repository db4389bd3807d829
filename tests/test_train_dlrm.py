"""tools/train_dlrm.py, the reference trainer `make demo` runs: end to end, in a subprocess."""

import os
import re
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "train_dlrm.py")


def run(*args):
    proc = subprocess.run([sys.executable, TOOL, "--quick", "--no-progress", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def field(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label):].split()


def test_lossless_failures_and_restores_reproduce_the_uninterrupted_run():
    out = run("--codec", "fp32", "--mode", "incremental", "--steps", "150")
    assert "backend cnrstore Checkpointer" in out
    failures = int(field(out, "checkpoints written / failures")[2])
    assert failures >= 2
    assert field(out, "max |weight diff| vs no failures")[0] == "0"
    logloss = field(out, "final holdout logloss")
    assert logloss[0] == logloss[1]


def test_int4_intermittent_run_learns_and_writes_less_than_torch_save():
    out = run("--steps", "150")
    auc_start = float(re.search(r"step 0: [0-9.]+/([0-9.]+)", out).group(1))
    auc_end = float(field(out, "final holdout AUC")[0])
    assert auc_end > auc_start + 0.1 and auc_end > 0.65
    share = float(re.search(r"\(([0-9.]+)% of it\)", out).group(1))
    assert share < 50  # bytes per checkpoint against a full torch.save of the same state
