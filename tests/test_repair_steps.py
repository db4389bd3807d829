"""Repair's proof in its steps (cnrstore/maintenance/repair.py): the chain types, the states a version is
derived from, the walks over a block's entries (each asking the one rule, engine/chain.py) where a delta's
base has no record, and the per-version decisions, on small hand-made scans (the end-to-end behaviour is
tests/test_repair*.py's)."""

from __future__ import annotations

from types import SimpleNamespace

from cnrstore.engine import record
from cnrstore.engine.index import DenseLoc, RowLoc
from cnrstore.engine.version_edit import VersionEdit
from cnrstore.maintenance import repair
from cnrstore.maintenance.repair import LOST_SEGMENT, Chain, Link

BASELINE = record.FLAG_BASELINE | record.FLAG_FULL
DELTA = record.FLAG_DELTA


def loc(version: int, flags: int = 0, base: int = 0) -> RowLoc:
    """A record's location, its offset the version (so that each is distinct)."""
    return RowLoc(1, 100 * version, 10, 1, flags, base)


def tname(tid: int) -> str:
    return repr(f"t{tid}")


def scan(records: dict[int, RowLoc], parents: dict[int, int | None] | None = None, tid: int = 0,
         block: int = 0) -> repair._Found:
    """What a scan finds: one block's records (version -> location) and COMMITs naming ``parents``."""
    found = repair._Found()
    for v, where in records.items():
        found.rows[(tid, block, v)] = [(where, False)]
        found.valid[(where.segment, where.offset)] = (where.length, record.KIND_ROWS, tid, block, v, where.count,
                                                      where.flags, where.base)
    for v, parent in (parents or {}).items():
        found.commits[v] = (VersionEdit(version=v, versions={v: {"parent": parent}}), None)
    return found


def proof_of(found: repair._Found) -> repair._LogProof:
    return repair._LogProof(found, repair._Plan(), repair.RepairReport("store"), tname)


def lost_base(version: int) -> Link:
    return Link(version, RowLoc(LOST_SEGMENT, 0, 0, 0, record.FLAG_BASELINE, 0),
                f"the base record of table 't0' block 0 at version {version} is missing")


# the types --------------------------------------------------------------------------------------------
def test_a_chain_is_healthy_when_proven_and_whole():
    whole = Chain((Link(2, loc(2)), Link(1, loc(1, BASELINE))))
    damaged = Chain((Link(2, loc(2)), Link(1, loc(1, BASELINE), "damaged")))
    unproven = Chain(unproven="not proven")
    assert whole.healthy and whole.proven
    assert not damaged.healthy and damaged.proven
    assert not unproven.healthy and not unproven.proven
    assert Chain().healthy  # a block never written


def test_a_link_read_before_a_chain_heads_it_unless_the_chain_is_unproven():
    below = Chain((Link(1, loc(1, BASELINE)),))
    head = Link(2, loc(2))
    assert below.after(head) == Chain((head, Link(1, loc(1, BASELINE))))
    assert Chain().after(head) == Chain((head,))
    unproven = Chain(unproven="why")
    assert unproven.after(head) is unproven


def test_a_chain_from_one_of_its_links_is_its_suffix():
    links = (Link(3, loc(3)), Link(2, loc(2)), Link(1, loc(1, BASELINE)))
    chain = Chain(links)
    assert chain.suffixes() == [Chain(links), Chain(links[1:]), Chain(links[2:])]
    assert chain.from_version(2) == Chain(links[1:])
    assert chain.from_version(5) is None
    assert Chain(unproven="why").from_version(2) is None


def test_a_state_gives_a_block_not_listed_the_empty_chain_or_its_unknown_reason():
    listed = Chain((Link(1, loc(1, BASELINE)),))
    assert repair._State(None, {(0, 0): listed}, {}).chain((0, 0)) is listed
    assert repair._State(None, {}, {}).chain((0, 1)) == Chain()
    assert repair._State("the commit of 3 is missing", {}, {}).chain((0, 1)) == \
        Chain(unproven="the commit of 3 is missing")


# the states a version is derived from -----------------------------------------------------------------
def test_parent_states_are_kept_until_the_last_child_takes_them():
    commits = {v: (VersionEdit(version=v, versions={v: {"parent": p}}), None)
               for v, p in {1: None, 2: 1, 3: 1, 4: 9}.items()}
    parents = repair._ParentStates(commits)
    root = parents.parent_of(1, commits[1][0])
    assert (root.unknown, root.blocks) == (None, {})
    state1 = repair._State(None, {(0, 0): Chain()}, {})
    parents.keep(1, state1)
    parents.keep(2, repair._State(None, {}, {}))  # no version derives from 2: not kept
    assert set(parents.states) == {1}
    assert parents.parent_of(2, commits[2][0]) is state1
    assert parents.parent_of(3, commits[3][0]) is state1
    assert parents.states == {}  # both children took it: let go
    assert parents.parent_of(4, commits[4][0]).unknown == \
        "the commit record of version 9 (an ancestor) is missing"
    assert parents.parent_of(5, None).unknown == "the commit record of version 5 is missing"


def test_a_damaged_anchor_listing_gives_way_to_what_the_commits_proved():
    whole = Chain((Link(2, loc(2, BASELINE)),))
    listed_damaged = Chain((Link(2, loc(2, BASELINE), "damaged"),))
    head = Link(2, DenseLoc(1, 0, 8))
    anchored = repair._State(None, {(0, 0): listed_damaged, (0, 1): listed_damaged},
                             {7: Link(2, DenseLoc(LOST_SEGMENT, 0, 0), "missing")})
    committed = repair._State(None, {(0, 0): whole}, {7: head})
    got = repair._anchored(anchored, committed)
    assert got.blocks == {(0, 0): whole, (0, 1): listed_damaged}  # (0, 1): the commits did not prove it
    assert got.dense == {7: head}


def test_a_version_is_unproven_for_its_first_unproven_chain_or_its_unknown_blocks():
    proven = repair._State(None, {(0, 0): Chain((Link(1, loc(1, BASELINE)),))}, {})
    assert repair._unproven(4, proven) is None
    blocks = repair._State(None, {(0, 0): Chain(unproven="the records of table 't0' block 0 are not proven")}, {})
    assert repair._unproven(4, blocks) == "version 4: the records of table 't0' block 0 are not proven"
    unknown = repair._State("the commit record of version 3 (an ancestor) is missing", {}, {})
    assert repair._unproven(4, unknown) == "version 4: the commit record of version 3 (an ancestor) is missing"
    named = repair._State("version 3: gone", {}, {})
    assert repair._unproven(4, named) == "version 3: gone"


# the walks over a block's entries ---------------------------------------------------------------------
def test_the_chain_from_the_headers_follows_the_rule_to_a_baseline():
    found = scan({1: loc(1, BASELINE), 2: loc(2), 3: loc(3, DELTA, 1), 4: loc(4)})
    proof = proof_of(found)
    assert proof.header_chain(0, 0, 4) == Chain((Link(4, loc(4)), Link(3, loc(3, DELTA, 1)), Link(1, loc(1, BASELINE))))
    assert proof.header_chain(0, 0, 2) == Chain((Link(2, loc(2)), Link(1, loc(1, BASELINE))))
    assert proof.header_chain(0, 0, 0) == Chain()


def test_the_chain_from_the_headers_ends_in_a_lost_link_at_a_delta_base_without_a_record():
    found = scan({1: loc(1, BASELINE), 3: loc(3, DELTA, 2), 4: loc(4)})
    assert proof_of(found).header_chain(0, 0, 4) == Chain((Link(4, loc(4)), Link(3, loc(3, DELTA, 2)), lost_base(2)))


def test_the_chain_from_the_headers_skips_versions_a_parent_pointer_jumps_over():
    # version 3 never committed (4's parent is 2): a plain increment at 4 goes on at 2, and a delta on 3
    # goes on at the history's entry before it, as the walk over the history's entries does
    found = scan({1: loc(1, BASELINE), 2: loc(2), 3: loc(3, BASELINE), 4: loc(4), 5: loc(5, DELTA, 3)},
                 parents={2: 1, 4: 2, 5: 4})
    proof = proof_of(found)
    assert proof.header_chain(0, 0, 4) == Chain((Link(4, loc(4)), Link(2, loc(2)), Link(1, loc(1, BASELINE))))
    assert proof.header_chain(0, 0, 3) == Chain((Link(2, loc(2)), Link(1, loc(1, BASELINE))))
    assert proof.header_chain(0, 0, 5) == Chain((Link(5, loc(5, DELTA, 3)), Link(2, loc(2)),
                                                 Link(1, loc(1, BASELINE))))


def test_the_old_index_chain_ends_in_a_lost_link_at_a_delta_base_without_an_entry():
    found = scan({1: loc(1, BASELINE), 3: loc(3, DELTA, 2)})
    old = repair._OldIndex(versions={3: {}}, tables={}, dense_names={},
                           rows={(0, 0): [(1, loc(1, BASELINE)), (3, loc(3, DELTA, 2))]}, dense={}, meta={},
                           damaged={})
    chains, _dense = repair._old_index_state(old, 3, found, tname, proof_of(found))
    assert chains == {(0, 0): Chain((Link(3, loc(3, DELTA, 2)), lost_base(2)))}
    chains, _dense = repair._old_index_state(old, 2, found, tname, proof_of(found))
    assert chains == {(0, 0): Chain((Link(1, loc(1, BASELINE)),))}


def test_the_damage_of_each_entry_is_that_of_the_first_bad_link_its_chain_reads():
    plan = repair._Plan(tables={0: SimpleNamespace(name="t0")})
    chains = {
        2: Chain((Link(2, loc(2)), Link(1, loc(1, BASELINE), "record 1 is damaged"))),
        3: Chain((Link(3, loc(3)), Link(2, loc(2)), Link(1, loc(1, BASELINE), "record 1 is damaged"))),
        5: Chain((Link(5, loc(5, DELTA, 4)),)),  # its base entry is in no chain
        6: Chain((Link(6, loc(6, BASELINE)),)),
    }
    for v, chain in chains.items():
        plan.versions[v] = {}
        plan.chains[v] = {(0, 0): chain}
        plan.dense[v] = {}
    report = repair.RepairReport("store")
    _rows, _dense, damaged = repair._entries(plan, report)
    assert damaged == {
        2: [{"table": 0, "block": 0, "why": "record 1 is damaged"}],
        3: [{"table": 0, "block": 0, "why": "record 1 is damaged"}],
        5: [{"table": 0, "block": 0, "why": "the base record of table id 0 block 0 at version 4 is missing"}],
    }
    assert report.damaged[5] == ["table 't0' block 0: the base record of table id 0 block 0 at version 4 is missing"]
