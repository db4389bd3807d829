"""benchmarks/bench_dynamic.py (issue 50's benchmark) runs in its quick mode, checks every restore against its
emulated trainer's state, and reports the issue's targets."""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "bench_dynamic.py")


def test_bench_dynamic_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(HERE, ".."))
    # (128 partitions: a merging save rewrites a small share of the table, within the merge budget; at the
    # default 16 a merge of one partition is 6% of the table, more than 0.2 of a save's changes)
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--partitions", "128", "--dir", str(tmp_path),
                           "--out", str(tmp_path / "r.md")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (tmp_path / "r.md").read_text()
    assert "all exact" in md  # every restore equal to the emulator's state (the run exits 1 otherwise)
    for method in ("cnrstore keyed", "DCP full dump", "dynamicemb-style"):
        assert method in md
    # the writer buffers a save's puts and evictions: one record per partition, a save's bytes its changes' and
    # the merges within the budget
    assert "target <= 1.2x: **met**" in md
    assert re.search(r"compacted 1\.00\dx \*\*met\*\*", md)  # a reader of a partition range reads what it owns
    # the follower's part (a spawned process following a small keyed table into a KeyedReplica): every version
    # followed, no evicted id found after the update that evicted it, sampled rows bit for bit, the final
    # replica equal to the trainer's state (the run exits 1 otherwise)
    assert "versions followed: 3 of 3" in md and "**0 stale reads**" in md and ", 0 wrong rows" in md
    assert "equal to the trainer's state: yes" in md and "never an evicted id's old vector: **met**" in md
    assert "| local store, keyed table with evictions |" in md
    assert os.listdir(tmp_path) == ["r.md"]  # the stores and dumps were removed
    help_text = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, env=env)
    assert help_text.returncode == 0 and "--keys" in help_text.stdout and "--quick" in help_text.stdout
    assert "--follow-keys" in help_text.stdout and "--no-follow" in help_text.stdout
