"""ECRM: erasure-coded redundancy of the embedding shards, recovered bit for bit (docs/DESIGN.md, "ECRM").

After Kosaian, Liu and Rashmi's ECRM: each rank's embedding shards and their row-wise optimizer state are
protected by parity held in the memory of other ranks (``stripes.StripeLayout``: stripes of ``k`` data
units and ``r`` parity units, rotated over the ranks). Every optimizer step also updates the parity, and
when ranks fail their state is decoded from the survivors -- no checkpoint is read and no update is lost.
Unlike the paper's float sums, the code works on the raw bits (``gf256``: XOR for r = 1, a Cauchy
Reed-Solomon code for r >= 2), so a decoded row equals the lost one exactly.

    ckpt = DistributedCheckpointer(root, model, optimizer, plan=plan)      # the fallback (optional)
    ecrm = ECRM(model, optimizer, k=2, r=1, checkpointer=ckpt)            # collective: encodes the parity
    for step in ...:
        loss.backward()
        with ecrm.step(step + 1):       # records the rows the step changes, then updates the parity
            optimizer.step()
    # after a failure: re-form the default process group with the replacement(s), then on every rank
    # (a replacement constructs its ECRM with replacement=True first):
    report = ecrm.recover(failed_ranks=[3])   # every rank is now at step report.step: redo the steps after it

The update of one step (``ECRM.step``), on every rank. The protected tensors live in one arena
(``ecrm_space.DataSpace``), cut into *blocks*: the greatest common divisor of the ranks' row widths
(words), each tensor placed at a block boundary, so that every row is whole blocks (usually one). No
step loops over rows, and only the gradient scan below runs once per table:

1. before the optimizer step, the rows it may change (the looked-up rows and the rows of each weight's
   gradient, whatever made it -- an L2 penalty, a tied layer --: one row-wise ``any`` over each
   gradient's raw bits, written into one mask of every table's rows; widened for optimizers that move
   rows without a gradient) become blocks of the data space and are copied in one gather: the *undo
   log*, with one flat copy of the dense parameters and their optimizer state. Only the optimizer step
   inside ``ecrm.step()`` may change protected rows: an in-place write of the trainer's own between
   steps is not in the parity (it is in the next checkpoint: ``cnrstore.torch`` saves find every
   changed row);
2. after it, one gather gives the code delta ``old ^ new`` of every block; the blocks that changed are
   kept, fingerprinted (``stripes.fingerprint_blocks``) and multiplied by their parity coefficients
   (``gf256.mul_words``; none for parity slot 0, whose coefficients are all 1: with ``r = 1`` the code
   is XOR and nothing is multiplied);
3. one round of point-to-point messages (``exchange.PairExchange``: sizes agreed in advance, every rank
   to every other, on a gloo group of the ECRM's own, copied once into a send buffer per peer that every
   round reuses) carries each holder the deltas of its stripes -- one uint32 parity block index per
   block, then the blocks -- and every rank's data fingerprint;
4. each holder applies ``parity[blocks] ^= coef · delta`` and keeps what it applied (XOR undoes itself).

Overlap (``overlap=True``, the default): step 3 is posted when the step's ``with`` block ends and is
finished -- received and applied (step 4) -- when the next step's block begins, so the messages travel
during the next forward and backward pass, which change no protected word. Nothing else waits for them:
the parity of step ``s`` is applied before step ``s + 1`` changes any protected row. The round's gloo
calls are made by a posting thread (``_Poster``): a send or receive whose peer is ready blocks its
caller until the peer's I/O thread runs, which on a busy machine cost the trainer milliseconds per step.

Consistency: a rank can die anywhere in this. A rank posts round ``s`` only after it finished round
``s - 1``, so a completed round ``s`` proves every rank applied step ``s - 1``: its undo log is dropped
then. ``recover`` first finishes the round in flight as far as the dead rank allows (a round is applied
whole or not at all), then brings every rank to the last step whose parity every survivor applied:
survivors ahead of it undo their newer steps (data, dense state and parity), the failed ranks' state is
decoded at that step and checked against the fingerprint they published for it, and the trainer redoes
the steps after it. With overlap, a rank killed right after its step may die before its messages leave:
the survivors then stop one step earlier and redo it -- nothing is lost either way. More than ``r``
failures, a fingerprint mismatch, or survivors that cannot reach a common step fall back to the
checkpoint.

Crash points (``$CNRSTORE_CRASH_AT``, tests): ``ecrm_before_send`` (after the optimizer step, before the
round is posted), ``ecrm_partial_send`` (after sending to the first half of the holders only),
``ecrm_after_apply`` (after applying the step's parity), ``ecrm_decode`` (a replacement, after receiving
the survivors' contributions and before writing them).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..engine import fs
from ..errors import InvalidArgument, PeerFailure, RecoveryFailed
from ..torch.guard import grad_rows
from ..torch.optim_state import table_drift
from . import failures, gf256
from .ecrm_space import DataSpace
from .exchange import PairExchange
from .stripes import StripeLayout, fingerprint_blocks

__all__ = ["ECRM", "ECRMReport", "CRASH_POINTS"]

CRASH_POINTS = ("ecrm_before_send", "ecrm_partial_send", "ecrm_after_apply", "ecrm_decode")
FALLBACKS = ("partial", "full", None)
#: Seconds ``recover`` waits for the round in flight: its live senders posted it long before, so only a
#: dead rank's message can be missing (the round then counts as not applied on this rank).
SETTLE_TIMEOUT_S = 5.0


@dataclass
class ECRMReport:
    """What ``ECRM.recover`` did. ``mode`` is "ecrm" (decoded from the parity: no update lost), or
    "fallback-partial" / "fallback-full" (restored from the checkpoint; ``reason`` says why and
    ``checkpoint`` holds the checkpointer's RecoveryReport or GlobalVersion). ``step`` is the step every
    rank is at now: the trainer redoes the steps after it (``redo_steps`` of them, counted from the
    survivors' newest step)."""

    mode: str
    step: int | None
    failed_ranks: tuple[int, ...]
    replacement: bool                 # this rank was one of the failed ones
    redo_steps: int = 0
    lost_updates: int | None = 0      # updates lost for good (None: unknown, see the checkpoint's report)
    seconds: float = 0.0
    decode_seconds: float = 0.0
    bytes_received: int = 0           # by this rank, for the decode and the re-encoded parity
    phases: dict = field(default_factory=dict)   # seconds by phase: status, rollback, decode, verify, reencode, dense
    reason: str | None = None
    checkpoint: object = None


@dataclass
class _Item:
    """One protected tensor viewed as ``[rows, width]`` 32-bit words at ``base`` of the data space."""
    name: str
    words: torch.Tensor
    base: int
    table: int | None     # index of its table (row-tracked), None: small state rewritten every step
    tensor: torch.Tensor | None = None   # the tensor itself (the arena rebinds its .data)

    @property
    def rows(self) -> int:
        return int(self.words.shape[0])

    @property
    def width(self) -> int:
        return int(self.words.shape[1])


@dataclass
class _Table:
    name: str
    weight: nn.Parameter
    touched: torch.Tensor
    hook: object = None


@dataclass
class _Undo:
    """What one step changed on this rank: enough to take it back."""
    step: int
    blocks: np.ndarray                       # blocks of the data space the step may change (int64)
    old: np.ndarray                          # their words before the step, ``[len(blocks), block]`` uint32
    dense: object                            # dense parameters and optimizer state before the step
    rebuild: bool = False                    # the protected tensors changed: encode afresh
    applied: list = field(default_factory=list)   # (parity blocks, ``[n, block]`` payload) applied to the parity


@dataclass
class _Round:
    """A step whose message round is posted and not finished yet."""
    undo: _Undo
    fingerprint: int                         # this rank's, after the step
    rebuild: bool
    posted: float                            # perf_counter() when posted


class _Poster:
    """A daemon thread that starts ECRM's message rounds (``PairExchange.send``) off the training thread,
    one at a time. A gloo send to a peer that has already posted its receive writes the message in the
    calling thread until the peer's I/O thread reads it: on a busy machine, milliseconds of the trainer's
    time that the round's overlap was meant to hide. ``submit`` hands a round over; ``join`` waits until it
    is posted and raises what posting it raised. The thread runs under SCHED_BATCH where the system
    allows it (best effort): woken by ``submit``, it does not preempt the trainer that woke it (on a busy
    machine that preemption cost the trainer about a millisecond per round at 4 ranks on 2 cores), and it
    keeps its normal share of the cores otherwise (a nice value of 19 starved it: the next step waited)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._job: list | None = None          # [done, exception] of the round handed over last

    def submit(self, fn) -> None:
        if self._job is not None:
            raise InvalidArgument("ECRM: a message round was handed to the posting thread before the last was joined")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="cnrstore-ecrm-post", daemon=True)
            self._thread.start()
        self._job = [threading.Event(), None]
        self._jobs.put((fn, self._job))

    def join(self, timeout: float | None = None) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        if not job[0].wait(timeout):
            raise PeerFailure(f"ECRM's message round was not out after {timeout} s: a peer does not read its messages",
                              learned="collective", cause="timeout")
        if job[1] is not None:
            raise job[1]

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (after the round it may be posting) and wait for it, at most ``timeout``."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            os.sched_setscheduler(threading.get_native_id(), os.SCHED_BATCH, os.sched_param(0))
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, job = item
            try:
                fn()
            except BaseException as exc:       # handed to the training thread at ``join``
                job[1] = exc
            finally:
                job[0].set()
                # hold nothing between rounds: a frame of this daemon thread that kept the exchange (and
                # so its process group) alive would leave gloo's threads to interpreter shutdown
                item = fn = job = None


def _word_view(t: torch.Tensor, rows: int, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise InvalidArgument(f"ECRM needs {name} to be contiguous; call .contiguous() on it before the run")
    flat = t.detach().reshape(rows, -1)
    if flat.shape[1] * flat.element_size() % 4:
        raise InvalidArgument(f"ECRM codes 32-bit words: a row of {name} is {flat.shape[1] * flat.element_size()} "
                              "bytes, not a multiple of 4 (pad the embedding dimension to an even number)")
    if flat.shape[1] == 0:
        return flat.new_zeros((rows, 0), dtype=torch.int32)   # nothing to protect
    return flat.view(torch.int32)


_BIT_INTS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def _row_bits(grad: torch.Tensor, rows: int) -> torch.Tensor | None:
    """A dense gradient of a ``rows``-row weight as ``[rows, n]`` integers holding its raw bits (the widest
    integer that divides a row, so that ``any`` reads few elements), or None for any other layout (sparse,
    strided, scalar, empty rows)."""
    if (grad.layout != torch.strided or grad.dim() == 0 or grad.shape[0] != rows or not grad.is_contiguous()
            or grad.numel() == 0):
        return None
    try:
        raw = grad.detach().reshape(rows, -1).view(torch.uint8)
        for size, dtype in _BIT_INTS:
            if raw.shape[1] % size == 0 and raw.storage_offset() % size == 0:
                return raw.view(dtype)
    except RuntimeError:
        return None
    return None


def _to_numpy(t: torch.Tensor):
    """A CPU numpy copy (pickled as raw bytes, unlike a tensor), or the tensor if numpy lacks its dtype."""
    try:
        return t.detach().cpu().numpy()
    except TypeError:      # bfloat16 and kin
        return t


def _from_numpy(a):
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else a


def _tensors_as(tree, convert):
    """``tree`` (dicts and lists) with every tensor or array leaf passed through ``convert``."""
    if isinstance(tree, dict):
        return {k: _tensors_as(v, convert) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tensors_as(v, convert) for v in tree]
    return convert(tree) if torch.is_tensor(tree) or isinstance(tree, np.ndarray) else tree


class ECRM:
    """Erasure-coded parity of this rank's embedding shards and row-wise optimizer state (module doc).

    Collective: construct (on every rank; a process replacing a failed rank passes ``replacement=True``
    and calls ``recover`` next), ``step``, ``recover``, ``rebuild`` and ``close``, in the same order on
    every rank. The embedding tables are the model's ``nn.Embedding`` / ``nn.EmbeddingBag`` modules
    (their module paths name them); every other parameter is dense and replicated on every rank.

    ``k``, ``r``: data and parity units per stripe (``k + r <= world size``); any ``r`` simultaneous
    failures are recovered. ``checkpointer`` (a ``DistributedCheckpointer``) and ``fallback``
    ("partial": CPR partial recovery of the failed ranks, "full": every rank restores the newest global
    version) say what ``recover`` does when the parity cannot; without one it raises RecoveryFailed.
    ``step`` is the training step the model is at now. ``timeout_s`` bounds every collective.
    ``overlap``: finish a step's message round when the next step begins (module doc), not before its
    ``with`` block returns.

    The embedding weights and their optimizer state are moved into one buffer per rank (their ``.data``
    is rebound; the tensor objects, their values and the optimizer stay as they were): replacing one of
    them later (``optimizer.load_state_dict``, a restore that assigns new tensors) is noticed at the next
    step, which then encodes the parity afresh.
    """

    def __init__(self, model: nn.Module, optimizer=None, *, k: int, r: int = 1, checkpointer=None,
                 fallback: str | None = "partial", step: int = 0, replacement: bool = False,
                 unit_words: int | None = None, timeout_s: float = 600.0, overlap: bool = True):
        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgument("torch.distributed is not initialized; call init_process_group on every rank "
                                  "before creating an ECRM")
        if not isinstance(model, nn.Module):
            raise InvalidArgument(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if fallback not in FALLBACKS:
            raise InvalidArgument(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        if fallback is not None and checkpointer is None:
            fallback = None
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be positive, got {timeout_s!r}")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        StripeLayout(self.world_size, k, r, [0] * self.world_size)     # validates k, r against the world
        self.k, self.r = int(k), int(r)
        self.model = model
        if optimizer is None:
            self._optimizers = []
        elif isinstance(optimizer, (list, tuple)):
            self._optimizers = list(optimizer)
        else:
            self._optimizers = [optimizer]
        self.checkpointer = checkpointer
        self.fallback = fallback
        self.unit_words = unit_words
        self.timeout_s = float(timeout_s)
        self.overlap = bool(overlap)
        self._tables = self._find_tables(model)
        self._local_block = 1
        self._grad_masks: list = []
        self._emb_ids = {id(t.weight) for t in self._tables}
        self._dense_params = [p for p in model.parameters() if id(p) not in self._emb_ids]
        self._group = None
        self._world = None
        self._exchange: PairExchange | None = None
        self._round: _Round | None = None
        self._poster = _Poster()
        self._join()
        self.layout: StripeLayout | None = None
        self.parity = np.zeros(0, dtype=np.uint32)
        self._items: list[_Item] = []
        self.space: DataSpace | None = None
        self._guard: tuple = ([], [])
        self._counts: tuple = ()
        self._dense: list = []
        self._drift_key = None
        self._drift: list = []
        self._drift_rows = np.zeros(0, dtype=np.int64)
        self._state_items: list[_Item] = []
        self._undo: list[_Undo] = []
        self._open: _Undo | None = None
        self.data_step: int | None = None      # the step the protected state is at
        self.applied_step: int | None = None   # the newest step whose parity this rank applied
        self.fingerprint = 0
        self._fps: dict[int, list[int]] = {}   # step -> every rank's fingerprint after it
        # seconds_*: time the training thread spent in each part of the update (``seconds``: all but the
        # capture); seconds_wait: the part of seconds_exchange spent blocked on a round's messages;
        # seconds_overlapped: time a round travelled while the trainer went on
        self.stats = {"steps": 0, "bytes_sent": 0, "bytes_received": 0, "last_step_bytes_sent": 0,
                      "last_step_payload_bytes": 0, "seconds_capture": 0.0, "seconds_encode": 0.0,
                      "seconds_exchange": 0.0, "seconds_wait": 0.0, "seconds_apply": 0.0, "seconds_overlapped": 0.0,
                      "last_step_seconds": 0.0, "seconds": 0.0}
        self._closed = False
        if not replacement:
            self.rebuild(step)

    # -- set-up -----------------------------------------------------------------------------------------
    def _find_tables(self, model: nn.Module) -> list[_Table]:
        tables = []
        for path, module in model.named_modules():
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
                w = module.weight
                t = _Table(path or "embedding", w, torch.zeros(w.shape[0], dtype=torch.bool, device=w.device))
                t.hook = module.register_forward_pre_hook(self._tracker(t), with_kwargs=True)
                tables.append(t)
        if not tables:
            raise InvalidArgument("the model has no nn.Embedding or nn.EmbeddingBag module: ECRM protects "
                                  "embedding shards (dense layers are replicated on every rank)")
        return tables

    @staticmethod
    def _tracker(t: _Table):
        def track(module, args, kwargs):
            if not torch.is_grad_enabled():
                return
            ids = args[0] if args else kwargs.get("input")
            if torch.is_tensor(ids) and ids.numel():
                t.touched[ids.reshape(-1).to(t.touched.device)] = True
        return track

    def _join(self) -> None:
        """This ECRM's gloo group over the current default group (collective)."""
        if self._group is not None and dist.is_initialized() and dist.group.WORLD is self._world:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self._world = dist.group.WORLD
        self._exchange = PairExchange(self._group, self.rank, self.world_size)
        self._round = None

    def _build_items(self) -> list[_Item]:
        """The protected tensors, table after table, each at a base aligned to this rank's block: the
        greatest common divisor of the row-tracked widths (words; and of ``unit_words`` if given), so that
        every row of every item is whole blocks (``ecrm_space.DataSpace``). Sets ``_local_block``."""
        entries = []
        for ti, t in enumerate(self._tables):
            rows = t.weight.shape[0]
            mine = [(f"{t.name}/weight", t.weight, ti)]
            for oi, opt in enumerate(self._optimizers):
                for key in sorted(opt.state.get(t.weight, {}), key=str):
                    v = opt.state[t.weight][key]
                    if v is None:
                        continue
                    if not torch.is_tensor(v):
                        raise InvalidArgument(f"optimizer {oi} keeps {key!r}={v!r} for {t.name!r}, not a tensor; "
                                              "ECRM protects tensor state only")
                    row_wise = v.dim() >= 1 and v.shape[0] == rows
                    mine.append((f"{t.name}/optim{oi}.{key}", v, ti if row_wise else None))
            entries += [(name, tensor, table, _word_view(tensor, rows if table is not None else 1, name))
                        for name, tensor, table in mine]
        block = 0
        for _name, _tensor, table, words in entries:
            if table is not None:
                block = math.gcd(block, int(words.shape[1]))
        if self.unit_words:
            block = math.gcd(block, int(self.unit_words))
        self._local_block = block = max(block, 1)
        items, base = [], 0
        for name, tensor, table, words in entries:
            align = math.lcm(block, max(1, tensor.element_size() // 4))   # the arena views it in its own dtype
            base = -(-base // align) * align
            items.append(_Item(name, words, base, table, tensor))
            base += words.shape[0] * words.shape[1]
        return items

    def _current(self) -> tuple[list, list]:
        """What ECRM's views depend on, as it is now: the storage of the parameters (``.data`` may be
        rebound) and the identity of every optimizer state value (``load_state_dict`` replaces them), for
        the protected tensors and for the dense ones. Compared with the lists taken before, they tell
        whether a tensor was replaced or state appeared. One pass over the tensors: pointer reads only."""
        weights = [t.weight for t in self._tables]
        return ([w.data_ptr() for w in weights]
                + [id(v) for opt in self._optimizers for p in weights for v in opt.state.get(p, {}).values()],
                [p.data_ptr() for p in self._dense_params]
                + [id(v) for opt in self._optimizers for p in self._dense_params for v in opt.state.get(p, {}).values()])

    def _state_count(self) -> tuple:
        """How many parameters each optimizer keeps state for (lazy state, Adam's, appears in a step)."""
        return tuple(len(opt.state) for opt in self._optimizers)

    def _make_space(self, words: int) -> None:
        """Move the protected tensors into an arena of ``words`` words (keeping the tracking marks)."""
        marks = self.space.touched.clone() if self.space is not None else None
        self.space = DataSpace(self._items, [t.weight.shape[0] for t in self._tables], words, self.layout.block)
        if marks is not None and marks.shape == self.space.touched.shape:
            self.space.touched.copy_(marks)
        for ti, t in enumerate(self._tables):
            t.touched = self.space.table_mask(ti)
        self._grad_masks = [self.space.table_mask(ti, self.space.grad_mask) for ti in range(len(self._tables))]
        self._state_items = [it for it in self._items if it.table is not None and not it.name.endswith("/weight")]
        self._dense = self._dense_tensors()
        self._guard = self._current()
        self._counts = self._state_count()
        self._drift_key = None

    def _signature(self, items) -> tuple:
        return tuple((it.name, it.rows, it.width, it.table is None) for it in items)

    @property
    def data_words(self) -> int:
        """Words of this rank's data space (its items, with the alignment gaps between them)."""
        return max((it.base + it.rows * it.width for it in self._items), default=0)

    # -- the data space ----------------------------------------------------------------------------------
    def _flat(self) -> np.ndarray:
        """This rank's padded data space as one ``[m, k, U]`` word array (read only: on the CPU, the arena)."""
        return self.space.host_words().reshape(self.layout.periods, self.k, self.layout.unit)

    def _load_flat(self, flat: np.ndarray) -> None:
        self.space.load(flat)

    def _full_fingerprint(self) -> int:
        return self.space.fingerprint()

    # -- dense (replicated) state ------------------------------------------------------------------------
    def _dense_state(self) -> dict:
        names = {id(p): n for n, p in self.model.named_parameters()}
        params = {n: p.detach().clone() for n, p in self.model.named_parameters() if id(p) not in self._emb_ids}
        optims = []
        for opt in self._optimizers:
            optims.append({names[id(p)]: {k: (v.detach().clone() if torch.is_tensor(v) else v)
                                          for k, v in opt.state.get(p, {}).items()}
                           for g in opt.param_groups for p in g["params"]
                           if id(p) not in self._emb_ids and id(p) in names})
        return {"params": params, "optim": optims}

    def _dense_tensors(self) -> tuple | None:
        """The dense parameters and their optimizer state, in a fixed order, with a flat byte view of
        each (valid while ``_current()`` does not change), or None if some state is not a tensor (then a
        step's undo log keeps ``_dense_state()``)."""
        out = list(self._dense_params)
        for opt in self._optimizers:
            for p in self._dense_params:
                for v in opt.state.get(p, {}).values():
                    if not torch.is_tensor(v):
                        return None
                    out.append(v)
        return out, [t.detach().reshape(-1).view(torch.uint8) if t.is_contiguous() else None for t in out]

    def _dense_snapshot(self, current: list):
        """The dense state before a step: ``self._dense`` (taken again if ``current``, the dense half of
        ``_current()``, shows a change) and one flat byte copy of it per device the tensors are on (CUDA
        parameters keep small state on the CPU: Adagrad's and Adam's ``step``)."""
        if current != self._guard[1]:
            self._dense = self._dense_tensors()
            self._guard = (self._guard[0], current)
        if self._dense is None:
            return self._dense_state()
        tensors, views = self._dense
        parts: dict[torch.device, list] = {}
        with torch.no_grad():
            for t, v in zip(tensors, views):
                parts.setdefault(t.device, []).append(v if v is not None else t.detach().reshape(-1).view(torch.uint8))
            return tensors, {device: torch.cat(p) for device, p in parts.items()}

    def _restore_dense(self, snapshot) -> None:
        if isinstance(snapshot, dict):
            self._load_dense_state(snapshot)
            return
        tensors, flats = snapshot
        offsets = dict.fromkeys(flats, 0)
        with torch.no_grad():
            for t in tensors:
                n, off = t.numel() * t.element_size(), offsets[t.device]
                t.copy_(flats[t.device][off:off + n].clone().view(t.dtype).view(t.shape))
                offsets[t.device] = off + n

    def _load_dense_state(self, state: dict) -> None:
        named = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, v in state["params"].items():
                named[n].copy_(v)
        names = {id(p): n for n, p in named.items()}
        for opt, by_name in zip(self._optimizers, state["optim"]):
            for g in opt.param_groups:
                for p in g["params"]:
                    st = by_name.get(names.get(id(p)))
                    if st is not None:
                        opt.state[p] = {k: (v.clone().to(p.device) if torch.is_tensor(v) else v)
                                        for k, v in st.items()}

    # -- building the parity -----------------------------------------------------------------------------
    def rebuild(self, step: int | None = None) -> None:
        """Encode the parity from scratch (collective): at construction, and after the model was loaded
        from elsewhere (a checkpoint restore). Drops the undo log. ``step``: the step the model is at."""
        self._check_open()
        self._finish_round()
        self._encode_afresh(step)
        self.space.clear()

    def _encode_afresh(self, step: int | None) -> None:
        """``rebuild`` without touching the tracking marks (which may already hold the next step's rows)."""
        self._items = self._build_items()
        sizes: list = [None] * self.world_size
        failures.all_gather_object(sizes, (self.data_words, self._local_block), group=self._group)
        block = 0
        for _words, b in sizes:          # every rank's rows are whole blocks of this size
            block = math.gcd(block, b)
        self.layout = StripeLayout(self.world_size, self.k, self.r, [w for w, _b in sizes], self.unit_words,
                                   block=block)
        self._make_space(self.layout.data_words)
        self.parity = np.zeros(self.layout.parity_words, dtype=np.uint32)
        self._send_blocks(self._encode_plan(range(self.world_size)), self._flat(),
                          self.parity.reshape(self.layout.periods, self.r, self.layout.unit))
        self.fingerprint = self._full_fingerprint()
        fps: list = [None] * self.world_size
        failures.all_gather_object(fps, self.fingerprint, group=self._group)
        self._undo = []
        self._open = None
        self.data_step = self.applied_step = step
        self._fps = {step: list(fps)}

    def _encode_plan(self, holders) -> list[tuple[int, int, str, int, int, int]]:
        """Contributions that rebuild the parity held by ``holders`` (entries as in ``_send_blocks``):
        every data block ``i`` of ``src`` times ``E[j, i]``, into parity slot ``j`` of its holder."""
        lay, plan = self.layout, []
        holders = set(holders)
        for src in range(self.world_size):
            for i in range(self.k):
                c = lay.residue(src, i)
                for j in range(self.r):
                    dst = int(lay.holder(c, j))
                    if dst in holders:
                        plan.append((src, dst, "data", i, int(lay.matrix[j, i]), j))
        return plan

    def _send_blocks(self, plan, flat: np.ndarray | None, into: np.ndarray | None, crash: str | None = None) -> int:
        """Run one batch of block contributions (one ``batch_isend_irecv``). Each entry
        ``(src, dst, kind, unit, coef, col)``: ``src`` sends ``coef`` · (its data block ``unit`` of ``flat``
        if ``kind`` is "data", else its parity slot ``unit``) to ``dst``, which XORs it into
        ``into[:, col, :]``. ``crash`` names a crash point reached after receiving. Returns the bytes this
        rank received."""
        me, shape = self.rank, (self.layout.periods, self.layout.unit)
        parity = self.parity.reshape(self.layout.periods, self.r, self.layout.unit)
        sends: dict[int, list[np.ndarray]] = {}
        expect: dict[int, list[int]] = {}
        for src, dst, kind, unit, coef, col in plan:
            if src == me:
                block = flat[:, unit, :] if kind == "data" else parity[:, unit, :]
                scaled = gf256.mul(coef, np.ascontiguousarray(block).view(np.uint8)).view(np.uint32)
                if dst == me:
                    into[:, col, :] ^= scaled
                else:
                    sends.setdefault(dst, []).append(scaled)
            elif dst == me:
                expect.setdefault(src, []).append(col)
        ops = [dist.P2POp(dist.isend, torch.from_numpy(np.concatenate([b.reshape(-1) for b in blocks])), dst,
                          self._group) for dst, blocks in sorted(sends.items())]
        bufs = {src: torch.empty(len(cols) * shape[0] * shape[1], dtype=torch.int32) for src, cols in expect.items()}
        ops += [dist.P2POp(dist.irecv, bufs[src], src, self._group) for src in sorted(bufs)]
        if ops:
            failures.batch_isend_irecv(ops)
        if crash and bufs:
            fs.crash_point(crash)
        for src, buf in bufs.items():
            for col, block in zip(expect[src], buf.numpy().view(np.uint32).reshape(-1, *shape)):
                into[:, col, :] ^= block
        return sum(buf.numel() * 4 for buf in bufs.values())

    # -- one training step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int):
        """Wrap the optimizer step of training step ``step`` (collective on leaving): records the rows it
        may change before, and updates the parity after (with ``overlap``, the parity of step ``step`` is
        applied when step ``step + 1`` begins, or at ``flush()``). If the body raises, this rank's protected
        state is put back as it was and the error propagates (the parity never saw the step)."""
        self.begin(step)
        try:
            yield self
        except BaseException:
            self._undo_data(self._open)
            self._open = None
            raise
        self.commit()

    def _candidate_rows(self) -> np.ndarray:
        """Global rows (``DataSpace`` numbering) the optimizer step may change: the looked-up ones, those of
        each weight's gradient as it stands (a gradient no lookup of the module made: an L2 penalty, a tied
        layer, ``F.embedding`` on the weight; ``guard.grad_rows``), and those the optimizers move without a
        gradient (judged per table as the Checkpointer does)."""
        key = tuple((id(g), g.get("weight_decay"), g.get("momentum"), len(g["params"]))
                    for opt in self._optimizers for g in opt.param_groups)
        if key != self._drift_key:          # hyper-parameters changed (or first step): judge every table again
            self._drift_key = key
            self._drift = [table_drift(self._optimizers, t.weight) for t in self._tables]
            starts = self.space.row_start
            self._drift_rows = np.concatenate(
                [np.zeros(0, dtype=np.int64)] + [np.arange(starts[ti], starts[ti + 1], dtype=np.int64)
                                                 for ti, d in enumerate(self._drift) if d == "all"])
        self._mark_grad_rows()
        rows = self.space.touched_rows(self.space.grad_mask)
        if not self._drift_rows.size and "state" not in self._drift:
            return rows
        extra = [self._drift_rows]
        for it in self._state_items:        # optimizers that move rows whose state is non-zero (Adam, ...)
            if self._drift[it.table] == "state":
                extra.append(self.space.rows_where_nonzero(it) + self.space.row_start[it.table])
        return np.union1d(rows, np.concatenate(extra))

    def _mark_grad_rows(self) -> None:
        """Mark in ``space.grad_mask`` the rows of every table's gradient as it stands: per table, one
        row-wise ``any`` over the gradient's raw bits (so -0.0 and NaN count, as in ``guard.grad_rows``)
        written straight into the table's slice of the mask; a gradient of another layout goes through
        ``grad_rows`` (a sparse one's indices; every row if it cannot tell)."""
        self.space.grad_mask.zero_()
        for t, out in zip(self._tables, self._grad_masks):
            g = t.weight.grad
            if g is None:
                continue
            bits = _row_bits(g, out.shape[0])
            if bits is not None:
                torch.any(bits, dim=1, out=out)
                continue
            rows = grad_rows(g, out.shape[0])
            if rows is None:
                out.fill_(True)
            elif rows.numel():
                out[rows.to(out.device)] = True

    def _parity_blocks(self) -> np.ndarray:
        """The parity as ``[blocks, block]`` words (a view)."""
        return self.parity.reshape(-1, self.layout.block)

    def _wide_index(self) -> bool:
        """Whether a message names parity blocks with int64 (2 words) rather than uint32: the parity has
        2^32 blocks or more. The same on every rank (the layout is)."""
        return self.layout.parity_words // self.layout.block >= 1 << 32

    def begin(self, step: int) -> None:
        """Before the optimizer step of ``step``: finish the previous step's round, then copy what this one
        may change (the undo log)."""
        self._check_open()
        if self._open is not None:
            raise InvalidArgument("ECRM.begin() twice without commit(); use `with ecrm.step(step):`")
        self._finish_round()
        t0 = time.perf_counter()
        protected, dense = self._current()
        dense = self._dense_snapshot(dense)
        if protected != self._guard[0]:
            # a protected tensor was replaced, or optimizer state appeared (Adam's first step): the parity is
            # encoded afresh once this step's round tells every rank
            self._open = _Undo(int(step), np.zeros(0, dtype=np.int64),
                               np.zeros((0, self.layout.block), dtype=np.uint32), dense, rebuild=True)
            return
        blocks = self.space.blocks(self._candidate_rows())
        self._open = _Undo(int(step), blocks, self.space.gather(blocks), dense)
        self.stats["seconds_capture"] += time.perf_counter() - t0

    def commit(self) -> None:
        """After the optimizer step: post the code deltas to their holders (collective). Without
        ``overlap``, also receive and apply the ones this rank holds before returning."""
        undo, self._open = self._open, None
        if undo is None:
            raise InvalidArgument("ECRM.commit() without begin(); use `with ecrm.step(step):`")
        t0 = time.perf_counter()
        rebuild = undo.rebuild or self._state_count() != self._counts
        self._undo.append(undo)                     # kept until every rank is known to have finished
        self.data_step = undo.step
        messages, payload_bytes = {}, 0
        if not rebuild and undo.blocks.size:
            delta = undo.old ^ self.space.gather(undo.blocks)
            moved = delta.any(axis=1)                 # the blocks the step changed
            blocks = undo.blocks[moved]
            if blocks.size:
                payload = delta[moved]
                self.fingerprint ^= fingerprint_blocks(payload, blocks)
                messages = self._messages(blocks, payload)
                payload_bytes = payload.nbytes * self.r
        t1 = time.perf_counter()
        self.stats["seconds_encode"] += t1 - t0
        fs.crash_point("ecrm_before_send")
        partial = os.environ.get(fs.CRASH_ENV) == "ecrm_partial_send"
        holders = sorted(messages)
        only = holders[:max(1, len(holders) // 2)] if partial and len(holders) > 1 else ([] if partial else None)
        posting = self._exchange.prepare(undo.step, messages, self.fingerprint, int(rebuild), only=only)
        sent = posting.sent
        if self.overlap and not partial:
            # started by the posting thread: the trainer goes on at once (``_finish_round`` joins it)
            self._poster.submit(functools.partial(self._exchange.send, posting))
        else:
            self._exchange.send(posting)
        if partial:
            self._exchange.wait_sends()
            fs.crash_point("ecrm_partial_send")
        self._round = _Round(undo, self.fingerprint, rebuild, time.perf_counter())
        self.space.clear()
        self.stats["steps"] += 1
        self.stats["bytes_sent"] += sent * 4
        self.stats["last_step_bytes_sent"] = sent * 4
        self.stats["last_step_payload_bytes"] = payload_bytes
        t2 = time.perf_counter()
        self.stats["seconds_exchange"] += t2 - t1
        self.stats["last_step_seconds"] = t2 - t0
        self.stats["seconds"] += t2 - t0
        if not self.overlap:
            self._finish_round()

    def flush(self) -> None:
        """Finish the step whose round is in flight (collective: every rank calls it at the same step):
        afterwards the parity holds every step taken. ``recover``, ``rebuild`` and ``close`` do this
        themselves; a trainer calls it before it stops training for a while."""
        self._check_open()
        self._finish_round()

    def _finish_round(self, timeout: timedelta | None = None) -> None:
        """Receive and apply the pending round (nothing if none). Raises what the process group raises
        when a rank died (or ``timeout`` passed); the round is then not applied on this rank."""
        rnd, self._round = self._round, None
        if rnd is None:
            return
        t0 = time.perf_counter()
        self.stats["seconds_overlapped"] += t0 - rnd.posted
        self._poster.join(None if timeout is None else timeout.total_seconds())   # the round is posted
        got = self._exchange.wait(timeout)
        t1 = time.perf_counter()
        self.stats["seconds_exchange"] += t1 - t0
        self.stats["seconds_wait"] += t1 - t0
        step = rnd.undo.step
        # every rank posted this round after finishing the previous one: no going back before this step
        self._undo = [u for u in self._undo if u.step >= step]
        if rnd.rebuild or any(m.flags & 1 for m in got):
            self._encode_afresh(step)      # a rank's protected tensors changed: encode afresh (collective)
            self.stats["seconds_apply"] += time.perf_counter() - t1
            return
        fps = [0] * self.world_size
        fps[self.rank] = rnd.fingerprint
        received = 0
        parity = self._parity_blocks()
        for m in got:
            fps[m.src] = m.fingerprint
            if m.body.size:
                index, words = self._parse(m.body)
                parity[index] ^= words                # a message names each parity block once
                rnd.undo.applied.append((index, words))
                received += m.body.size * 4
        self._fps[step] = fps
        for old in [s for s in self._fps if s is not None and s < step - 2]:
            del self._fps[old]
        self.applied_step = step
        fs.crash_point("ecrm_after_apply")
        self.stats["bytes_received"] += received
        t2 = time.perf_counter()
        self.stats["seconds_apply"] += t2 - t1
        self.stats["seconds"] += t2 - t0

    def _messages(self, blocks: np.ndarray, payload: np.ndarray) -> dict[int, list]:
        """The message body to every holder, as uint32 arrays laid end to end: ``[n (int64), the parity
        blocks (one uint32 each; int64 where the parity has 2^32 blocks or more), their payload (n
        blocks)]``. ``payload`` (``[len(blocks), block]``: the code deltas of ``blocks`` of the data space)
        is multiplied by each block's coefficient of its parity slot (none for slot 0, all ones)."""
        lay, g = self.layout, self.layout.block
        parts: dict[int, list] = {}
        for j in range(self.r):
            dest, ppos, index = lay.route(self.rank, blocks * g, j)
            pblocks = ppos // g
            if dest.size and dest.min() == dest.max():     # one holder (always with two ranks): no sort
                groups = [(int(dest[0]), slice(None))]
            else:
                order = np.argsort(dest, kind="stable")
                bounds = np.searchsorted(dest[order], np.arange(self.world_size + 1))
                groups = [(dst, order[bounds[dst]:bounds[dst + 1]]) for dst in range(self.world_size)
                          if bounds[dst + 1] > bounds[dst]]
            for dst, sel in groups:
                words = payload[sel]
                if j:                               # row 0 of the code is all ones: XOR, no product
                    coefs = lay.matrix[j, index[sel]]
                    words = gf256.mul_words(words, coefs, np.full(coefs.size, g, dtype=np.int64)).reshape(-1, g)
                parts.setdefault(dst, []).append((pblocks[sel], words))
        index_dtype = np.int64 if self._wide_index() else np.uint32
        out = {}
        for dst, chunks in parts.items():
            n = sum(c[0].size for c in chunks)
            out[dst] = ([np.array([n], dtype=np.int64).view(np.uint32)]
                        + [c[0].astype(index_dtype).view(np.uint32) for c in chunks]
                        + [c[1].reshape(-1) for c in chunks])
        return out

    def _parse(self, body: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A message body of ``_messages`` (a holder's part, one array) as (parity blocks, ``[n, block]``
        words), views of ``body``."""
        g = self.layout.block
        n = int(body[:2].view(np.int64)[0])
        end = 2 + n * (2 if self._wide_index() else 1)
        index = body[2:end].view(np.int64) if self._wide_index() else body[2:end]
        return index, body[end:end + n * g].reshape(n, g)

    # -- taking steps back ----------------------------------------------------------------------------------
    def _undo_data(self, undo: _Undo | None) -> None:
        if undo is None:
            return
        if undo.blocks.size:
            self.space.scatter(undo.blocks, undo.old)
        self._restore_dense(undo.dense)

    def _roll_back_to(self, target: int) -> int:
        """Undo this rank's steps after ``target`` (data, dense state, parity); returns how many."""
        n = 0
        for undo in sorted((u for u in self._undo if u.step > target), key=lambda u: -u.step):
            for index, words in undo.applied:
                self._parity_blocks()[index] ^= words
            self._undo_data(undo)
            n += 1
        self._undo = [u for u in self._undo if u.step <= target]
        self.fingerprint = self._fps.get(target, [self.fingerprint] * self.world_size)[self.rank]
        self.data_step = self.applied_step = target
        return n

    # -- recovery ---------------------------------------------------------------------------------------
    def _status(self) -> dict:
        if self.layout is None:   # recover() built its items
            return {"role": "replacement", "words": self.data_words, "local_block": self._local_block}
        return {"role": "survivor", "data_step": self.data_step, "applied": self.applied_step,
                "undo": sorted(u.step for u in self._undo), "fps": dict(self._fps), "lengths": self.layout.lengths,
                "words": self.data_words, "unit": self.layout.unit, "block": self.layout.block}

    def _decide(self, failed: tuple[int, ...], statuses: list[dict]) -> tuple[int | None, str | None]:
        """The step every rank can reach, or a reason to fall back (the same on every rank)."""
        survivors = [r for r in range(self.world_size) if r not in failed]
        wrong = [r for r in survivors if statuses[r]["role"] != "survivor"]
        if wrong:
            return None, f"rank(s) {wrong} lost their parity state but were not named as failed"
        if len(failed) > self.r:
            return None, f"{len(failed)} ranks failed at once; the parity (r={self.r}) recovers at most {self.r}"
        if not survivors:
            return None, "no rank survived"
        target = min(statuses[r]["applied"] for r in survivors)
        for r in survivors:
            st = statuses[r]
            need = [s for s in (st["data_step"], st["applied"]) if s > target]
            if need and not all(s in st["undo"] for s in range(target + 1, max(need) + 1)):
                return None, (f"rank {r} is at step {st['data_step']} (parity {st['applied']}) and cannot go back "
                              f"to step {target}")
        fps = [statuses[r]["fps"].get(target) for r in survivors]
        if any(f is None for f in fps) or any(f != fps[0] for f in fps):
            return None, f"the survivors do not agree on the fingerprints of step {target}"
        lengths = statuses[survivors[0]]["lengths"]
        block = statuses[survivors[0]]["block"]
        for r in failed:
            if statuses[r].get("words") != lengths[r] or statuses[r].get("local_block", block) % block:
                return None, (f"rank {r}'s replacement protects {statuses[r].get('words')} words, the failed rank "
                              f"had {lengths[r]}: build the same model and optimizer")
        return target, None

    def recover(self, failed_ranks, step: int | None = None) -> ECRMReport:
        """Rebuild the state of ``failed_ranks`` from the parity (collective, on the re-formed default
        process group, with the replacements' ECRMs constructed with ``replacement=True``). See the
        module doc; returns an :class:`ECRMReport` whose ``step`` every rank is at afterwards.
        ``step`` is this survivor's current training step (only used to count the steps to redo)."""
        self._check_open()
        start = time.perf_counter()
        failed = tuple(sorted({int(r) for r in failed_ranks}))
        if not failed or any(not 0 <= r < self.world_size for r in failed):
            raise InvalidArgument(f"failed_ranks must name ranks in [0, {self.world_size}), got {failed_ranks!r}")
        self._open = None
        with contextlib.suppress(Exception):   # as far as the dead ranks let it: applied whole or not at all
            self._finish_round(timeout=timedelta(seconds=min(self.timeout_s, SETTLE_TIMEOUT_S)))
        if self._exchange is not None:
            self._exchange.drop()
        if self.checkpointer is not None and self.checkpointer.needs_rejoin():
            self.checkpointer.rejoin()
        if dist.group.WORLD is not self._world:
            self._join()
        replacement = self.layout is None
        if replacement:
            self._items = self._build_items()
        phases, mark = {}, [time.perf_counter()]

        def lap(name: str) -> None:
            now = time.perf_counter()
            phases[name] = now - mark[0]
            mark[0] = now

        lap("join")
        statuses: list = [None] * self.world_size
        failures.all_gather_object(statuses, self._status(), group=self._group)
        lap("status")
        kept = [r for r in failed if statuses[r]["role"] != "replacement"]
        if kept:   # the same on every rank (statuses are gathered): every rank raises, none waits
            raise InvalidArgument(
                f"rank(s) {kept} are named as failed but kept their ECRM state; a process replacing a failed "
                "rank constructs its ECRM with replacement=True (a drill without a new process calls "
                "discard() on the rank first)")
        target, reason = self._decide(failed, statuses)
        survivors = [r for r in range(self.world_size) if r not in failed]
        newest = max((statuses[r]["data_step"] for r in survivors if statuses[r]["role"] == "survivor"),
                     default=None)
        if reason is not None:
            return self._fall_back(failed, statuses, reason, start, newest)
        if not replacement:
            self._roll_back_to(target)
        else:
            first = statuses[survivors[0]]
            self.layout = StripeLayout(self.world_size, self.k, self.r, first["lengths"], first["unit"],
                                       block=first["block"])
            self._make_space(self.layout.data_words)
            self.parity = np.zeros(self.layout.parity_words, dtype=np.uint32)
            self._fps = {target: statuses[survivors[0]]["fps"][target]}
            self.data_step = self.applied_step = target
        lap("rollback")
        t_dec = time.perf_counter()
        received = self._decode(failed, replacement)
        lap("decode")
        expected = self._fps[target][self.rank]
        ok = (self._full_fingerprint() == expected) if replacement else True
        verdicts: list = [None] * self.world_size
        failures.all_gather_object(verdicts, ok, group=self._group)
        lap("verify")
        if not all(verdicts):
            bad = [r for r, v in enumerate(verdicts) if not v]
            return self._fall_back(failed, statuses, f"the state decoded for rank(s) {bad} does not match the "
                                   f"fingerprint published at step {target}: a parity is inconsistent", start, target)
        received += self._reencode(failed, replacement)
        lap("reencode")
        self.fingerprint = expected
        payload = [_tensors_as(self._dense_state(), _to_numpy) if self.rank == survivors[0] else None]
        failures.broadcast_object_list(payload, src=survivors[0], group=self._group)
        if replacement:
            self._load_dense_state(_tensors_as(payload[0], _from_numpy))
        self._undo = []
        self.space.clear()
        lap("dense")
        return ECRMReport(mode="ecrm", step=target, failed_ranks=failed, replacement=replacement,
                          redo_steps=0 if newest is None else max(newest - target, 0), lost_updates=0,
                          seconds=time.perf_counter() - start, decode_seconds=time.perf_counter() - t_dec,
                          bytes_received=received, phases=phases)

    def _decode(self, failed: tuple[int, ...], replacement: bool) -> int:
        """Survivors send the failed ranks the scaled blocks that decode them; the replacements XOR them
        into their data space and load it. Returns the bytes this rank received."""
        lay, plan = self.layout, []
        for f in failed:
            for i in range(self.k):
                members = lay.members(lay.residue(f, i))
                available = [m for m in members if m[0] not in failed][:self.k]
                shards = [idx if kind == "data" else self.k + idx for _rank, kind, idx in available]
                matrix = gf256.decode_matrix(self.k, self.r, shards)
                for col, (rank, kind, idx) in enumerate(available):
                    if matrix[i, col]:
                        plan.append((rank, f, kind, idx, int(matrix[i, col]), i))
        target = np.zeros((lay.periods, self.k, lay.unit), dtype=np.uint32) if replacement else None
        received = self._send_blocks(plan, None if replacement else self._flat(), target, crash="ecrm_decode")
        if replacement:
            self._load_flat(target)
        return received

    def _reencode(self, failed, replacement: bool) -> int:
        """Every rank sends its contributions to the parity the failed ranks held (zeroed there first)."""
        plan = self._encode_plan(failed)
        if replacement:
            self.parity[:] = 0
        return self._send_blocks(plan, self._flat(), self.parity.reshape(self.layout.periods, self.r, self.layout.unit))

    @staticmethod
    def _lowest(status: dict) -> int:
        """The oldest step a survivor can roll back to (its undo log is a chain ending at its data step)."""
        steps, s = set(status["undo"]), status["data_step"]
        while s in steps:
            s -= 1
        return s

    def _fall_back(self, failed, statuses, reason: str, start: float, newest) -> ECRMReport:
        """Recover from the checkpoint instead (every rank takes this path together): survivors first go
        back to the newest step they can all reach, then the failed ranks restore from the checkpoint
        (partial) or every rank restores the newest global version (full, also when the survivors cannot
        agree on a step). The parity is encoded afresh."""
        replacement = self.rank in failed
        if self.fallback is None:
            raise RecoveryFailed(f"ECRM cannot recover rank(s) {list(failed)}: {reason}. No checkpoint fallback "
                                 "is configured: restore every rank from a checkpoint (or construct the ECRM with "
                                 "checkpointer=)", reason)
        survivors = [r for r in range(self.world_size) if r not in failed and statuses[r]["role"] == "survivor"]
        mode = self.fallback
        common = min((statuses[r]["data_step"] for r in survivors), default=None)
        if not survivors or any(self._lowest(statuses[r]) > common for r in survivors):
            mode = "full"
        if mode == "partial":
            if not replacement:
                self._roll_back_to(common)
            rep = self.checkpointer.recover(list(failed), step=None if replacement else common)
        else:
            rep = self.checkpointer.restore()
        step = rep.step
        self.rebuild(step)
        return ECRMReport(mode=f"fallback-{mode}", step=step, failed_ranks=failed, replacement=replacement,
                          redo_steps=0 if newest is None or step is None else max(newest - step, 0),
                          lost_updates=None, seconds=time.perf_counter() - start, reason=reason, checkpoint=rep)

    def discard(self) -> None:
        """Forget this rank's parity and undo log, as a process replacing a failed rank starts: for drills
        and benchmarks that simulate a failure without killing a process (the model's state should be
        overwritten too, to prove the decode). Call ``recover`` next on every rank."""
        self._check_open()
        self._finish_round()
        self.layout = None
        self.parity = np.zeros(0, dtype=np.uint32)
        self._undo, self._open, self._fps = [], None, {}
        self.data_step = self.applied_step = None

    # -- accounting ---------------------------------------------------------------------------------------
    def memory_bytes(self) -> dict:
        """Bytes this rank holds for ECRM: the parity, the undo logs kept, the protected data."""
        undo = sum(u.old.nbytes + u.blocks.nbytes + sum(i.nbytes + w.nbytes for i, w in u.applied) for u in self._undo)
        return {"parity": int(self.parity.nbytes), "undo": int(undo), "data": self.data_words * 4}

    # -- lifecycle ----------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument("this ECRM is closed")

    def close(self) -> None:
        """Remove the tracking hooks and release the group. Idempotent."""
        if self._closed:
            return
        with contextlib.suppress(Exception):   # let the peers finish the round in flight
            self._finish_round()
        self._poster.close()
        self._closed = True
        for t in self._tables:
            if t.hook is not None:
                t.hook.remove()
        group, self._group = self._group, None
        if group is not None and dist.is_initialized() and dist.group.WORLD is self._world:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)

    def __enter__(self) -> "ECRM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
