"""The read-chain rule (cnrstore/engine/chain.py), stated once: its walks against the rule's own words, and
every module that walks a chain agreeing with it (the index's cursor walk, retention's pruning, ``cnrstore
ls``'s chain lengths), on random block histories of baselines, plain increments and cumulative deltas."""

from __future__ import annotations

import os
import re
import tempfile

from hypothesis import given
from hypothesis import strategies as st

from cnrstore.engine import chain, record
from cnrstore.engine.index import Index, RowLoc
from cnrstore.engine.reader import unread_versions
from cnrstore.maintenance.compaction import read_chain_lengths

PACKAGE = os.path.join(os.path.dirname(__file__), os.pardir, "cnrstore")

BASELINE, PLAIN, DELTA = "baseline", "plain", "delta"


@st.composite
def histories(draw):
    """A block's entries, oldest first: (version, kind, base version or 0); versions increase with gaps,
    and a delta's base is an earlier entry's version."""
    n = draw(st.integers(1, 12))
    entries, version = [], 0
    for i in range(n):
        version += draw(st.integers(1, 3))
        kind = draw(st.sampled_from([BASELINE, PLAIN, DELTA] if i else [BASELINE, PLAIN]))
        base = draw(st.sampled_from([v for v, _k, _b in entries])) if kind == DELTA else 0
        entries.append((version, kind, base))
    return entries


def flags_of(kind: str) -> int:
    return {BASELINE: record.FLAG_BASELINE | record.FLAG_FULL, PLAIN: 0, DELTA: record.FLAG_DELTA}[kind]


def oracle(entries, start: int) -> list[int]:
    """The rule in its own words: from ``start``, newest first; a baseline ends the chain; a cumulative
    delta goes on at the entry at its base version; any other entry at the entry just before it."""
    out, i = [], start
    while True:
        out.append(i)
        _v, kind, base = entries[i]
        if kind == BASELINE:
            return out
        if kind == DELTA:
            i = next(j for j, (v, _k, _b) in enumerate(entries) if v == base)
        elif i == 0:
            return out
        else:
            i -= 1


def newest_at_or_before(entries, version: int) -> int | None:
    at = [i for i, (v, _k, _b) in enumerate(entries) if v <= version]
    return at[-1] if at else None


@given(histories())
def test_walk_and_lengths_are_the_rule(entries):
    flags = [flags_of(k) for _v, k, _b in entries]
    bases = [b for _v, _k, b in entries]
    position = {v: i for i, (v, _k, _b) in enumerate(entries)}
    for start in range(len(entries)):
        assert list(chain.walk(flags, bases, position, start)) == oracle(entries, start)
    assert chain.lengths([v for v, _k, _b in entries], flags, bases) == [
        len(oracle(entries, i)) for i in range(len(entries))]


def test_step_names_each_case():
    assert chain.step(record.FLAG_BASELINE, 0) == chain.END
    assert chain.step(record.FLAG_BASELINE | record.FLAG_COMPACTED, 0) == chain.END
    assert chain.step(0, 0) == chain.PREVIOUS
    assert chain.step(record.FLAG_DELTA, 7) == 7
    assert chain.next_position(0, 0, 0, {}) is None  # the oldest entry ends its chain
    assert chain.next_position(3, record.FLAG_DELTA, 9, {}) is None  # a base without an entry


def test_missing_base_names_only_a_delta_base_without_an_entry():
    assert chain.missing_base(record.FLAG_DELTA, 9, {}) == 9
    assert chain.missing_base(record.FLAG_DELTA, 9, {9: 0}) is None
    assert chain.missing_base(record.FLAG_BASELINE | record.FLAG_FULL, 0, {}) is None
    assert chain.missing_base(0, 0, {}) is None  # a plain increment's chain ends after the oldest entry


@given(histories(), st.data())
def test_a_walk_that_lost_an_entry_ends_at_the_missing_base_it_names(entries, data):
    """With one entry gone (a record repair found damaged), the walk from each entry is the rule's over
    the entries left, and :func:`chain.missing_base` names the gone entry exactly where the rule would
    jump to it."""
    gone = data.draw(st.integers(0, len(entries) - 1))
    left = entries[:gone] + entries[gone + 1:]
    flags = [flags_of(k) for _v, k, _b in left]
    bases = [b for _v, _k, b in left]
    position = {v: i for i, (v, _k, _b) in enumerate(left)}
    for start in range(len(left)):
        want, i, missing = [], start, None
        while i is not None:  # the rule in its own words, stopping at a jump to the gone entry
            want.append(i)
            _v, kind, base = left[i]
            if kind == BASELINE:
                i = None
            elif kind == DELTA:
                i = position.get(base)
                missing = base if i is None else None
            else:
                i = i - 1 if i else None
        walked = list(chain.walk(flags, bases, position, start))
        assert walked == want
        assert chain.missing_base(flags[walked[-1]], bases[walked[-1]], position) == missing
        assert missing in (None, entries[gone][0])


@given(histories(), st.lists(st.integers(0, 40), max_size=6))
def test_retention_prunes_exactly_the_entries_no_kept_version_reads(entries, kept):
    kept = sorted(set(kept))
    read = set()
    for k in kept:
        start = newest_at_or_before(entries, k)
        if start is not None:
            read.update(oracle(entries, start))
    want = [v for i, (v, _k, _b) in enumerate(entries) if i not in read]
    assert unread_versions([(v, k == BASELINE, b) for v, k, b in entries], kept) == want


@given(st.lists(histories(), min_size=1, max_size=3), st.lists(st.integers(1, 40), min_size=1, max_size=8))
def test_cnrstore_ls_chain_lengths_are_the_rule(blocks, versions):
    versions = sorted(set(versions))
    entries = [(7, b, v, RowLoc(0, 0, 0, 1, flags_of(k), base))
               for b, history in enumerate(blocks) for v, k, base in history]
    want = []
    for version in versions:
        longest = 0
        for history in blocks:
            start = newest_at_or_before(history, version)
            if start is not None:
                longest = max(longest, len(oracle(history, start)))
        want.append(longest)
    assert read_chain_lengths(entries, versions).tolist() == want


@given(histories(), st.integers(0, 40))
def test_the_index_walks_the_rule(entries, version):
    with tempfile.TemporaryDirectory() as d:
        index = Index(os.path.join(d, "index"), readonly=False, create=True)
        try:
            def body(w):
                for v, kind, base in entries:
                    w.put_row(3, 5, v, RowLoc(0, 0, 0, 1, flags_of(kind), base))
            index.write(body)
            with index.read() as view:
                got = [v for v, _loc in view.row_chain(3, 5, version)]
        finally:
            index.close()
    start = newest_at_or_before(entries, version)
    assert got == ([] if start is None else [entries[i][0] for i in oracle(entries, start)])


#: How the rule's jumps used to be written out in each module: a jump to a delta's base or an end at a
#: baseline decided in place (now each asks chain.step).
_RULE_IDIOMS = [
    re.compile(r"position\.get\(\s*[\w\.\[\]]*\.base\s*\)"),   # the entry at a delta's base, by position
    re.compile(r"\.base\)?\s+if\s+[\w\.\[\]]*\.base\s+else"),    # "... loc.base if loc.base else previous"
    re.compile(r"set_key\([^)]*\bloc\.base\b"),                  # a cursor jumping to a delta's base
]
#: Modules that walk read chains: each must ask the one rule.
_WALKERS = ["engine/index.py", "engine/reader.py", "maintenance/compaction.py", "maintenance/liveness.py",
            "maintenance/repair.py"]


def test_the_rule_is_written_once():
    """No module but engine/chain.py decides where a chain goes next, and each module that walks chains
    imports it."""
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or os.path.samefile(path, chain.__file__):
                continue
            text = open(path, encoding="utf-8").read()
            for idiom in _RULE_IDIOMS:
                assert not idiom.search(text), f"{os.path.relpath(path, PACKAGE)} writes the chain rule out: {idiom.pattern}"
    for rel in _WALKERS:
        text = open(os.path.join(PACKAGE, rel), encoding="utf-8").read()
        assert re.search(r"import chain as chain_rule", text) and "chain_rule." in text, rel
