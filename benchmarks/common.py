"""What the benchmarks share: the machine header and tail of every report (``machine_description``,
``load_average``, ``publish``), formatting, statistics (``median``, t quantiles), memory probes, plots, the
Zipf row sampler and knob settings, and loading a peer's checkpoint. Each script imports what it needs:
``from common import publish``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import cnrstore


def zipf_rows(rng: np.random.Generator, perm: np.ndarray, count: int, a: float = 1.1) -> np.ndarray:
    """``count`` unique row ids drawn from a Zipf(a) popularity over the random ranking ``perm``
    (rank k -> row ``perm[(k - 1) % num_rows]``), in order of first draw; returned sorted."""
    num_rows = perm.size
    count = min(count, num_rows)
    seen = np.zeros(0, dtype=np.int64)
    while True:
        draws = perm[(rng.zipf(a, size=max(2 * count, 1024)) - 1) % num_rows]
        uniq, first = np.unique(np.concatenate([seen, draws]), return_index=True)
        ordered = uniq[np.argsort(first, kind="stable")]
        if ordered.size >= count:
            return np.sort(ordered[:count])
        seen = ordered


@contextlib.contextmanager
def knob_settings(settings: dict):
    """Set ``cnrstore.knobs`` (name: value) for the ``with`` block; put every one back after it."""
    saved = {name: getattr(cnrstore.knobs, name) for name in settings}
    for name, value in settings.items():
        setattr(cnrstore.knobs, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(cnrstore.knobs, name, value)


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def median(xs) -> float:
    return statistics.median(xs)


#: Student t quantiles by degrees of freedom: two-sided 95% (0.975) and one-sided 80% (a test's power);
#: between tabulated values, interpolated; beyond df 120, the normal's.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042,
        40: 2.021, 60: 2.000, 120: 1.980}
T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883,
       10: 0.879, 11: 0.876, 12: 0.873, 13: 0.870, 14: 0.868, 15: 0.866, 20: 0.860, 25: 0.856, 30: 0.854,
       40: 0.851, 60: 0.848, 120: 0.845}
Z975, Z80 = 1.960, 0.842


def t_quantile(table: dict[int, float], z: float, df: int) -> float:
    """The quantile of ``table`` (T975 or T80) at ``df`` degrees of freedom; ``z``, the normal's, beyond it."""
    if df in table:
        return table[df]
    if df > max(table):
        return z
    lo = max(d for d in table if d < df)
    hi = min(d for d in table if d > df)
    return table[lo] + (table[hi] - table[lo]) * (df - lo) / (hi - lo)


def machine_description() -> list[str]:
    cpu = platform.processor() or "unknown"
    try:
        info = {}
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
        cpu = info.get("model name", cpu)
        if "cpu MHz" in info:
            cpu += f" @ {float(info['cpu MHz']):.0f} MHz"
        simd = [f for f in ("avx2", "avx512f", "avx512_vnni") if f in info.get("flags", "").split()]
        cpu += f" ({', '.join(simd) or 'no avx2'})"
    except (OSError, ValueError):
        pass
    ram = "unknown"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
                    break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"cpu: {cpu}; cores: {os.cpu_count()} (usable {usable}); torch threads: {torch.get_num_threads()}",
        f"ram: {ram}; os: {platform.system()} {platform.release()}",
        f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
        f"cnrstore {cnrstore.__version__}",
    ]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def reset_peak_rss() -> int:
    """Reset this process's peak resident memory (VmHWM) to what it holds now (Linux: /proc/self/clear_refs)
    and return that, in bytes: ``peak_rss()`` after some work, less this, is what the work added at most."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") << 10


def peak_rss() -> int:
    """This process's peak resident memory since the last ``reset_peak_rss`` (or its start), in bytes."""
    return _status_kib("VmHWM") << 10


def child_with_peak_rss(script: str, flag: str, spec, what: str) -> dict:
    """Run ``python script flag json(spec)`` in a process of its own and return the JSON object its last stdout
    line prints, with ``"maxrss"``: that process's peak RSS in bytes (``ru_maxrss`` from ``wait4``, so nothing
    of this process counts). A failed child ends the benchmark naming ``what``."""
    import json
    proc = subprocess.Popen([sys.executable, os.path.abspath(script), flag, json.dumps(spec)],
                            stdout=subprocess.PIPE, text=True)
    text = proc.stdout.read()
    _pid, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{what}: the child process failed ({status})")
    result = json.loads(text.strip().splitlines()[-1])
    result["maxrss"] = usage.ru_maxrss * 1024
    return result


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def fmt_list(seconds: list) -> str:
    return ", ".join(f"{t * 1e3:.0f}" for t in seconds)


def fmt_bytes(n: float) -> str:
    """Bytes in B, KiB, MiB or GiB (one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def publish(md: str, out: str | None, plot_path: str | None, plot) -> None:
    """Print a benchmark's markdown report, write it to ``out`` if given, and draw its PNG with ``plot(path)``
    (which returns None, or why it could not) unless ``plot_path`` is None or "none"."""
    print(md)
    if out:
        with open(out, "w") as f:
            f.write(md)
    if plot_path and plot_path != "none":
        why = plot(plot_path)
        print(why or f"plot: {plot_path}", file=sys.stderr)


def three_panels(figsize: tuple[float, float]):
    """(figure, its three side-by-side axes) from matplotlib's Agg backend, or None if matplotlib is not
    installed (the plot is then skipped)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt.subplots(1, 3, figsize=figsize)


def save_panels(fig, axes, xlabel: str, path: str) -> None:
    """Label every panel's x axis ``xlabel``, grid it, and write the figure to ``path``."""
    for ax in axes:
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def dir_bytes(path: str) -> int:
    """Apparent bytes of the files under ``path`` (sizes, not blocks)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (for a one-process gloo group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoEndpoint:
    """moto's S3 server in a child process (``python -m moto.server``) on a free localhost port, as a real
    endpoint is a server of its own (bench_s3, bench_dist_s3), with the bucket ``bench``; ``url``,
    ``options`` (s3fs's), ``stop()``."""

    def __init__(self, nice: int = 0):
        """``nice``: the server's niceness (a real endpoint takes none of the client machine's CPU; on a machine
        with few cores, a nice server yields it to the process measured)."""
        import boto3
        import urllib.error
        import urllib.request

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(["nice", "-n", str(nice)] * bool(nice) +
                                     [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:  # until it answers HTTP
            try:
                with urllib.request.urlopen(self.url + "/moto-api/", timeout=1):
                    break
            except urllib.error.HTTPError:
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto's server did not start on {self.url}") from None
                time.sleep(0.1)
        boto3.client("s3", endpoint_url=self.url, aws_access_key_id="bench", aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        self.options = {"key": "bench", "secret": "bench", "skip_instance_cache": True,
                        "client_kwargs": {"endpoint_url": self.url, "region_name": "us-east-1"}}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def load_peer_checkpoint(kind: str, path: str, model, optimizer, map_location=None) -> None:
    """Restore a peer's checkpoint of ``{"model": ..., "optimizer": ...}`` into ``model`` and ``optimizer`` in
    place: a ``torch.save`` file (``kind`` "torch.save"), else a torch.distributed.checkpoint directory."""
    if kind == "torch.save":
        state = torch.load(path, map_location=map_location, weights_only=False)
    else:
        import torch.distributed.checkpoint as dcp

        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"
