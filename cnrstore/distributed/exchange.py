"""ECRM's per-step message round: one message from every rank to every other, of sizes agreed in advance
(docs/DESIGN.md, "ECRM").

A point-to-point receive must know its size. Instead of exchanging sizes first (a second round trip),
each ordered pair of ranks keeps a *capacity*: the receiver posts a receive of that many words, the
sender sends exactly that many (its message, zero-padded). A message longer than the capacity sends its
head in the round and the rest as a second message to the same peer, whose size the receiver reads from
the head. Both ends set the next capacity from the same numbers -- the lengths of the pair's recent
messages (``CAPACITY_WINDOW`` of them, plus a quarter) -- so they agree without talking. In a steady run
every step is one round.

Every message starts with a header (``HEADER_WORDS`` int32 words): its total length (int64), the step
(int64), the sender's data fingerprint (uint64) and flags (int32), then the caller's body. Every rank
sends to every other rank each round, even with an empty body: a completed round proves that every rank
has entered it, and carries every rank's fingerprint.

Nothing here knows about parity; ``ecrm.ECRM`` builds the bodies and applies what arrives.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch

from ..errors import InvalidArgument
from . import failures

__all__ = ["Message", "Posting", "PairExchange", "HEADER_WORDS", "INITIAL_CAPACITY_WORDS", "CAPACITY_WINDOW"]

HEADER_WORDS = 8
#: The capacity (words) of a pair before its first message: a larger first message takes two messages.
INITIAL_CAPACITY_WORDS = 1 << 12
#: How many of a pair's latest message lengths set its capacity.
CAPACITY_WINDOW = 16
_ROUND = 256          # capacities are multiples of this many words


@dataclass
class Posting:
    """A round ``PairExchange.prepare`` made ready and ``send`` starts: the messages to send (``(words,
    peer)``, views of the send buffers ``keep``), a receive buffer per peer (of the pair's capacity,
    ``recv_capacity``), and the words the round sends."""
    step: int
    sends: list
    keep: list
    recvs: dict
    recv_capacity: dict
    sent: int
    epoch: int


@dataclass
class Message:
    """What one peer sent in one round."""
    src: int
    step: int
    fingerprint: int
    flags: int
    body: np.ndarray     # uint32 words (a view of the receive buffer)


class _Pair:
    """The capacity of one direction of one pair, from its recent message lengths (both ends keep one)."""

    def __init__(self):
        self.capacity = INITIAL_CAPACITY_WORDS
        self.recent: deque = deque(maxlen=CAPACITY_WINDOW)

    def saw(self, need: int) -> None:
        self.recent.append(int(need))
        want = max(self.recent) * 5 // 4
        self.capacity = max(HEADER_WORDS, -(-want // _ROUND) * _ROUND)


def _header(need: int, step: int, fingerprint: int, flags: int) -> np.ndarray:
    head = np.zeros(HEADER_WORDS, dtype=np.uint32)
    head[0:2] = np.array([need], dtype=np.int64).view(np.uint32)
    head[2:4] = np.array([step], dtype=np.int64).view(np.uint32)
    head[4:6] = np.array([fingerprint], dtype=np.uint64).view(np.uint32)
    head[6] = flags
    return head


class PairExchange:
    """Rounds of one message from this rank to every other rank of ``group`` (module doc), a gloo group
    over every rank of the job (its group ranks are the global ranks). Every rank posts the same rounds in
    the same order; ``post`` then ``wait``, one round at a time."""

    def __init__(self, group, rank: int, world_size: int):
        self.group, self.rank, self.world_size = group, int(rank), int(world_size)
        self.peers = [q for q in range(self.world_size) if q != self.rank]
        self._send = {q: _Pair() for q in self.peers}
        self._recv = {q: _Pair() for q in self.peers}
        self._round = None
        # one send buffer per peer, reused by every round: a round's sends are finished (``wait``) before
        # the next is posted; ``drop`` forgets them (a dropped round's sends may still read them)
        self._buffers: dict[int, np.ndarray] = {}
        self._prepared: Posting | None = None    # a round prepared and not sent yet
        self._epoch = 0            # ``drop`` counts up: a posting prepared before it is not sent

    @property
    def pending(self) -> bool:
        """A round was posted and not waited for."""
        return self._round is not None

    def post(self, step: int, bodies: dict, fingerprint: int, flags: int = 0, only=None) -> int:
        """Start round ``step``: send ``bodies[q]`` (uint32 words, or a list of uint32 arrays sent end to
        end; empty if absent) to every peer ``q`` and receive every peer's message. The words are copied
        once, into the peer's send buffer: the caller may reuse them once ``post`` returns. ``only``
        limits the sends to those peers (a crash test's partial send). Returns the words sent.
        ``prepare`` then ``send``, in one go."""
        posting = self.prepare(step, bodies, fingerprint, flags, only)
        self.send(posting)
        return posting.sent

    def prepare(self, step: int, bodies: dict, fingerprint: int, flags: int = 0, only=None) -> "Posting":
        """The first half of ``post``, on the caller's thread: size every message (``Posting.sent``: the
        words the round sends; the pairs' next capacities), copy it into its peer's send buffer and make
        the receive buffers. What is left for ``send`` is the gloo calls alone, which release the GIL:
        ``send`` it next, on any thread, before the next ``prepare``."""
        if self._round is not None or self._prepared is not None:
            raise InvalidArgument("PairExchange.post() while a round is pending: wait() for it first")
        targets = set(self.peers if only is None else [q for q in self.peers if q in set(only)])
        empty = np.zeros(0, dtype=np.uint32)
        sends, keep, sent = [], [], 0
        for q in self.peers:
            body = bodies.get(q, empty)
            parts = body if isinstance(body, (list, tuple)) else [body]
            need = HEADER_WORDS + sum(int(b.size) for b in parts)
            pair = self._send[q]
            cap = pair.capacity
            pair.saw(need)
            if q not in targets:
                continue
            buf = self._buffers.get(q)
            if buf is None or buf.size < max(cap, need):
                buf = self._buffers[q] = np.zeros(max(cap, need) * 5 // 4, dtype=np.uint32)
            buf[:HEADER_WORDS] = _header(need, step, fingerprint, flags)
            at = HEADER_WORDS
            for b in parts:
                buf[at:at + b.size] = b.reshape(-1)
                at += b.size
            keep.append(buf)
            words = torch.from_numpy(buf.view(np.int32))
            sends.append((words[:cap], q))
            if need > cap:
                sends.append((words[cap:need], q))
            sent += max(cap, need)
        capacity = {q: self._recv[q].capacity for q in self.peers}
        recvs = {q: torch.empty(capacity[q], dtype=torch.int32) for q in self.peers}
        posting = Posting(int(step), sends, keep, recvs, capacity, sent, self._epoch)
        self._prepared = posting
        return posting

    def send(self, posting: "Posting") -> None:
        """The second half of ``post``: start the round's sends and receives (gloo calls only). A gloo
        send to a peer whose receive is already posted may write in the calling thread until the peer's
        I/O thread reads it -- milliseconds when that thread waits for a core -- so ``ecrm`` runs this off
        the training thread. Nothing if the round was dropped since it was prepared."""
        if posting.epoch != self._epoch or posting is not self._prepared:
            return
        try:
            # the group's own send and recv: the group spans the whole job (its ranks are the global ones),
            # and this skips torch.distributed's per-call rank translation
            works = [self.group.send([words], q, 0) for words, q in posting.sends]
            recvs = {q: (buf, self.group.recv([buf], q, 0)) for q, buf in posting.recvs.items()}
            if posting.epoch == self._epoch:
                self._round = (posting.step, works, posting.keep, recvs, posting.recv_capacity)
        finally:
            if self._prepared is posting:
                self._prepared = None

    def wait_sends(self) -> None:
        """Wait until this round's sends are out (a crash test's partial send dies right after)."""
        if self._round is not None:
            for w in self._round[1]:
                w.wait()

    def wait(self, timeout: timedelta | None = None) -> list[Message]:
        """Finish the pending round: every peer's message, by rank. Raises what the process group raises
        when a peer is gone (PeerFailure as soon as a failure is posted, where a ``failures`` watch is
        installed), or when ``timeout`` (per wait) passes; the round is then dropped: nothing of it was
        handed out."""
        if self._round is None:
            raise InvalidArgument("PairExchange.wait() without a posted round")
        step, works, _keep, recvs, recv_capacity = self._round
        self._round = None
        if timeout is None:                # a failure posted on the board ends the wait at once
            def wait(ws: list) -> None:
                failures.wait(ws, self.group)
        else:
            def wait(ws: list) -> None:
                for w in ws:
                    w.wait(timeout)
        wait([w for _buf, w in recvs.values()])
        heads, rest = {}, []
        for q, (buf, _w) in recvs.items():
            words = buf.numpy().view(np.uint32)
            need = int(words[0:2].view(np.int64)[0])
            got = int(words[2:4].view(np.int64)[0])
            if got != step or need < HEADER_WORDS:
                raise InvalidArgument(f"ECRM's round {step} received a message of round {got} from rank {q}: "
                                      "the ranks are out of step (every rank must call ECRM.step for every step)")
            heads[q] = (need, words)
            cap = recv_capacity[q]
            if need > cap:
                more = torch.empty(need - cap, dtype=torch.int32)
                rest.append((q, more, self.group.recv([more], q, 0)))
        wait(works)
        wait([w for _q, _more, w in rest])
        tails = {q: more.numpy().view(np.uint32) for q, more, _w in rest}
        out = []
        for q, (need, words) in heads.items():
            self._recv[q].saw(need)
            full = np.concatenate([words, tails[q]]) if q in tails else words[:need]
            out.append(Message(q, step, int(full[4:6].view(np.uint64)[0]), int(full[6]), full[HEADER_WORDS:need]))
        return out

    def drop(self) -> None:
        """Forget the pending round without waiting (its process group is gone), and the send buffers
        its sends may still read."""
        self._round = None
        self._buffers = {}
        self._prepared = None
        self._epoch += 1
