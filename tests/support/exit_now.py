"""How a spawned gloo worker ends (tests/support/*_worker.py).

``exit_now(rc)`` flushes stdout and stderr and leaves without interpreter teardown: every result is in its file
already, and a process holding gloo and TBE state was seen to abort in teardown ("terminate called without an
active exception", SIGABRT) after its work was done (tools/dlrm_dist.py's exit_now says the same). An exception
raised before it still exits 1, as Python's own end does.
"""

import os
import sys


def exit_now(rc: int = 0) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
