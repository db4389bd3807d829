"""tools/train_dlrm.py --world-size 2: a spawned gloo job with one rank killed (SIGKILL) and replaced,
end to end in a subprocess, under full, partial (CPR) and ECRM recovery; the same with ``--torchrec`` (a
DistributedModelParallel model) under full and partial recovery. The ``--torchrec`` jobs need torchrec: skipped
without it, unless CNRSTORE_REQUIRE_TORCHREC=1 (``make test``) makes a missing torchrec a failure."""

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings

import pytest

from support.s3_remote import s3_options

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "train_dlrm.py")
requires_torchrec = pytest.mark.skipif(
    os.environ.get("CNRSTORE_REQUIRE_TORCHREC") != "1" and importlib.util.find_spec("torchrec") is None,
    reason="torchrec is not installed (pip install 'cnrstore[torchrec-cpu]', see README)")
# 80 steps, a checkpoint every 20, one failure at step 50 (rank 1): the newest global version is step 40
# The process groups' timeout (3600 s) is far beyond the job's (150 s): a recovery that waited it out
# instead of learning of the failure from the failure board or a failed collective fails the test.
SHORT = ("--world-size", "2", "--quick", "--no-progress", "--steps", "80", "--fail-every", "50",
         "--holdout-batches", "2", "--job-timeout", "150", "--pg-timeout", "3600")
TOOLS = os.path.dirname(TOOL)


def run(*args):
    proc = subprocess.run([sys.executable, TOOL, *SHORT, *args], capture_output=True, text=True, timeout=200,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def field(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label):].split()


def recovery_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip().startswith("recovery #")]
    assert len(lines) == 1, out
    phases = [line for line in out.splitlines() if line.strip().startswith("kill to training, by phase")]
    # board / collective: a PeerFailure; gloo: gloo's own error from a collective the failures module does
    # not wrap (torchrec's inside a DMP model). None of them is a timeout: the job's own (150 s) is shorter.
    how = re.search(r"detect [0-9.]+ s \(([a-z/]+)\)", phases[0])
    assert len(phases) == 1 and how and set(how.group(1).split("/")) <= {"board", "collective", "gloo"}, out
    return lines[0]


def assert_exact_full_recovery(out: str) -> None:
    """Rank 1 killed at step 50, every rank restored step 40 and re-computed 10 steps: with lossless
    checkpoints the run ends with the same weights and metrics as the run without failures."""
    line = recovery_line(out)
    assert "at step 50" in line and "all ranks restored step 40; 10 steps re-computed" in line, line
    assert field(out, "max |weight diff| vs no failures")[0] == "0"
    logloss = field(out, "final holdout logloss")
    assert logloss[0] == logloss[1]
    assert float(field(out, "final holdout AUC")[0]) > 0.65


def assert_partial_recovery_still_learns(out: str) -> None:
    """Only rank 1 restored (global version 2, step 40); it lost 10 of 80 steps of its half of the rows,
    about 6.25% of the updates; the model still learns."""
    line = recovery_line(out)
    assert "at step 50" in line and "rank 1 restored global version 2 (step 40); 10 steps of its updates lost" \
        in line, line
    assert abs(float(field(out, "lost updates (estimate)")[0].rstrip("%")) - 6.25) < 0.01
    ll, auc = (float(x) for x in field(out, "final holdout logloss / AUC")[::2])
    auc_start = float(re.search(r"step 0: [0-9.]+/([0-9.]+)", out).group(1))
    assert auc > 0.65 and auc > auc_start + 0.1 and ll < 0.6, out


def test_full_recovery_of_a_killed_rank_reproduces_the_run_without_failures():
    out = run("--recovery", "full", "--codec", "fp32", "--mode", "incremental")
    assert field(out, "saves per rank (priority saves) / failures")[-1] == "1"
    assert float(field(out, "time lost to failures")[0]) > 0
    assert_exact_full_recovery(out)


def test_partial_recovery_from_a_bucket_restores_only_the_killed_rank_and_the_model_still_learns(s3_endpoint,
                                                                                                   s3_bucket):
    """The same job with its checkpoints in a bucket (moto): each rank a node directory of its own, the killed
    rank's replacement an empty one, as a fresh machine; it restores its shards from the bucket alone."""
    out = run("--recovery", "partial", "--no-compare", "--remote", f"s3://{s3_bucket}/dlrm",
              "--remote-options", json.dumps(s3_options(s3_endpoint)))
    assert f"root in s3://{s3_bucket}/dlrm" in out
    assert_partial_recovery_still_learns(out)


def test_ecrm_recovery_of_a_killed_rank_loses_nothing():
    # 2 ranks: k=1, r=1 (each rank holds the other's shard as parity); a real SIGKILL at step 50
    out = run("--recovery", "ecrm", "--parity", "1,1")
    line = recovery_line(out)
    # with ECRM's overlap (docs/DESIGN.md) the killed rank's last step may die with its messages unsent:
    # the survivors then decode the step before and redo it, losing nothing either way
    decoded = re.search(r"rank 1 decoded at step (\d+) \(ecrm\); (\d+) step\(s\) redone", line)
    assert "at step 50" in line and decoded, line
    assert int(decoded.group(1)) in (49, 50) and int(decoded.group(1)) + int(decoded.group(2)) == 50, line
    assert field(out, "lost updates")[0] == "0"
    assert field(out, "max |weight diff| vs no failures")[0] == "0"
    logloss = field(out, "final holdout logloss")
    assert logloss[0] == logloss[1]
    mem = field(out, "parity memory per rank (rank 0)")
    assert 100 <= int(mem[2].rstrip("%")) <= 103, mem   # k=1: a copy of the other rank's shard (+ padding)


def tool_main(capsys, *args) -> tuple[int, str]:
    """``train_dlrm.main`` in this process (the refusals below start no job: a subprocess would only add an
    interpreter importing torch and torchrec, ~4 s each): its exit status and what it printed."""
    capsys.readouterr()
    sys.path.insert(0, TOOLS)  # (main imports dlrm_dist, beside it, when called)
    try:
        import train_dlrm

        with warnings.catch_warnings():  # (--torchrec's quiet_torchrec filters warnings: kept to this call)
            rc = train_dlrm.main([*SHORT, *args])
    finally:
        sys.path.remove(TOOLS)
    out = capsys.readouterr()
    return rc, (out.out + out.err).strip()


def test_ecrm_parity_that_does_not_fit_the_world_is_refused(capsys):
    rc, out = tool_main(capsys, "--recovery", "ecrm", "--parity", "2,1")
    assert rc != 0 and "K + R <= --world-size (2)" in out, (rc, out)


@requires_torchrec
def test_torchrec_full_recovery_of_a_killed_rank_reproduces_the_run_without_failures():
    # a DistributedModelParallel model, its tables placed whole by torchrec's planner
    out = run("--torchrec", "--sharding", "table", "--recovery", "full", "--codec", "fp32", "--mode", "incremental")
    assert "torchrec DistributedModelParallel, table-wise sharding" in out
    assert_exact_full_recovery(out)   # lossless shards and fused optimizer state: the same weights exactly


@requires_torchrec
def test_torchrec_partial_recovery_restores_only_the_killed_rank_and_the_model_still_learns():
    out = run("--torchrec", "--recovery", "partial", "--no-compare")
    assert "torchrec DistributedModelParallel, row-wise sharding" in out
    rows = [int(n.rstrip(",")) for n in field(out, "torchrec's plan:")[:2]]
    assert abs(rows[0] - rows[1]) <= 26, rows   # row-wise: every table cut in two near-equal halves
    assert_partial_recovery_still_learns(out)


def test_torchrec_with_ecrm_recovery_is_refused(capsys):
    rc, err = tool_main(capsys, "--torchrec", "--recovery", "ecrm")
    assert rc == 2 and err.count("\n") == 0 and "ECRM protects nn.Embedding shards only" in err, err
