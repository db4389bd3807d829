"""tools/serve_follow.py, run for real in a subprocess at a small setting: its output's structure, and that
the follower (case a) serves a version at least as fresh as periodic full reloads (case b)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "serve_follow.py")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def test_serve_follow_quick(tmp_path):
    proc = subprocess.run([sys.executable, TOOL, "--quick", "--steps", "200", "--rows", "2000", "--seed", "1",
                           "--tmp", str(tmp_path)], capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["step", "phase"] and "follow:" in lines[0] and "static:" in lines[0]
    evals = [line for line in lines[1:] if line.strip() and line.split()[0].isdigit()]
    assert [int(line.split()[0]) for line in evals] == list(range(25, 201, 25))
    assert [line.split()[0] for line in lines if line.split()[:1] in (["follow"], ["reload"], ["static"])] == \
        ["follow", "reload", "static"]
    result = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    cases = result["cases"]
    assert set(cases) == {"follow", "reload", "static"}
    follow, reload = cases["follow"], cases["reload"]
    # (a) at least as fresh as (b): how far behind the trainer each served model was at each evaluation
    assert follow["behind_mean"] <= reload["behind_mean"] and follow["behind_max"] <= reload["behind_max"]
    assert follow["behind_max"] < result["settings"]["save_every"]  # every evaluation sees the newest save
    assert follow["bytes_per_update"] > 0 and reload["bytes_per_update"] > 0
    assert result["follower_stats"]["updates"] > 0 and result["follower_stats"]["rows_applied"] > 0
    assert 0 <= follow["fresh_p50"] <= follow["fresh_p99"]
    assert not os.listdir(tmp_path)  # the tool removes its store
