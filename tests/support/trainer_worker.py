"""A user's trainer, run as a subprocess by tests/test_trainer_exit.py: nn.EmbeddingBag tables with sparse
Adagrad, a dense MLP with Adam, a Checkpointer saving every ``--every`` steps; prints ``saved STEP`` once
each ``save()`` has returned, and ``closed THREADS`` after ``close()`` (the threads still alive).

    python trainer_worker.py STORE --rows 1000000,500000,100000 --steps 6 --every 2 [--on-sigterm save]
                             [--slow-write S] [--forever] [--signal-at POINT:SIGNAL ...]

``--signal-at checkpointer_waits_for_room:SIGTERM`` sends the process that signal the first time it reaches
that pause point (``cnrstore.engine.fs``): a signal landing exactly there, every run.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

# Ctrl-C as in an interactive Python, whatever the test process passed on: an ignored or blocked SIGINT is
# inherited across fork and exec (and Python then installs no KeyboardInterrupt handler), and a pytest worker
# that ran a test leaving it so (a launcher, a spawned group) made the SIGINT tests here hang or exit 0
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

import torch  # noqa: E402
from torch import nn  # noqa: E402

from cnrstore.engine import fs  # noqa: E402
from cnrstore.torch import Checkpointer, async_save  # noqa: E402


def signal_at(point: str, signame: str) -> None:
    """Send ``signame`` to this process the first time it reaches pause point ``point``."""
    def hook(_name, *_detail):
        fs.pause_at(point, None)
        print(f"signal {signame} at {point}", flush=True)
        os.kill(os.getpid(), getattr(signal, signame))

    fs.pause_at(point, hook)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--rows", default="1000000,500000,100000")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--on-sigterm", default="finish")
    p.add_argument("--slow-write", type=float, default=0.0, help="each background write first sleeps this long")
    p.add_argument("--forever", action="store_true", help="train until a signal ends the process")
    p.add_argument("--signal-at", action="append", default=[], help="POINT:SIGNAL, e.g. checkpointer_waits_for_room:SIGINT")
    args = p.parse_args()
    for spec in args.signal_at:
        signal_at(*spec.split(":"))
    if args.slow_write:
        write = async_save.write

        def slow(*a, **k):
            time.sleep(args.slow_write)  # a slow disk: saves that returned are still in flight at the signal
            return write(*a, **k)

        async_save.write = slow
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    tables = nn.ModuleList(nn.EmbeddingBag(n, args.dim, sparse=True, mode="sum") for n in rows)
    top = nn.Sequential(nn.Linear(args.dim * len(rows), 64), nn.ReLU(), nn.Linear(64, 1))
    model = nn.ModuleDict({"tables": tables, "top": top})
    sparse_opt = torch.optim.Adagrad(list(tables.parameters()), lr=0.01)
    dense_opt = torch.optim.Adam(top.parameters(), lr=1e-3)
    on_sigterm = None if args.on_sigterm == "none" else args.on_sigterm
    ckpt = Checkpointer(args.store, model, [sparse_opt, dense_opt], codec="fp32", mode="incremental",
                        on_sigterm=on_sigterm)
    step = 0
    with ckpt:
        while args.forever or step < args.steps:
            step += 1
            ids = [torch.randint(0, n, (args.batch, 4)) for n in rows]
            logits = top(torch.cat([t(i) for t, i in zip(tables, ids)], 1)).squeeze(1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, torch.rand(args.batch))
            sparse_opt.zero_grad()
            dense_opt.zero_grad()
            loss.backward()
            sparse_opt.step()
            dense_opt.step()
            if step % args.every == 0:
                ckpt.save(step)
                print(f"saved {step}", flush=True)
    print("closed", [t.name for t in threading.enumerate() if t.name.startswith("cnrstore")], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
