"""Rebuilding a store prefix's lost or damaged pointer CURRENT from its objects (issue 49;
cnrstore/maintenance/remote_pointer.py): ``cnrstore.repair(DIR, remote=URL)`` and ``cnrstore --remote URL repair
DIR`` pick the newest index snapshot that verifies, rebuild the writers' history from the folders, and put one
pointer; a repair killed at any of its object effects, then run again, gives the same bucket; nothing is deleted."""

from __future__ import annotations

import json

import boto3
import numpy as np
import pytest

import cnrstore
from cnrstore import cli, knobs
from cnrstore.engine import filenames
from cnrstore.engine import remote as remote_tier
from cnrstore.errors import CorruptionError, InvalidArgument, RemoteObjectMissing, RemoteStorageError, StoreNotFound
from cnrstore.maintenance.remote_pointer import rebuild_history, repair_pointer

from support.crash_states import DictObjectStore
from support.s3_remote import s3_options

ROWS, DIM = 256, 4


@pytest.fixture(autouse=True)
def small_segments(monkeypatch):
    """2 KiB segments: each version spans several segment objects."""
    monkeypatch.setattr(knobs, "SEGMENT_BYTES", 2 << 10)


def write_versions(store, content: dict, steps, seed: int) -> None:
    """Checkpoints of random rows of table "t" (created if needed); ``content[v]``: the whole table at v."""
    rng = np.random.default_rng(seed)
    if "t" not in store.tables():
        store.create_table("t", ROWS, DIM)
    state = content[max(content)].copy() if content else np.zeros((ROWS, DIM), np.float32)
    for step in steps:
        rows = np.unique(rng.integers(0, ROWS, ROWS // 2)) if content else np.arange(ROWS)
        values = rng.standard_normal((rows.size, DIM)).astype(np.float32)
        with store.checkpoint(step=step) as ck:
            ck.put_rows("t", rows, values)
        state[rows] = values
        content[ck.version] = state.copy()


def four_versions(path, objects) -> dict:
    """A writer at ``path`` on ``objects`` with versions 1..4 (a copy point after each); their content."""
    content: dict = {}
    with cnrstore.open(path, create=True, remote=objects) as store:
        write_versions(store, content, range(4), seed=1)
    assert sorted(content) == [1, 2, 3, 4]
    return content


def assert_reads(path, objects, content) -> None:
    """A fresh read cache at ``path`` lists exactly ``content``'s versions, each bit for bit, and verifies."""
    with cnrstore.open(path, readonly=True, remote=objects) as store:
        assert [v.version for v in store.versions()] == sorted(content)
        for v, want in content.items():
            got = store.read_table("t", version=v)
            assert got.tobytes() == want.tobytes(), f"version {v}"
        assert store.verify().ok


def snapshot_keys(objects) -> list[str]:
    return sorted(k for k in objects.objects if "/index/" in k)


def test_a_deleted_pointer_is_rebuilt_and_every_version_reads_bit_for_bit(tmp_path):
    objects = DictObjectStore()
    content = four_versions(tmp_path / "w", objects)
    original = remote_tier.read_pointer(objects)
    objects.objects.pop("CURRENT")
    before = dict(objects.objects)
    with pytest.raises(RemoteObjectMissing, match=r"CURRENT is missing.*cnrstore --remote mem://remote repair DIR"):
        cnrstore.open(tmp_path / "fresh", readonly=True, remote=objects)

    report = cnrstore.repair(tmp_path / "cache", remote=objects)
    assert report.ok and report.pointer is not None and report.pointer.rebuilt
    assert report.pointer.previous == "missing" and report.pointer.versions == [1, 2, 3, 4]
    assert report.pointer.snapshot == original.snapshot and report.pointer.writer == original.writer
    assert report.versions_recovered == [1, 2, 3, 4]
    assert "rebuilt" in report.notes[0]
    rebuilt = remote_tier.read_pointer(objects)
    assert (rebuilt.generation, rebuilt.snapshot, rebuilt.snapshot_xxh3, rebuilt.writer, rebuilt.writers) == \
        (original.generation, original.snapshot, original.snapshot_xxh3, original.writer, original.writers)
    assert {k: v for k, v in objects.objects.items() if k != "CURRENT"} == before  # nothing else touched
    assert_reads(tmp_path / "fresh", objects, content)
    again = repair_pointer(objects)
    assert not again.rebuilt and again.previous == "sound"

    # the writer's own directory still writes the prefix (its identity is the pointer's writer)
    with cnrstore.open(tmp_path / "w", remote=objects) as writer:
        write_versions(writer, content, [9], seed=2)
    assert remote_tier.read_pointer(objects).generation == original.generation + 1
    assert_reads(tmp_path / "fresh2", objects, content)


def test_a_damaged_pointer_is_rebuilt(tmp_path):
    objects = DictObjectStore()
    content = four_versions(tmp_path / "w", objects)
    data = bytearray(objects.objects["CURRENT"])
    data[len(data) // 2] ^= 0x01
    objects.objects["CURRENT"] = bytes(data)
    with pytest.raises(CorruptionError, match="CURRENT is damaged.*cnrstore --remote URL repair DIR"):
        cnrstore.open(tmp_path / "fresh", readonly=True, remote=objects)
    report = repair_pointer(objects)
    assert report.rebuilt and report.previous.startswith("damaged: ") and report.ok
    assert report.versions == [1, 2, 3, 4]
    assert_reads(tmp_path / "fresh", objects, content)
    with cnrstore.open(tmp_path / "w", remote=objects) as writer:
        write_versions(writer, content, [9], seed=2)
    assert_reads(tmp_path / "fresh2", objects, content)


def newer_leftovers(tmp_path, objects, content) -> dict[str, dict[str, bytes]]:
    """Buckets holding, beside versions 1..4's objects and no CURRENT, a newer snapshot (a copy point cut short
    before its pointer) that does not verify, by how: its LMDB meta pages zeroed; a segment it names missing
    (a partial copy); a byte of a record it names flipped."""
    base = dict(objects.objects)
    with cnrstore.open(tmp_path / "w", remote=objects) as writer:
        write_versions(writer, dict(content), [5], seed=3)
    new_snapshot = max(snapshot_keys(objects))
    new_segments = sorted(k for k in objects.objects if k not in base and "/segments/" in k)
    assert new_snapshot not in base and new_segments
    leftovers = {k: objects.objects[k] for k in [new_snapshot, *new_segments]}
    base.pop("CURRENT")
    unopenable = dict(base, **leftovers)
    unopenable[new_snapshot] = bytes(8192) + leftovers[new_snapshot][8192:]
    partial = dict(base, **leftovers)
    partial.pop(new_segments[-1])
    flipped = dict(base, **leftovers)
    seg = bytearray(leftovers[new_segments[0]])
    seg[len(seg) // 2] ^= 0x40
    flipped[new_segments[0]] = bytes(seg)
    return {"unopenable": unopenable, "partial": partial, "flipped": flipped}


def test_a_newer_snapshot_that_does_not_verify_is_reported_and_an_older_one_chosen(tmp_path):
    objects = DictObjectStore()
    content = four_versions(tmp_path / "w", objects)
    chosen = remote_tier.read_pointer(objects).snapshot
    why = {"unopenable": "does not open as an LMDB index", "partial": "segment 0", "flipped": "verify of its versions"}
    for name, bucket in newer_leftovers(tmp_path, objects, content).items():
        state = DictObjectStore(bucket)
        newest = max(snapshot_keys(state))
        report = repair_pointer(state)
        assert report.rebuilt and report.snapshot == chosen and report.versions == [1, 2, 3, 4], name
        assert not report.ok and len(report.problems) == 1 and newest in report.problems[0], name
        assert why[name] in report.problems[0], (name, report.problems)
        pointer = remote_tier.read_pointer(state)
        assert pointer.generation >= int(newest.rsplit("/", 1)[-1][:16], 16)  # past every snapshot: immutable
        assert {k: v for k, v in state.objects.items() if k != "CURRENT"} == bucket  # nothing deleted
        assert_reads(tmp_path / f"fresh-{name}", state, content)
    # without the record check, a flipped record byte is not seen: the newer snapshot is chosen
    state = DictObjectStore(newer_leftovers(tmp_path, DictObjectStore(objects.objects), content)["flipped"])
    assert repair_pointer(state, check_records=False).snapshot != chosen


def test_a_takeover_writers_history_is_rebuilt_and_its_directory_writes_on(tmp_path):
    """Writer A wrote versions 1-2, machine B took the prefix over and wrote 3-4: B's claim names the pointer that
    is gone, so B's writable open is refused until the repair rebuilds it, with B's history."""
    objects = DictObjectStore()
    content: dict = {}
    with cnrstore.open(tmp_path / "a", create=True, remote=objects) as a:
        write_versions(a, content, range(2), seed=1)
    cnrstore.open(tmp_path / "b", readonly=True, remote=objects).close()
    with cnrstore.open(tmp_path / "b", remote=objects) as b:
        write_versions(b, content, range(2, 4), seed=2)
    original = remote_tier.read_pointer(objects)
    assert len(original.writers) == 2
    objects.objects.pop("CURRENT")
    with pytest.raises(RemoteStorageError, match="holds no pointer"):
        cnrstore.open(tmp_path / "b", remote=objects)
    report = repair_pointer(objects)
    assert report.rebuilt and report.versions == [1, 2, 3, 4]
    assert remote_tier.read_pointer(objects).writers == original.writers
    assert remote_tier.read_identity(str(tmp_path / "b")).writers == original.writers
    assert_reads(tmp_path / "fresh", objects, content)
    with cnrstore.open(tmp_path / "b", remote=objects) as b:
        write_versions(b, content, [9], seed=3)
    assert_reads(tmp_path / "fresh2", objects, content)


def test_rebuild_history_places_each_segment_in_the_folder_that_holds_it():
    a, b, c = "a" * 32, "b" * 32, "c" * 32
    # a wrote 0-5 (4 and 5 also stale copies after b took over at 4), b wrote 4-7, c took over at 8
    folders = {a: {1: 10, 2: 10, 4: 10, 5: 10}, b: {4: 10, 5: 10, 7: 10}, c: {8: 10}}
    assert rebuild_history(c, {1: 10, 4: 10, 7: 10, 8: 10}, folders) == ((a, 0), (b, 4), (c, 8))
    assert rebuild_history(c, {1: 10, 2: 10}, folders) == ((a, 0), (c, 3))  # c holds none: past every id
    assert rebuild_history(a, {}, folders) == ((a, 0),)
    with pytest.raises(CorruptionError, match="0000000000000007.*fewer than the 11"):
        rebuild_history(b, {7: 11}, folders)
    with pytest.raises(CorruptionError, match="segment 0000000000000003"):
        rebuild_history(c, {3: 10, 8: 10}, folders)


class Recording(DictObjectStore):
    """A bucket that logs its puts and deletes (tests/support/crash_states.py section 4, without local files)."""

    def __init__(self, objects):
        super().__init__(objects)
        self.effects: list[tuple[str, str, bytes | None]] = []

    def put(self, key, data) -> None:
        super().put(key, data)
        self.effects.append(("put", key, bytes(data)))

    def delete(self, key) -> None:
        super().delete(key)
        self.effects.append(("delete", key, None))


def test_a_repair_killed_at_any_object_effect_then_run_again_gives_the_repaired_bucket(tmp_path):
    """The crash-state explorer for the repair: its object effects are recorded, and for every prefix of them (the
    repair killed there) the repair is run again on that bucket: the end state lists versions 1..4 bit for bit,
    and every object the damaged bucket held but CURRENT is still there, unchanged."""
    objects = DictObjectStore()
    content = four_versions(tmp_path / "w", objects)
    damaged_pointer = dict(objects.objects, CURRENT=b'{"pointer": 1}')
    missing = {k: v for k, v in objects.objects.items() if k != "CURRENT"}
    starts = {"missing": missing, "damaged": damaged_pointer,
              **{f"missing, newer {k}": v for k, v in newer_leftovers(tmp_path, objects, content).items()}}
    checked = 0
    for name, start in starts.items():
        recording = Recording(start)
        repair_pointer(recording)
        assert [(kind, key) for kind, key, _ in recording.effects] == [("put", "CURRENT")], name
        for k in range(len(recording.effects) + 1):
            state = DictObjectStore(start)
            for kind, key, data in recording.effects[:k]:
                state.objects[key] = data
            report = cnrstore.repair(tmp_path / f"cache-{checked}", remote=state)
            assert report.versions_recovered == [1, 2, 3, 4], (name, k)
            assert (report.pointer is None) == (k == 1), (name, k)  # (after the put: sound, nothing to do)
            kept = {key: data for key, data in start.items() if key != "CURRENT"}
            assert {key: state.objects[key] for key in kept} == kept, (name, k)
            assert_reads(tmp_path / f"fresh-{checked}", state, content)
            checked += 1
    assert checked == 2 * len(starts)


@pytest.fixture
def bucket(s3_endpoint, s3_bucket):
    return f"s3://{s3_bucket}/ckpt", s3_options(s3_endpoint)


def run(bucket, *args) -> int:
    url, opts = bucket
    return cli.main(["--remote", url, "--remote-options", json.dumps(opts), *map(str, args)])


def test_cli_repair_rebuilds_a_deleted_pointer_on_s3(tmp_path, bucket, s3_endpoint, s3_bucket, capsys):
    url, opts = bucket
    content: dict = {}
    with cnrstore.open(tmp_path / "w", create=True, remote=url, remote_options=opts) as store:
        write_versions(store, content, range(4), seed=1)
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    client.delete_object(Bucket=s3_bucket, Key="ckpt/CURRENT")
    capsys.readouterr()
    assert run(bucket, "ls", tmp_path / "ls") == 2
    err = capsys.readouterr().err
    assert "CURRENT is missing" in err and f"cnrstore --remote {url} repair DIR" in err

    assert run(bucket, "repair", tmp_path / "cache") == 0
    out = capsys.readouterr().out
    assert "was missing; rebuilt" in out and "4 version(s) recovered" in out
    assert run(bucket, "repair", tmp_path / "again") == 0  # a sound pointer: nothing rebuilt
    assert "rebuilt" not in capsys.readouterr().out
    with cnrstore.open(tmp_path / "fresh", readonly=True, remote=url, remote_options=opts) as store:
        assert [v.version for v in store.versions()] == [1, 2, 3, 4]
        for v, want in content.items():
            assert store.read_table("t", version=v).tobytes() == want.tobytes()

    # --no-record-check: the snapshot's index and its segments' lengths only (no read per record)
    client.delete_object(Bucket=s3_bucket, Key="ckpt/CURRENT")
    assert run(bucket, "repair", tmp_path / "quick", "--no-record-check") == 0
    assert "was missing; rebuilt" in capsys.readouterr().out
    with pytest.raises(InvalidArgument, match="check_records"):
        cnrstore.repair(tmp_path / "bad", remote=url, remote_options=opts, check_records="no")

    # a newer snapshot that does not verify: reported, exit 1; no snapshot at all: exit 2, one line
    pointer = json.loads(client.get_object(Bucket=s3_bucket, Key="ckpt/CURRENT")["Body"].read())["pointer"]
    newer = pointer["snapshot"][:-20] + f"{pointer['generation'] + 1:016x}.mdb"
    client.put_object(Bucket=s3_bucket, Key=f"ckpt/{newer}", Body=b"not an index")
    client.delete_object(Bucket=s3_bucket, Key="ckpt/CURRENT")
    assert run(bucket, "repair", tmp_path / "cache2") == 1
    out = capsys.readouterr().out
    assert f"problem: snapshot {newer}" in out and "DAMAGED" in out
    client.delete_object(Bucket=s3_bucket, Key="ckpt/CURRENT")
    for key in (newer, pointer["snapshot"]):
        client.delete_object(Bucket=s3_bucket, Key=f"ckpt/{key}")
    assert run(bucket, "repair", tmp_path / "cache3") == 2
    err = capsys.readouterr().err
    assert "holds no index snapshot" in err and len(err.strip().splitlines()) == 1
    with pytest.raises(StoreNotFound):
        repair_pointer(f"s3://{s3_bucket}/empty", opts)
