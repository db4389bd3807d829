"""A torchft ``CheckpointTransport`` backed by the store: ``TorchftTransport`` (DESIGN.md, "Healing under
torchft").

torchft heals a replica group that joins a quorum behind the others: an up-to-date group's transport
``send_checkpoint``s its state at the quorum's step, the healing group's transport ``recv_checkpoint``s it.
torchft's own transports send every byte of that state from the live peer, and hold the peer until they
have. This one sends only what the store lacks:

- **the sender** (``send_checkpoint``, in torchft's quorum, before the step's optimizer step) fingerprints
  its embedding tables as a save does and copies the rows changed since its newest save, and the rest of the
  state dict (dense layers, optimizer state that is not row-wise, torchft's own step, the user's other
  entries); its stall is a save's snapshot, and ``disallow_checkpoint`` never waits for a transfer: the
  image is a copy, served from a thread of its own;
- **the receiver** reads the tables at that save's version straight from the sender's store (a readonly
  open: the store must be on a filesystem it reaches), writes the changed rows over them and takes the rest
  from the peer: the image of exactly the quorum's step, bit for bit.

With ``tables="own"`` each replica group holds its *own* shard of the tables (model-parallel across groups:
no peer has the healing group's rows): the receiver takes its tables and their row-wise optimizer state from
its own store's newest version -- CPR's partial recovery: those rows lose the updates since that save --
and everything else from the peer.

With ``tables="keep"`` the healing group keeps its tables as they are and restores them itself once healed
(ECRM: its shard decoded from the other groups' parity); only the rest comes from the peer.

Where the tables cannot be rebuilt exactly from a stored version (a lossy codec, no save yet, a table that
is not float32) the sender copies them whole: the image is exact, only bigger.
"""

from __future__ import annotations

import io
import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ..errors import InvalidArgument, RecoveryFailed, VersionNotFound

try:
    from torchft.checkpointing.transport import CheckpointTransport
except ImportError as exc:  # pragma: no cover - the Makefile installs it; the message says how otherwise
    raise ImportError(
        "cnrstore.distributed.TorchftTransport needs torchft: pip install 'cnrstore[torchft]' (README, "
        "\"Install\"; torchft 0.2 runs with torch >= 2.7)") from exc

__all__ = ["HealReport", "TorchftTransport"]

#: the key that marks a table's place in the image sent (a dict in place of the tensor)
_TABLE = "__cnrstore_table__"
_HEADER = struct.Struct("<Q")
#: what ``tables=`` may be (the class doc)
MODES = ("replicated", "own", "keep")


@dataclass
class HealReport:
    """One ``recv_checkpoint`` (``TorchftTransport.last_recv``) or ``send_checkpoint`` (``last_send``).

    ``step``: the quorum's step; ``version``: the store version the tables were rebuilt from (None: sent
    whole); ``mode``: ``"replicated"`` or ``"own"``; ``seconds``: the whole call; ``fetch_seconds``: the
    transfer from the peer; ``read_seconds``: reading the store; ``bytes``: bytes sent or received;
    ``rows``: changed rows sent or written over the stored ones, per table; ``whole``: tables sent whole."""

    step: int
    mode: str
    version: int | None = None
    seconds: float = 0.0
    fetch_seconds: float = 0.0
    read_seconds: float = 0.0
    bytes: int = 0
    rows: dict = field(default_factory=dict)
    whole: list = field(default_factory=list)


class _Image:
    """What ``send_checkpoint`` took: the state dict with each table replaced by a marker (its changed rows,
    or the whole table), and the save its rows are relative to."""

    def __init__(self, step: int, state: object, base, store_path: str):
        self.step = step
        self.state = state
        self.base = base
        self.store_path = store_path
        self.payload: bytes | None = None  # serialized once, by the first fetch
        self.lock = threading.Lock()


class TorchftTransport(CheckpointTransport):
    """A torchft ``CheckpointTransport`` that heals from the store (module doc).

    ``checkpointer``: this replica group rank's ``cnrstore.torch.Checkpointer`` (or a
    ``DistributedCheckpointer``: its local one), saving the model and optimizers that torchft's
    ``state_dict`` returns. ``tables``: ``"replicated"`` (every replica group holds the same tables: rebuild
    them from the sender's store) or ``"own"`` (each holds its own shard: rebuild them from this group's own
    store, CPR) or ``"keep"`` (each holds its own shard and restores it itself after the heal: ECRM's decode).
    ``host``: the address peers connect to (default: this host's name); ``port``: 0 picks one (the server
    listens on every interface, as torchft's HTTP transport does). A fetch waits for the peer's image, and
    for the save it builds on to commit, as long as torchft's ``timeout`` for the call."""

    def __init__(self, checkpointer, *, tables: str = "replicated", host: str | None = None, port: int = 0):
        local = getattr(checkpointer, "local", checkpointer)
        if not hasattr(local, "image_rows"):
            raise InvalidArgument(f"TorchftTransport needs a cnrstore Checkpointer, got {type(checkpointer).__name__}")
        if tables not in MODES:
            raise InvalidArgument(f"tables must be one of {MODES}, got {tables!r}")
        self.checkpointer = local
        self.tables = tables
        self.last_send: HealReport | None = None
        self.last_recv: HealReport | None = None
        self._image: _Image | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._sock = socket.create_server(("", port), backlog=16)
        self._address = (host or socket.gethostname(), self._sock.getsockname()[1])
        self._peer_stores: dict = {}
        self._thread = threading.Thread(target=self._serve, name="cnrstore-torchft-transport", daemon=True)
        self._thread.start()

    # -- CheckpointTransport ----------------------------------------------------------------------------
    def metadata(self) -> str:
        return json.dumps({"cnrstore": 1, "host": self._address[0], "port": self._address[1]})

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        """Take the image of ``state_dict`` at ``step`` (tables as changed rows over the newest save) and
        serve it until the next one; returns once it is taken."""
        start = time.perf_counter()
        report = HealReport(step=step, mode=self.tables)
        state, base = self._take(state_dict, report)
        image = _Image(step, state, base, self.checkpointer.store.path)
        with self._cond:
            self._image = image
            self._cond.notify_all()
        report.seconds = time.perf_counter() - start
        self.last_send = report

    def disallow_checkpoint(self) -> None:
        """Nothing to wait for: the image served is a copy, so the state dict may change at once."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        """The state dict at ``step``: fetched from the peer ``metadata`` names, its tables rebuilt from the
        store (module doc). Raises ``RecoveryFailed`` when the peer or the store cannot give it."""
        start = time.perf_counter()
        report = HealReport(step=step, mode=self.tables)
        try:
            peer = json.loads(metadata)
            address = (peer["host"], int(peer["port"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise RecoveryFailed(f"the peer's checkpoint metadata {metadata!r} is not a cnrstore "
                                 "TorchftTransport's: every replica group must use the same transport") from exc
        header, payload = _fetch(address, step, timeout.total_seconds())
        report.fetch_seconds = time.perf_counter() - start
        report.bytes = len(payload)
        state = torch.load(io.BytesIO(payload), weights_only=False)
        markers = []
        _walk(state, lambda m: markers.append(m) or m)
        self._rebuild(markers, header, report)
        state = _walk(state, lambda m: m["tensor"])
        report.seconds = time.perf_counter() - start
        self.last_recv = report
        return state

    def shutdown(self, wait: bool = True) -> None:
        with self._cond:
            self._closed = True
            self._image = None
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if wait:
            self._thread.join()
        for store in self._peer_stores.values():
            store.close()
        self._peer_stores.clear()

    # -- the sender -------------------------------------------------------------------------------------
    def _take(self, state_dict, report: HealReport):
        """Copy ``state_dict``: each table (a tensor sharing memory with a table the Checkpointer saves) as a
        marker with its changed rows (or whole), every other tensor cloned to host memory -> (the copy, the
        base its rows are relative to: a PendingSave, a version or None)."""
        if self.tables != "replicated":  # (the receiver restores its own tables: no rows of ours)
            base, tables, exact = None, self.checkpointer.image_rows(changed=False)[1], False
        else:
            base, tables, exact = self.checkpointer.image_rows()
            if base is None or (not isinstance(base, int) and base.done() and base.failure() is not None):
                base, exact = None, False
        by_memory = {}
        for t, sources, rows in tables:
            for name, view, live in sources:
                by_memory[(live.data_ptr(), live.dtype, live.numel())] = (t, name, view, live, rows)

        def take(x):
            if not isinstance(x, torch.Tensor):
                return x
            hit = by_memory.get((x.data_ptr(), x.dtype, x.numel())) if x.numel() else None
            if hit is None:
                return x.detach().to("cpu", copy=True)
            t, name, view, live, rows = hit
            marker = {_TABLE: name, "shape": tuple(x.shape), "offset": t.offset, "rows_total": t.num_rows}
            if self.tables != "replicated":
                return marker
            if not exact or rows is None:
                marker["whole"] = view.detach().to("cpu", copy=True)
                report.whole.append(name)
            else:
                marker["rows"] = rows
                marker["values"] = view.detach()[rows.to(view.device)].cpu()
                report.rows[name] = int(rows.numel())
            return marker

        with torch.no_grad():
            return _walk_tensors(state_dict, take), base

    def _serve(self) -> None:
        while True:
            try:
                conn, _addr = self._sock.accept()
            except OSError:
                return  # shut down
            threading.Thread(target=self._answer, args=(conn,), daemon=True,
                             name="cnrstore-torchft-transport-send").start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                request = json.loads(_recv_frame(conn))
                header, payload = self._image_for(int(request["step"]), float(request["timeout"]))
            except Exception as exc:  # noqa: BLE001 - the peer gets the reason, this trainer goes on
                header, payload = {"error": f"{type(exc).__name__}: {exc}"}, b""
            try:
                _send_frame(conn, json.dumps(header).encode())
                _send_frame(conn, payload)
            except OSError:
                pass  # the peer went away: it will ask again at its next quorum

    def _image_for(self, step: int, timeout: float) -> tuple[dict, bytes]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed and (self._image is None or self._image.step < step):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RecoveryFailed(f"this peer took no image of step {step} within {timeout:.0f} s")
                self._cond.wait(left)
            image = self._image
        if image is None:
            raise RecoveryFailed("this peer's transport was shut down")
        if image.step != step:
            raise RecoveryFailed(f"this peer is at step {image.step}, not {step}: join the next quorum")
        version = image.base
        if version is not None and not isinstance(version, int):
            if not version.wait_done(max(0.0, deadline - time.monotonic())):
                raise RecoveryFailed(f"the save the image of step {step} builds on did not commit in {timeout:.0f} s")
            if version.failure() is not None:
                raise RecoveryFailed(f"the save the image of step {step} builds on failed "
                                     f"({type(version.failure()).__name__}): heal again after the next save")
            version = version.wait()
        with image.lock:
            if image.payload is None:
                buf = io.BytesIO()
                torch.save(image.state, buf)
                image.payload = buf.getvalue()
        return {"version": version, "store": image.store_path, "step": step}, image.payload

    # -- the receiver -----------------------------------------------------------------------------------
    def _rebuild(self, markers: list, header: dict, report: HealReport) -> None:
        """Give each marker its tensor: the stored rows (the peer's store at its version, or this group's own
        newest) with the changed rows written over them, or the whole table sent.

        The rows are decoded straight into this group's own live tensor of the same table where it has one
        of the same shape (fp32, contiguous, in host memory), as ``restore()`` does: the healing group's
        state is being replaced anyway, and torchft's ``load_state_dict`` then finds it in place."""
        own = {name: (t, view, live) for t, sources, _r in self.checkpointer.image_rows(changed=False)[1]
               for name, view, live in sources}
        if self.tables == "keep":  # (its own live tensors, as they are: the caller restores them)
            for m in markers:
                if m[_TABLE] not in own:
                    raise RecoveryFailed(f"tables='keep': the peer sent table {m[_TABLE]!r}, which this replica "
                                         "group's Checkpointer does not save")
                m["tensor"] = own[m[_TABLE]][2].detach()
            return
        if self.tables == "own":
            store = self.checkpointer.store
            latest = store.latest()
            if latest is None and markers:
                raise RecoveryFailed("tables='own': this replica group's store holds no version to restore its "
                                     f"tables from ({store.path})")
            version = None if latest is None else latest.version
            for m in markers:
                if m[_TABLE] not in own:
                    raise RecoveryFailed(f"tables='own': the peer sent table {m[_TABLE]!r}, which this replica "
                                         "group's Checkpointer does not save")
                t, _view, live = own[m[_TABLE]]
                m["shape"], m["offset"], m["rows_total"] = tuple(live.shape), t.offset, t.num_rows
        else:
            version = header.get("version")
            store = self._peer_store(header["store"]) if any("whole" not in m for m in markers) else None
        reads, outs = {}, {}
        for m in markers:
            if "whole" in m:
                report.whole.append(m[_TABLE])
                continue
            if m[_TABLE] in outs:  # (a table in the state dict twice: a tied weight) -- one read, one tensor
                m["out"], m["tensor"] = outs[m[_TABLE]]
                continue
            numel = 1
            for d in m["shape"]:
                numel *= d
            width = numel // m["rows_total"]
            _t, view, live = own.get(m[_TABLE], (None, None, None))
            if (live is not None and tuple(live.shape) == tuple(m["shape"]) and live.dtype == torch.float32
                    and live.device.type == "cpu" and live.is_contiguous()):
                out, m["tensor"] = view.detach(), live.detach()
            else:
                out = torch.empty((m["rows_total"], width), dtype=torch.float32)
                m["tensor"] = out.reshape(m["shape"])
            reads[m[_TABLE]] = (m["offset"], out)
            m["out"] = out
            outs[m[_TABLE]] = (out, m["tensor"])
        if reads:
            start = time.perf_counter()
            try:
                store.read_tables(reads, version=version)
            except VersionNotFound as exc:  # (dropped by the peer's retention since: heal at the next quorum)
                raise RecoveryFailed(f"version {version} of {store.path}, which the image of step {report.step} "
                                     f"builds on, is gone ({exc}): torchft heals again at its next quorum") from exc
            report.read_seconds = time.perf_counter() - start
            report.version = version
        with torch.no_grad():
            for m in markers:
                if "whole" in m:
                    m["tensor"] = m["whole"].reshape(m["shape"])
                elif "rows" in m:
                    m["out"][m["rows"]] = m["values"]
                    report.rows[m[_TABLE]] = int(m["rows"].numel())

    def _peer_store(self, path: str):
        store = self._peer_stores.get(path)
        if store is None:
            import cnrstore  # (the package's top level: opening a store)
            try:
                store = cnrstore.open(path, readonly=True)
            except Exception as exc:
                raise RecoveryFailed(f"cannot open the peer's store {path} to heal from ({type(exc).__name__}: "
                                     f"{exc}): its stores must be on a filesystem every replica group reaches") from exc
            self._peer_stores[path] = store
        return store


# -- helpers ---------------------------------------------------------------------------------------------
def _walk_tensors(obj, fn):
    """``obj`` with every tensor replaced by ``fn(tensor)`` (dicts, lists and tuples rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, _walk_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_walk_tensors(v, fn) for v in obj)
    return obj


def _walk(obj, fn):
    """``obj`` with every table marker replaced by ``fn(marker)``."""
    if isinstance(obj, dict):
        if _TABLE in obj:
            return fn(obj)
        return type(obj)((k, _walk(v, fn)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_walk(v, fn) for v in obj)
    return obj


def _send_frame(conn: socket.socket, data: bytes) -> None:
    conn.sendall(_HEADER.pack(len(data)))
    if data:
        conn.sendall(data)


def _recv_exact(conn: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = conn.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k
    return buf


def _recv_frame(conn: socket.socket) -> bytearray:
    (n,) = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
    return _recv_exact(conn, n)


def _fetch(address: tuple, step: int, timeout: float) -> tuple[dict, bytearray]:
    """Ask the peer at ``address`` for its image of ``step`` -> (header, payload); RecoveryFailed if it has
    none (its reason) or cannot be reached."""
    try:
        # (the peer waits up to ``timeout`` for its image and says why it has none: wait a little longer)
        with socket.create_connection(address, timeout=timeout + 5.0) as conn:
            _send_frame(conn, json.dumps({"step": step, "timeout": timeout}).encode())
            header = json.loads(_recv_frame(conn))
            payload = _recv_frame(conn)
    except OSError as exc:
        raise RecoveryFailed(f"fetching step {step} from the peer at {address[0]}:{address[1]} failed: "
                             f"{type(exc).__name__}: {exc}") from exc
    if "error" in header:
        raise RecoveryFailed(f"the peer at {address[0]}:{address[1]} has no image of step {step}: {header['error']}")
    return header, payload
