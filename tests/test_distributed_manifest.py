"""cnrstore/distributed/manifest.py: a distributed root's files (docs/FORMAT.md, "Distributed root") --
its marker, one sharding plan per generation, one checksummed manifest per global version -- without a
process group. Mutated manifests are test_fuzz_parsers.py's; crafted ones test_security.py's."""

from __future__ import annotations

import os

import msgpack
import pytest

from cnrstore.distributed import GlobalVersion, Root, ShardingPlan
from cnrstore.distributed import manifest
from cnrstore.errors import CorruptionError, FormatVersionError, InvalidArgument, StoreNotFound, VersionNotFound

PLAN = ShardingPlan.row_wise({"emb": (10, 4)}, 2)


def manifest_path(root: Root, version: int) -> str:
    """Where global version ``version``'s manifest lies (docs/FORMAT.md)."""
    return os.path.join(root.path, "global", f"g-{version:012d}.cnrg")


def gv(version: int, generation: int = 1, plan: ShardingPlan = PLAN, **kw) -> GlobalVersion:
    fields = dict(step=version * 10, meta={"v": version}, created=1.5, generation=generation, plan=plan,
                  local_versions=tuple(version for _ in range(plan.world_size)),
                  stores=tuple(f"gen-{generation:06d}/rank-{r:05d}" for r in range(plan.world_size)))
    fields.update(kw)
    return GlobalVersion(version=version, **fields)


@pytest.fixture
def root(tmp_path) -> Root:
    r = Root(str(tmp_path / "root"))
    r.create()
    return r


def test_create_makes_a_readable_root_once_and_clears_half_written_manifests(root):
    assert root.exists() and root.check() is None
    marker = open(os.path.join(root.path, manifest.MARKER), "rb").read()
    stray = os.path.join(root.path, manifest.GLOBAL_DIR, "g-000000000001.cnrg.tmp")
    open(stray, "wb").write(b"half")
    root.create()                                       # idempotent: the marker is not rewritten
    assert open(os.path.join(root.path, manifest.MARKER), "rb").read() == marker
    assert not os.path.exists(stray)


def test_check_says_what_a_path_is_not(tmp_path, root):
    with pytest.raises(StoreNotFound, match="not a distributed cnrstore root"):
        Root(str(tmp_path)).check()
    path = os.path.join(root.path, manifest.MARKER)
    data = bytearray(open(path, "rb").read())
    data[10] ^= 1
    open(path, "wb").write(bytes(data))
    with pytest.raises(CorruptionError, match="bad magic or checksum"):
        root.check()
    open(path, "wb").write(manifest.seal(manifest.MARKER, {"format": manifest.DIST_FORMAT_VERSION + 1}))
    with pytest.raises(FormatVersionError):
        root.check()


def test_a_generation_is_one_plan(root):
    assert root.generations() == []
    assert root.generation_for(PLAN) == 1
    assert root.generation_for(ShardingPlan.row_wise({"emb": (10, 4)}, 2)) == 1     # an equal plan
    other = ShardingPlan.table_wise({"emb": (10, 4)}, 2)
    assert root.generation_for(other) == 2 and root.plan_of(2) == other
    os.makedirs(root.gen_dir(3))                        # a generation a crash cut short before its PLAN
    assert root.generation_for(PLAN) == 4               # its number is not reused
    assert root.generations() == [1, 2, 4]
    assert root.store_path(root.store_rel(4, 1)) == os.path.join(root.path, "gen-000004", "rank-00001")


def test_committed_versions_read_back_oldest_first(root):
    assert root.versions() == [] and root.latest() is None and root.version_numbers() == []
    for v in (1, 2, 3):
        root.commit(gv(v, priority=v == 2))
    assert [g.version for g in root.versions()] == [1, 2, 3]
    back = root.read(2)
    assert back == gv(2, priority=True) and back.world_size == 2
    assert root.latest().version == 3
    with pytest.raises(InvalidArgument, match="exists already"):
        root.commit(gv(3))
    with pytest.raises(VersionNotFound):
        root.read(9)


def test_versions_sees_manifests_committed_by_another_root_object(root):
    root.commit(gv(1))
    assert [g.version for g in root.versions()] == [1]
    Root(root.path).commit(gv(2))
    assert [g.version for g in root.versions()] == [1, 2]


def test_drop_removes_manifests_but_never_the_newest(root):
    for v in (1, 2, 3):
        root.commit(gv(v))
    root.drop([1])
    assert root.version_numbers() == [2, 3]
    with pytest.raises(InvalidArgument, match="newest"):
        root.drop([3])


def test_a_generation_no_manifest_names_is_removed(root):
    root.generation_for(PLAN)
    gen2 = root.generation_for(ShardingPlan.table_wise({"emb": (10, 4)}, 2))
    gen3 = root.generation_for(PLAN)
    root.commit(gv(1, generation=gen2, plan=root.plan_of(gen2)))
    assert root.remove_unreferenced_generations(keep=gen3) == [1]
    assert root.generations() == [gen2, gen3]


@pytest.mark.parametrize("change,why", [
    ({"stores": ["../elsewhere", "gen-000001/rank-00001"]}, "inside the root"),
    ({"stores": ["gen-000001/rank-00001", "gen-000001/rank-00000"]}, "rank 0's store path"),
    ({"local_versions": [1]}, "one version number per rank"),
    ({"version": 2}, "in a file named for version 1"),
    ({"generation": 0}, "generation"),
    ({"plan": {"tables": {}}}, "its plan"),
    ({"created": "yesterday"}, "wrong type"),
])
def test_a_manifest_body_is_checked_as_untrusted_data(root, change, why):
    body = {**gv(1).to_dict(), **change}
    open(manifest_path(root, 1), "wb").write(manifest.seal("manifest", body))
    with pytest.raises(CorruptionError, match=why):
        root.read(1)


def test_a_manifest_is_msgpack_behind_its_magic_and_checksummed(root):
    root.commit(gv(1))
    data = open(manifest_path(root, 1), "rb").read()
    assert data.startswith(b"CNRGLOB\0")
    assert msgpack.unpackb(data[8:-8], strict_map_key=False)["local_versions"] == [1, 1]
    open(manifest_path(root, 1), "wb").write(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CorruptionError):
        root.read(1)
