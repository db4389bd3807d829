"""Staging a save's snapshot into host memory: the device-to-host half of ``Checkpointer.save()``.

A :class:`Stager` (one per Checkpointer) copies the rows a save writes, and the dense arrays, from the
model's tensors into host buffers. Per snapshot it opens a :class:`Staging`, which gathers each source
through the *backend* of the source's device, and ends with :meth:`Staging.finish`: a :class:`Staged`
handle that the background writer waits on (:meth:`Staged.wait`) before it reads any host buffer.

- **CPU tensors** (no backend): copied at once by numpy (single-threaded, into the reused host buffer);
  the handle is ready at once. This is the path a CPU trainer has always taken.
- **CUDA tensors** (:class:`CudaBackend`, one per device, made once per Stager): asynchronous copies on a
  dedicated side stream into page-locked (pinned) host buffers. The trainer's thread only launches them.
- Any other backend object with the same two methods (``host_empty``, ``batch``): tests drive the async
  path on CPU with one that defers the copies until the handle is waited on (tests/test_torch_staging.py).

**The ordering contract of the CUDA backend** (docs/DESIGN.md, "GPU saves"). Let *current* be the stream
that is current on the weight's device when ``save()`` runs (the trainer's) and *side* the stager's stream.

1. ``side.wait_stream(current)``: every read of the snapshot starts after all work the trainer enqueued
   before ``save()`` -- the snapshot sees the weights as the last step left them.
2. Phase A on *side*, the reads of live tensors: ``src.index_select(0, rows)`` into a device temporary (a
   copy: the trainer may change ``src`` as soon as it has run), or, for a whole tensor (a baseline, a
   dense array), a ``non_blocking`` copy of ``src`` straight into its pinned buffer. Then event *read*.
3. ``current.wait_event(read)``: everything the trainer enqueues after ``save()`` -- the next optimizer
   step's in-place writes of the weights and of their optimizer state -- runs after phase A has read them.
   The trainer's *thread* does not wait: only its stream's later work is ordered after the reads.
4. Phase B on *side*: each temporary ``non_blocking`` into its pinned buffer. Then event *copied*.
5. The writer calls :meth:`Staged.wait` (``copied.synchronize()``) before it reads a host buffer.
   Device memory: the sources and row indices, made on other streams, are marked ``record_stream(side)``,
   so the caching allocator does not hand their memory to other work before *side*'s work on them is
   done, even if the trainer drops them at once; the temporaries are allocated on *side* and dropped once
   phase B is enqueued (their memory goes only to later work on *side*, which runs after those copies).
   So a queued snapshot holds no device memory while it waits for its write, only its pinned buffers.
6. A host buffer is lent to one snapshot until that snapshot's write has ended (``Table.take_buffer`` /
   ``release_buffer``), and the write waits for *copied* first: no copy of a later save lands in a buffer
   a queued write still reads.

So a CUDA save stalls the trainer's thread for the launches (plus whatever in ``save()`` needs a value on
the host: the row selection's ``nonzero`` synchronizes the current stream once), and its stream for phase A
only (a device-to-device gather of the touched rows; for a baseline, the whole tables' device-to-host copy).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from .payload import dense_copy, dense_view

__all__ = ["CudaBackend", "Staged", "Stager", "Staging", "host_gather"]


def host_gather(src: torch.Tensor, rows, out: torch.Tensor) -> None:
    """Copy rows ``rows`` (an index tensor, or None for every row) of ``src`` (a tensor on a device without an
    asynchronous backend: the CPU, or one torch copies synchronously) into the host buffer ``out``, now."""
    if src.device.type == "cpu" and src.dtype == torch.float32 and out.dtype == torch.float32:
        # numpy: single-threaded copies (no intra-op pool to wake in the trainer's stall)
        if rows is None:
            np.copyto(out.numpy(), src.numpy())
        else:
            # mode="clip": the rows come from the tracking masks, always in range; the default "raise" mode
            # gathers into a temporary and copies it (numpy must not write out before checking): half the speed
            np.take(src.numpy(), rows.numpy(), axis=0, out=out.numpy(), mode="clip")
    elif rows is None:
        out.copy_(src)
    else:
        out.copy_(src.index_select(0, rows))


class Staged:
    """A snapshot's copies into host memory, in flight or landed: :meth:`wait` before reading its buffers.

    ``waits`` are callables that each block until one backend's copies have landed; they run once, in
    order, in the first :meth:`wait` (any thread; later calls return at once). No device tensor needs holding
    until then: the sources are marked ``record_stream`` (module doc, step 5)."""

    def __init__(self, waits=()):
        self._waits = list(waits)
        self._lock = threading.Lock()
        self._landed = not self._waits

    def wait(self) -> None:
        """Block until every copy of the snapshot is in its host buffer. Raises what a backend's wait raises
        (a device error)."""
        if self._landed:
            return
        with self._lock:
            if self._landed:
                return
            for w in self._waits:
                w()
            self._landed = True
            self._waits = []

    def landed(self) -> bool:
        """Whether :meth:`wait` has returned once (the buffers hold the snapshot)."""
        return self._landed


class Staging:
    """The copies of one snapshot (from :meth:`Stager.begin`): :meth:`gather` rows and :meth:`dense`
    arrays, then :meth:`finish` once. Until the returned handle's ``wait()``, a host buffer given to (or
    returned by) this staging may not hold its data yet."""

    def __init__(self, stager: "Stager"):
        self._stager = stager
        self._batches: dict = {}  # backend -> its batch for this snapshot

    def _batch(self, device: torch.device):
        backend = self._stager.backend(device)
        if backend is None:
            return None
        batch = self._batches.get(id(backend))
        if batch is None:
            batch = self._batches[id(backend)] = backend.batch()
        return batch

    def host_empty(self, device: torch.device, shape, dtype=torch.float32) -> torch.Tensor:
        """A new host tensor for a snapshot of a tensor on ``device``: page-locked where that device's
        copies are asynchronous, plain otherwise."""
        backend = self._stager.backend(device)
        return torch.empty(shape, dtype=dtype) if backend is None else backend.host_empty(shape, dtype)

    def gather(self, src: torch.Tensor, rows, out: torch.Tensor) -> None:
        """``out[:] = src[rows]`` (``rows`` an index tensor on ``src``'s device, or None for every row): now
        on CPU, enqueued on ``src``'s device otherwise (``out`` then holds it after the handle's wait)."""
        src = src.detach()
        batch = self._batch(src.device)
        if batch is None:
            host_gather(src, rows, out)
        else:
            batch.gather(src, rows, out)

    def dense(self, t: torch.Tensor) -> np.ndarray:
        """An exact host copy of ``t`` as numpy, as a dense array stores it (bfloat16 as its raw int16
        pattern; ``payload.dense_copy``): now on CPU, its data there after the handle's wait otherwise."""
        batch = self._batch(t.device)
        if batch is None:
            return dense_copy(t)
        t = dense_view(t)
        out = self.host_empty(t.device, tuple(t.shape), t.dtype)
        batch.gather(t, None, out)
        return out.numpy()

    def finish(self) -> Staged:
        """End the snapshot: order the trainer's later work after the reads (contract step 3) and start the
        remaining copies; the handle the writer waits on."""
        waits = [batch.finish() for batch in self._batches.values()]
        self._batches = {}
        return Staged(waits)


class Stager:
    """How one Checkpointer's snapshots reach host memory (module doc). ``backend``: None for the default
    (numpy copies on CPU, a :class:`CudaBackend` per CUDA device, made at its first use), or one backend
    that stages every tensor, whatever its device (tests). A backend has ``host_empty(shape, dtype)`` (a
    host tensor its copies may land in) and ``batch()``: one snapshot's copies, an object with
    ``gather(src, rows, out)`` (enqueue ``out[:] = src[rows]``, ``rows`` None for all) and ``finish()``
    (after the last gather: order the trainer's later work after the reads; return ``wait``, a
    callable that blocks until every copy has landed)."""

    def __init__(self, backend=None):
        self._fixed = backend
        self._cuda: dict = {}

    def backend(self, device: torch.device):
        """The backend that stages tensors on ``device``; None: copied at once (CPU)."""
        if self._fixed is not None:
            return self._fixed
        device = torch.device(device)
        if device.type != "cuda":
            return None
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        backend = self._cuda.get(device)
        if backend is None:
            backend = self._cuda[device] = CudaBackend(device)
        return backend

    def begin(self) -> Staging:
        """The copies of a new snapshot."""
        return Staging(self)


class CudaBackend:
    """Asynchronous device-to-host copies for one CUDA device: one side stream (made once), page-locked
    host buffers (module doc: the ordering contract)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def host_empty(self, shape, dtype=torch.float32) -> torch.Tensor:
        """A page-locked host tensor (torch's caching host allocator reuses freed ones)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def batch(self) -> "_CudaBatch":
        """One snapshot's copies on this device: the side stream waits on the current stream now."""
        return _CudaBatch(self)


class _CudaBatch:
    """One snapshot's copies on one CUDA device (contract steps 1-4)."""

    def __init__(self, backend: CudaBackend):
        self.stream = backend.stream
        self.current = torch.cuda.current_stream(backend.device)
        self.stream.wait_stream(self.current)  # step 1
        self.later: list = []  # (device temporary, pinned buffer): phase B

    def gather(self, src: torch.Tensor, rows, out: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):  # phase A: the reads of live tensors
            if rows is None:
                out.copy_(src, non_blocking=True)
            else:
                self.later.append((src.index_select(0, rows), out))  # (allocated on the side stream)
        src.record_stream(self.stream)  # (step 5: made on another stream, read on this one)
        if rows is not None:
            rows.record_stream(self.stream)

    def finish(self):
        """A wait for the copies (no device tensor to hold: step 5)."""
        read = torch.cuda.Event()
        read.record(self.stream)
        self.current.wait_event(read)  # step 3
        with torch.cuda.stream(self.stream):  # step 4
            for tmp, out in self.later:
                out.copy_(tmp, non_blocking=True)
        self.later = []  # the temporaries: their memory goes to later work on the side stream only
        copied = torch.cuda.Event()
        copied.record(self.stream)
        return copied.synchronize
