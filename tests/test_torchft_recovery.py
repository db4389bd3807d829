"""Partial recovery under torchft's Manager and lighthouse (gloo, CPU): a SIGKILLed replica group is started
again and heals through cnrstore's TorchftTransport while the other groups keep their processes
(tools/torchft_replica.py, tools/torchft_job.py)."""

import os
import sys

import pytest

pytest.importorskip("torchft")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools"))
import torchft_job  # noqa: E402
from support import prespawn  # noqa: E402


def _forked(script, arg, env):  # (a group's process from the fork server that imported torch and torchft)
    return prespawn.spawn(script, arg, env=env)

STEPS, KILL_AT, SAVE_EVERY = 14, 7, 3  # saves after steps 2, 5, 8, ...: the newest before the kill is 5's
NEWEST_SAVE = 5
FAST = {"step_sleep": 0.0, "spawner": _forked}


def starts(events) -> list:
    return [e["pid"] for e in events if e["ev"] == "start"]


def commits(events) -> list:
    return [e["step"] for e in events if e["ev"] == "commit"]


def done(events) -> dict:
    (d,) = [e for e in events if e["ev"] == "done"]
    return d


@pytest.mark.parametrize("quorum", ["sync", "async"])
def test_a_replicated_group_heals_from_a_peers_store_and_changed_rows(tmp_path, quorum):
    # (async: torchft's default, where the heal runs beside the healing group's forward pass)
    job = torchft_job.run(str(tmp_path), tables="replicated", replicas=2, steps=STEPS, kill=1, kill_at=KILL_AT,
                          save_every=SAVE_EVERY, async_quorum=quorum == "async", **FAST)
    survivor, replaced = job["events"][0], job["events"][1]
    assert len(starts(survivor)) == 1 and len(starts(replaced)) == 2  # only the killed group was started again
    assert commits(survivor) == list(range(STEPS))
    (heal,) = [e for e in replaced if e["ev"] == "healed" and e["pid"] == starts(replaced)[1]]
    assert heal["step"] > KILL_AT
    # the tables came from the peer's store at its newest save, plus the rows changed since: not whole
    assert heal["version"] is not None and not heal["whole"]
    assert 0 < heal["rows"]["groups.tables.0"] <= 200
    # both groups end bit for bit equal: tables, dense layer and the tables' optimizer state
    assert done(survivor)["digests"] == done(replaced)["digests"]
    assert done(survivor)["sparse"] == done(replaced)["sparse"]


def test_own_shards_recover_cpr_while_the_other_groups_keep_their_state(tmp_path):
    job = torchft_job.run(str(tmp_path / "failed"), tables="own", replicas=3, steps=STEPS, kill=1,
                          kill_at=KILL_AT, save_every=SAVE_EVERY, **FAST)
    ev = job["events"]
    for r in (0, 2):  # the survivors: never restarted, every step committed once, none lost or redone
        assert len(starts(ev[r])) == 1
        assert commits(ev[r]) == list(range(STEPS))
    assert len(starts(ev[1])) == 2
    (heal,) = [e for e in ev[1] if e["ev"] == "healed" and e["pid"] == starts(ev[1])[1]]
    # the lighthouse waits for every group: the step after the kill is the one the replacement rejoins at
    assert heal["step"] == KILL_AT + 1
    assert heal["equals_store"] is True and heal["version_step"] == NEWEST_SAVE  # its shard: its own newest save
    assert commits(ev[1])[-(STEPS - KILL_AT - 1):] == list(range(KILL_AT + 1, STEPS))

    # CPR's semantics, bit for bit: the same job without a kill, where group 1's table and its optimizer
    # state are put back to the same save at the step the replacement rejoined at, ends in the same state
    ref = torchft_job.run(str(tmp_path / "reference"), tables="own", replicas=3, steps=STEPS, kill=1,
                          reset_at=KILL_AT + 1, save_every=SAVE_EVERY, **FAST)["events"]
    (reset,) = [e for e in ref[1] if e["ev"] == "reset"]
    assert reset["version_step"] == NEWEST_SAVE
    for r in range(3):
        assert done(ev[r])["digests"] == done(ref[r])["digests"], r
        assert done(ev[r])["sparse"] == done(ref[r])["sparse"], r
    tops = {r: {k: v for k, v in done(ev[r])["digests"].items() if k.startswith("top.")} for r in range(3)}
    assert tops[0] == tops[1] == tops[2]


def test_ecrm_decodes_the_lost_shard_and_the_job_ends_as_without_the_failure(tmp_path):
    job = torchft_job.run(str(tmp_path / "failed"), tables="own", replicas=3, steps=STEPS, kill=1,
                          kill_at=KILL_AT, save_every=SAVE_EVERY, ecrm=True, **FAST)
    ev = job["events"]
    for r in (0, 2):
        assert len(starts(ev[r])) == 1 and commits(ev[r]) == list(range(STEPS))
    new = starts(ev[1])[1]
    recoveries = [e for r in range(3) for e in ev[r] if e["ev"] == "ecrm"]
    # every group took part in one ECRM recovery, at the step the replacement rejoined at, the replacement
    # decoding (its heal brought the rest: TorchftTransport(tables="keep"))
    assert sorted((e["step"], e["victim"], e["replacement"]) for e in recoveries) == [
        (KILL_AT + 1, 1, False), (KILL_AT + 1, 1, False), (KILL_AT + 1, 1, True)]
    assert [e["pid"] for e in recoveries if e["replacement"]] == [new]
    # ECRM's semantics: no update lost -- every group ends bit for bit as in the same job without a failure
    ref = torchft_job.run(str(tmp_path / "reference"), tables="own", replicas=3, steps=STEPS, kill=None,
                          save_every=SAVE_EVERY, ecrm=True, **FAST)["events"]
    for r in range(3):
        assert done(ev[r])["digests"] == done(ref[r])["digests"], r
        assert done(ev[r])["sparse"] == done(ref[r])["sparse"], r


def test_a_group_of_two_ranks_with_a_sharded_table_heals_rank_by_rank(tmp_path):
    """HSDP's shape: 2 groups of 2 ranks, a table sharded over each group's ranks (DistributedCheckpointer).
    Rank 1 of group 1 is SIGKILLed; the scheduler restarts the whole group; each of its ranks heals from the
    same rank of group 0: that rank's shard from its store, plus the rows changed since."""
    job = torchft_job.run_groups(str(tmp_path), groups=2, group_size=2, steps=16, kill=(1, 1), kill_at=6,
                                 spawner=_forked)
    ev = job["events"]
    for rank in (0, 1):
        assert len(starts(ev[(0, rank)])) == 1 and commits(ev[(0, rank)]) == list(range(16))
        new = starts(ev[(1, rank)])
        assert len(new) == 2
        (heal,) = [e for e in ev[(1, rank)] if e["ev"] == "healed" and e["pid"] == new[1]]
        assert heal["step"] == 7 and heal["version"] is not None and not heal["whole"]
        assert 0 < heal["rows"]["emb"] < 200  # of the shard's 200 rows
        # each rank of the healed group ends bit for bit as the same rank of the other group
        assert done(ev[(0, rank)])["digests"] == done(ev[(1, rank)])["digests"]
        assert done(ev[(0, rank)])["sparse"] == done(ev[(1, rank)])["sparse"]
    tops = [{k: v for k, v in done(ev[(g, r)])["digests"].items() if k.startswith("top.")}
            for g in (0, 1) for r in (0, 1)]
    assert tops[0] == tops[1] == tops[2] == tops[3]
