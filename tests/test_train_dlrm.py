"""tools/train_dlrm.py, the reference trainer `make demo` runs: end to end, in a subprocess.

The ``--torchrec`` cases need torchrec (the ``[torchrec-cpu]`` extra): skipped without it, unless
CNRSTORE_REQUIRE_TORCHREC=1 (``make test``) makes a missing torchrec a failure.
"""

import importlib.util
import os
import re
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools")
TOOL = os.path.join(TOOLS, "train_dlrm.py")
requires_torchrec = pytest.mark.skipif(
    os.environ.get("CNRSTORE_REQUIRE_TORCHREC") != "1" and importlib.util.find_spec("torchrec") is None,
    reason="torchrec is not installed (pip install 'cnrstore[torchrec-cpu]', see README)")


def run(*args):
    proc = subprocess.run([sys.executable, TOOL, "--quick", "--no-progress", *args], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def field(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label):].split()


#: The lossless runs' size: two failures (steps 40, 80), each restoring a baseline and its increments. Bit-exact
#: reproduction depends on none of the sizes, so the run is small: 90 steps of 128 samples, tables capped at 3000
#: rows, one held-out batch (the int4 run below, whose checks are about learning, keeps --quick's size).
SMALL = ("--steps", "90", "--ckpt-every", "15", "--fail-every", "40", "--batch-size", "128", "--max-rows", "3000",
         "--holdout-batches", "1")


def test_lossless_failures_and_restores_reproduce_the_uninterrupted_run():
    out = run("--codec", "fp32", "--mode", "incremental", *SMALL)
    assert "backend cnrstore Checkpointer" in out
    failures = int(field(out, "checkpoints written / failures")[2])
    assert failures >= 2
    assert field(out, "max |weight diff| vs no failures")[0] == "0"
    logloss = field(out, "final holdout logloss")
    assert logloss[0] == logloss[1]


def test_int4_intermittent_run_learns_and_writes_less_than_torch_save():
    # no run without failures to compare with (--no-compare): the checks are the run's own learning and bytes
    out = run("--codec", "int4", "--mode", "intermittent", "--steps", "150", "--holdout-batches", "2", "--no-compare")
    auc_start = float(re.search(r"step 0: [0-9.]+/([0-9.]+)", out).group(1))
    assert int(field(out, "checkpoints written / failures")[2]) >= 2
    auc_end = float(field(out, "final holdout logloss / AUC")[2])
    assert auc_end > auc_start + 0.1 and auc_end > 0.65
    share = float(re.search(r"\(([0-9.]+)% of it\)", out).group(1))
    assert share < 50  # bytes per checkpoint against a full torch.save of the same state


@requires_torchrec
def test_torchrec_model_computes_what_the_plain_model_computes():
    sys.path.insert(0, TOOLS)
    try:
        import torch

        import dlrm_model
        import train_dlrm
    finally:
        sys.path.remove(TOOLS)
    args = train_dlrm.parse_args(["--quick", "--max-rows", "3000", "--batch-size", "64"])
    plain = dlrm_model.build_model(args, 5)
    args.torchrec = True
    model = dlrm_model.make_model(args, 5)
    assert type(model).__name__ == "TorchRecDLRM"
    dense, ids, labels = dlrm_model.SyntheticCriteo(args).batch(3)
    logits = [m(dense, ids) for m in (plain, model)]
    assert torch.equal(*logits)   # same init, same lookups and interaction: bit for bit
    for m, lg in zip((plain, model), logits):
        torch.nn.functional.binary_cross_entropy_with_logits(lg, labels).backward()
    for t, emb in enumerate(plain.embs):
        assert torch.equal(emb.weight.grad, model.ebc.embedding_bags[f"t{t}"].weight.grad)
    assert torch.equal(plain.top[0].weight.grad, model.top[0].weight.grad)


@requires_torchrec
def test_torchrec_lossless_failures_and_restores_reproduce_the_uninterrupted_run():
    out = run("--torchrec", "--codec", "fp32", "--mode", "incremental", *SMALL)
    assert "a torchrec EmbeddingBagCollection of 26 tables" in out and "backend cnrstore Checkpointer" in out
    assert int(field(out, "checkpoints written / failures")[2]) >= 2
    assert field(out, "max |weight diff| vs no failures")[0] == "0"
    logloss = field(out, "final holdout logloss")
    assert logloss[0] == logloss[1]
