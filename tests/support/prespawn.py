"""Worker scripts started from a process that has imported torch already: a rank starts in a few
hundredths of a second instead of the ~2 s (4 s with torchrec) a fresh interpreter takes to import them.

The multi-rank tests start a process per rank (and more for replacements); on CI's 2 cores those imports
were a large share of the suite's time. :func:`spawn` runs ``python script args...`` as a child forked
from a ``multiprocessing`` fork server that preloaded :data:`PRELOAD` (not ``cnrstore``: it reads
environment variables at import, and each worker gets its own environment), and returns a
:class:`Worker` that stands in for the ``subprocess.Popen`` the tests used: ``pid``, ``returncode``,
``poll``, ``wait``, ``communicate`` (stdout and stderr together, as text), ``kill``, ``send_signal``.

What differs from a fresh interpreter, and how each is kept the same:
- the environment, the working directory and ``sys.argv`` are the worker's own (set before the script
  runs); torch's thread count follows ``OMP_NUM_THREADS`` as at a fresh import;
- the script runs as ``__main__`` (``runpy``); its end is Python's: non-daemon threads are joined, then
  ``atexit`` handlers run (cnrstore's exit hook among them), then the process exits with the script's
  status (an uncaught exception: its traceback and status 1); a signal kills it as it would any process;
- the fork server is not the test's child, so ``returncode`` comes from ``multiprocessing``.

Set ``CNRSTORE_TEST_FRESH_WORKERS=1`` to start every worker as a fresh interpreter instead (``subprocess``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading

#: Imported once by the fork server: what every worker would otherwise import for itself.
PRELOAD = ["numpy", "torch", "torch.distributed", "torch.nn", "torch.optim", "lmdb", "msgpack", "xxhash",
           "torchrec", "fbgemm_gpu", "torchft"]  # (torchft's import starts no thread: its runtime starts with a Manager)

_context = None
_lock = threading.Lock()
_log_dir: str | None = None  # the workers' output files, removed when this process exits


def _remove_logs(folder: str, owner: int) -> None:
    """At exit: remove the workers' output files, in the process that made them only (a child forked from
    it runs the same exit handlers, while its parent still writes there)."""
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def _new_log() -> str:
    """A file for one worker's output, in a directory of this process's own (removed at its exit: a test
    that only ``wait()``s never reads it)."""
    global _log_dir
    with _lock:
        if _log_dir is None:
            _log_dir = tempfile.mkdtemp(prefix="cnrstore-workers-")
            atexit.register(_remove_logs, _log_dir, os.getpid())
    fd, path = tempfile.mkstemp(dir=_log_dir, suffix=".log")
    os.close(fd)
    return path


def _fork_server():
    """The ``forkserver`` context, its server started with a single-threaded torch (as the workers run)."""
    global _context
    with _lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            saved = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = "1"  # (read by the server's interpreter as it starts)
            try:
                from multiprocessing import forkserver
                forkserver.ensure_running()
            finally:
                if saved is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = saved
            _context = ctx
    return _context


def _run_script(script: str, args: list, env: dict, cwd: str, log: str) -> None:
    """In the forked child: become ``python script args...`` and exit as it would."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    import torch
    threads = env.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        import runpy
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()  # (Python's own exit: non-daemon threads, then the atexit handlers)
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Worker:
    """A worker script running as a child of the fork server; the subset of ``subprocess.Popen`` the tests
    use (output: stdout and stderr together, read by :meth:`communicate`)."""

    def __init__(self, script: str, args: list, env: dict | None, cwd: str | None):
        self._log = _new_log()
        self._process = _fork_server().Process(
            target=_run_script, args=(script, [str(a) for a in args], dict(os.environ if env is None else env),
                                      cwd or os.getcwd(), self._log))
        self._process.start()
        self.pid = self._process.pid
        self.args = [script, *args]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        try:
            with open(self._log, errors="replace") as f:
                return f.read(), None
        finally:
            try:
                os.unlink(self._log)
            except FileNotFoundError:
                pass

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(9)

    def terminate(self) -> None:
        self.send_signal(15)


def spawn(script: str, *args, env: dict | None = None, cwd: str | None = None):
    """``python script args...`` (env: the whole environment, default this process's): a :class:`Worker`
    forked from the preloaded server, or a ``subprocess.Popen`` (text, stderr into stdout) with
    ``CNRSTORE_TEST_FRESH_WORKERS=1``."""
    if os.environ.get("CNRSTORE_TEST_FRESH_WORKERS") == "1":
        return subprocess.Popen([sys.executable, script, *map(str, args)], env=env, cwd=cwd,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return Worker(script, list(args), env, cwd)

