"""The read-chain rule, stated once (leveldb keeps its key format in one ``dbformat.h``).

A block's *read chain* at version V is the index entries a read of the block at V walks, newest first
(docs/FORMAT.md, "Index" and "DELTA"):

- it starts at the block's newest entry at or before V;
- after a **baseline** (``record.FLAG_BASELINE``) it ends: a baseline shadows everything older;
- after a **cumulative delta** (an entry with a base version, ``record.FLAG_DELTA``) it goes on at the
  block's entry at that base version, skipping the entries in between (the delta holds their rows);
- after any other entry it goes on at the block's entry just before it, and ends after the oldest.

:func:`step` is that rule; every walk of a chain asks it: ``IndexView.row_chain`` over an LMDB cursor, and,
over a block's entries held in a list (oldest first), :func:`next_position`, :func:`walk` and
:func:`lengths` (liveness and GC, retention's pruning, ``cnrstore ls``, repair's proof from the log);
:func:`missing_base` tells a walk that ended at a delta whose base has no entry (a record repair must
report lost, never skip) from one that ended with its chain.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Mapping, Sequence

from . import record

__all__ = ["END", "PREVIOUS", "step", "next_position", "missing_base", "walk", "lengths"]

#: :func:`step`'s answer after a baseline: the chain ends.
END = -1
#: :func:`step`'s answer after a plain increment: the block's entry just before this one.
PREVIOUS = 0


def step(flags: int, base: int) -> int:
    """Where a read chain goes after an entry whose record has ``flags`` and delta ``base`` (0: none):
    :data:`END`, :data:`PREVIOUS`, or the base version (> 0) whose entry comes next."""
    if flags & record.FLAG_BASELINE:
        return END
    return base if base else PREVIOUS


def next_position(i: int, flags: int, base: int, position: Mapping[int, int]) -> int | None:
    """In a block's entries (oldest first), the position the chain visits after position ``i`` (whose
    record has ``flags`` and delta ``base``), or None where it ends: after a baseline, after the oldest
    entry, or at a delta whose base version has no entry (``position``: version -> position)."""
    nxt = step(flags, base)
    if nxt == END:
        return None
    if nxt == PREVIOUS:
        return i - 1 if i else None
    return position.get(nxt)


def missing_base(flags: int, base: int, versions: Container[int]) -> int | None:
    """The base version the chain goes on at after an entry whose record has ``flags`` and delta
    ``base``, where the block has no entry at that version (``versions``: those it has entries at, e.g.
    :func:`next_position`'s ``position``); else None. :func:`next_position` ends such a walk although the
    chain does not."""
    nxt = step(flags, base)
    return nxt if nxt > 0 and nxt not in versions else None


def walk(flags: Sequence[int], bases: Sequence[int], position: Mapping[int, int], start: int) -> Iterator[int]:
    """The positions of a block's entries (oldest first; per entry its record ``flags`` and delta
    ``bases``; ``position``: version -> position) that the chain starting at position ``start`` visits,
    newest first."""
    i: int | None = start
    while i is not None:
        yield i
        i = next_position(i, flags[i], bases[i], position)


def lengths(versions: Sequence[int], flags: Sequence[int], bases: Sequence[int]) -> list[int]:
    """For each of a block's entries (oldest first), the length of the read chain that starts at it: one
    pass, each entry's chain being itself and then the chain of :func:`next_position`."""
    out: list[int] = []
    position: dict[int, int] = {}
    for i, (v, f, b) in enumerate(zip(versions, flags, bases)):
        position[v] = i
        nxt = next_position(i, f, b, position)
        out.append(1 + (out[nxt] if nxt is not None else 0))
    return out
