"""The CLI on a multi-rank root (issue 39): ``cnrstore --remote s3://bucket/job CMD DIR`` where the prefix holds a
root (DIR: this machine's directory for the rank stores), and ``info`` / ``retain`` / ``gc`` on a local root.

Roots are made in the test process by a one-rank DistributedCheckpointer (the ``group`` fixture) on the session's
moto endpoint; the commands run as a user runs them (``cli.main``), each on a fresh directory unless said."""

from __future__ import annotations

import json

import boto3
import numpy as np
import pytest
import torch

from support.s3_remote import s3_options, small_segments  # noqa: F401 (a fixture: 32 KiB segments)
from support.torch_models import ShardModel

from cnrstore import cli
from cnrstore.distributed import DistributedCheckpointer, ShardingPlan
from cnrstore.errors import GlobalCommitError

TABLES = {"emb.a": (400, 8), "emb.b": (300, 4)}


def Model(seed=0, tables=TABLES):
    return ShardModel(tables, seed)


def job(node, remote=None, seed=0, tables=TABLES):
    """(checkpointer, model): a one-rank job on the root at ``node`` (a local root), or with ``remote``
    ((url, options)) on the root in that bucket prefix with ``node`` as its node's directory."""
    model = Model(seed, tables)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    kw = {} if remote is None else {"remote": remote[0], "remote_options": remote[1]}
    ck = DistributedCheckpointer(node, model, opt, plan=ShardingPlan.row_wise(tables, 1), codec="fp32", **kw)
    model.opt = opt  # (the tests' one handle on a job's model and its optimizer)
    return ck, model


def change_every_row(model):
    """A training step that updates every row (so that each save holds a whole copy of the tables, and a
    dropped one frees that many bytes)."""
    loss = model.lin(torch.ones(2, 3)).sum()
    for bag in model.emb.values():
        n = bag.num_embeddings
        loss = loss + bag(torch.arange(n), torch.arange(0, n, 10)).pow(2).sum()
    model.opt.zero_grad()
    loss.backward()
    model.opt.step()


def save_versions(ck, model, steps):
    for step in steps:
        change_every_row(model)
        ck.save(step=step, meta={"step": step}).wait()


@pytest.fixture
def bucket(s3_endpoint, s3_bucket):
    """(url, remote_options) of a root's prefix in a fresh bucket."""
    return f"s3://{s3_bucket}/job", s3_options(s3_endpoint)


def run(bucket, *args) -> int:
    url, opts = bucket
    return cli.main(["--remote", url, "--remote-options", json.dumps(opts), *map(str, args)])


def bucket_bytes(s3_endpoint, bucket_name, prefix="job/") -> dict[str, int]:
    opts = s3_options(s3_endpoint)
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id=opts["key"],
                          aws_secret_access_key=opts["secret"], region_name="us-east-1")
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket_name, Prefix=prefix):
        out.update({o["Key"][len(prefix):]: o["Size"] for o in page.get("Contents", [])})
    return out


def test_ls_info_verify_export_of_a_root_in_a_bucket(tmp_path, group, bucket, capsys):
    ck, model = job(tmp_path / "node", bucket)
    save_versions(ck, model, (10, 20, 30))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ck.close()
    url = bucket[0]
    # ls on a fresh machine: the global versions and each rank store's name and prefix
    assert run(bucket, "ls", tmp_path / "here", "--long") == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[1:] if "meta: " not in line][:3] == [["1", "10"], ["2", "20"],
                                                                                 ["3", "30"]]
    assert [line.split("meta: ")[1] for line in out if "meta: " in line] == [json.dumps({"step": s})
                                                                             for s in (10, 20, 30)]
    assert "3 global version(s)" in out
    assert out[-1].split() == ["rank", "0:", "gen-000001/rank-00000", f"{url}/gen-000001/rank-00000"]
    assert (tmp_path / "here").is_dir()
    assert run(bucket, "ls", tmp_path / "here", "--json") == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["step"], r["stores"]) for r in rows] == [(v, s, ["gen-000001/rank-00000"])
                                                                      for v, s in ((1, 10), (2, 20), (3, 30))]
    assert rows[0]["store_remotes"] == [f"{url}/gen-000001/rank-00000"]
    # info: owner job, generations with their plans, global versions
    assert run(bucket, "info", tmp_path / "here") == 0
    text = capsys.readouterr().out
    assert f"multi-rank root {url}" in text and "global versions  3" in text
    assert "newest           3 (step 30" in text and "emb.a 400x8, emb.b 300x4" in text
    assert run(bucket, "info", tmp_path / "here", "--json") == 0
    info = json.loads(capsys.readouterr().out)
    assert info["owner"] == ck.root.job and info["global_versions"] == 3 and info["newest"]["version"] == 3
    assert info["generations"] == [{"generation": 1, "world_size": 1, "row_ids": "local",
                                    "tables": {"emb.a": [400, 8], "emb.b": [300, 4]}, "global_versions": [1, 2, 3]}]
    # verify reads every rank store from the bucket
    assert run(bucket, "verify", tmp_path / "v", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["global_versions"] == 3 and report["stores_checked"] == 1
    assert report["bytes_checked"] > (400 * 8 + 300 * 4) * 4
    # export: the merged model, bit for bit
    assert run(bucket, "export", tmp_path / "e", "--format", "npz", tmp_path / "m.npz") == 0
    assert "exported global version 3" in capsys.readouterr().out
    with np.load(tmp_path / "m.npz") as z:
        assert sorted(z.files) == sorted(want)
        for k, v in want.items():
            np.testing.assert_array_equal(z[k], v.numpy(), err_msg=k)
    # a command that takes one rank's store says which, in bucket terms
    assert run(bucket, "rows", tmp_path / "here", "emb.a", "1") == 2
    err = capsys.readouterr().err
    assert f"{url} is the root of a multi-rank job" in err and f"--remote {url}/gen-GGGGGG/rank-RRRRR" in err


def test_verify_names_a_damaged_manifest_object(tmp_path, group, bucket, s3_endpoint, s3_bucket, capsys):
    ck, model = job(tmp_path / "node", bucket)
    save_versions(ck, model, (1, 2))
    ck.close()
    key = next(k for k in bucket_bytes(s3_endpoint, s3_bucket) if k.startswith("global/g-000000000001-"))
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    data = client.get_object(Bucket=s3_bucket, Key=f"job/{key}")["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=f"job/{key}", Body=data[:-1] + bytes([data[-1] ^ 1]))
    assert run(bucket, "verify", tmp_path / "v") == 1
    out = capsys.readouterr().out
    assert "problem: global version 1: CorruptionError" in out and key in out and "DAMAGED: 1 global version(s)" in out


def test_a_deleted_root_pointer_fails_ls_and_verify_and_repair_brings_every_version_back(
        tmp_path, group, bucket, s3_endpoint, s3_bucket, capsys):
    """Issue 49: `aws s3 rm .../ROOT` on a 2-save root, every other object there. `ls` and `verify` exit 2 with
    RemoteObjectMissing naming the fix (they said "0 global version(s)" and exited 0); `repair` rebuilds the
    pointer (exit 0), `ls` lists both versions again and `verify` finds them whole; no object was deleted."""
    ck, model = job(tmp_path / "node", bucket)
    save_versions(ck, model, (1, 2))
    ck.close()
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.delete_object(Bucket=s3_bucket, Key="job/ROOT")
    before = bucket_bytes(s3_endpoint, s3_bucket)
    for command in ("ls", "verify"):
        assert run(bucket, command, tmp_path / command) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "RemoteObjectMissing" in err and "ROOT is missing" in err and "repair" in err
    assert bucket_bytes(s3_endpoint, s3_bucket) == before
    assert run(bucket, "repair", tmp_path / "repair") == 0
    out = capsys.readouterr().out
    assert "was missing; rebuilt listing 2 global version(s) 1, 2" in out, out
    assert run(bucket, "ls", "--json", tmp_path / "ls2") == 0
    assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [1, 2]
    assert run(bucket, "verify", tmp_path / "v2") == 0
    assert {k for k in bucket_bytes(s3_endpoint, s3_bucket)} == set(before) | {"ROOT"}
    assert run(bucket, "repair", tmp_path / "repair2") == 0  # a sound pointer is left as it is
    assert "nothing to repair" in capsys.readouterr().out


def test_a_prefix_with_neither_a_root_nor_a_store_is_an_invalid_argument(tmp_path, bucket, capsys):
    assert run(bucket, "ls", tmp_path / "d") == 2
    err = capsys.readouterr().err
    assert "InvalidArgument" in err and "holds neither a cnrstore store" in err and "CNRSTORE-DIST" in err


def test_retain_and_gc_on_a_bucket_root_take_it_over_and_free_bucket_bytes(tmp_path, group, bucket, s3_endpoint,
                                                                         s3_bucket, capsys):
    ck, model = job(tmp_path / "node", bucket)
    save_versions(ck, model, range(4))
    # a running job: retain and gc refuse without --take-over, and say why
    for command in (["retain", "--keep-last", "1"], ["gc"]):
        assert run(bucket, command[0], tmp_path / "admin", *command[1:]) == 2
        err = capsys.readouterr().err
        assert "--take-over" in err and "Stop the job first" in err and "RemoteTakenOver" in err, err
    assert run(bucket, "retain", tmp_path / "admin", "--keep-last", "1", "--take-over") == 0
    assert capsys.readouterr().out.startswith("dropped 3 global version(s): 1, 2, 3; kept 1")
    change_every_row(model)
    with pytest.raises(GlobalCommitError, match="RemoteTakenOver"):  # the job was fenced: its next save fails
        ck.save(step=9).wait()
    ck.close()
    assert run(bucket, "ls", tmp_path / "admin", "--json") == 0
    assert [r["version"] for r in json.loads(capsys.readouterr().out)] == [4]
    before = bucket_bytes(s3_endpoint, s3_bucket, "job/gen-000001/")
    assert run(bucket, "gc", tmp_path / "admin", "--take-over", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    after = bucket_bytes(s3_endpoint, s3_bucket, "job/gen-000001/")
    (store,) = report["stores"]
    assert store["store"] == "gen-000001/rank-00000" and store["versions_dropped"][:3] == [1, 2, 3]
    freed = sum(before.values()) - sum(after.values())
    assert store["bucket_bytes_freed"] == freed == report["bucket_bytes_freed"]
    assert freed > 3 * (400 * 8 + 300 * 4) * 4 * 0.9  # (about three whole copies of the tables)
    # what is left is the newest global version, whole: it verifies and exports on another machine
    assert run(bucket, "verify", tmp_path / "v") == 0
    capsys.readouterr()
    # a new job claims the root back and goes on from the newest global version
    ck2, model2 = job(tmp_path / "node", bucket, seed=4)
    assert ck2.restore().version == 4
    save_versions(ck2, model2, (5,))
    ck2.close()


def test_info_and_retain_over_two_generations_of_a_bucket_root(tmp_path, group, bucket, s3_endpoint, s3_bucket,
                                                                capsys):
    ck, model = job(tmp_path / "node", bucket)
    save_versions(ck, model, (1, 2))
    ck.close()
    ck, model = job(tmp_path / "node", bucket, tables=dict(TABLES, **{"emb.c": (20, 3)}))  # another plan
    save_versions(ck, model, (3,))
    ck.close()
    assert run(bucket, "info", tmp_path / "admin") == 0
    lines = capsys.readouterr().out.splitlines()
    gens = [line.split() for line in lines if line.split()[0] in ("1", "2")]
    assert [g[:4] for g in gens] == [["1", "1", "local", "1-2"], ["2", "1", "local", "3"]]
    assert run(bucket, "retain", tmp_path / "admin", "--keep-last", "1", "--take-over", "--json") == 0
    assert json.loads(capsys.readouterr().out) == {"dropped": [1, 2], "kept": [3], "generations_removed": [1]}
    assert not bucket_bytes(s3_endpoint, s3_bucket, "job/gen-000001/")
    assert run(bucket, "info", tmp_path / "admin", "--json") == 0
    assert [g["generation"] for g in json.loads(capsys.readouterr().out)["generations"]] == [2]
    # retain on a root keeps by count only
    assert run(bucket, "retain", tmp_path / "admin", "--drop", "3", "--take-over") == 2
    assert "--keep-last N only" in capsys.readouterr().err


def test_info_retain_and_gc_on_a_local_root(tmp_path, group, capsys):
    root = tmp_path / "root"
    ck, model = job(root)
    save_versions(ck, model, range(3))
    assert cli.main(["info", str(root)]) == 0
    text = capsys.readouterr().out
    assert f"multi-rank root {root}" in text and "owner job" not in text and "global versions  3" in text
    # the job holds its rank store: maintenance waits for it
    assert cli.main(["retain", str(root), "--keep-last", "1"]) == 2
    assert "StoreLocked" in capsys.readouterr().err
    assert cli.main(["gc", str(root), "--take-over"]) == 2  # (a flag of bucket roots)
    assert "--take-over is for a multi-rank root in a bucket" in capsys.readouterr().err
    ck.close()
    assert cli.main(["retain", str(root), "--keep-last", "1"]) == 0
    assert capsys.readouterr().out.startswith("dropped 2 global version(s): 1, 2; kept 1")
    assert cli.main(["info", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["owner"] is None and info["global_versions"] == 1 and info["newest"]["version"] == 3
    assert cli.main(["gc", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gen-000001/rank-00000: dropped 2 local version(s), reclaimed ")
    reclaimed = int(out.splitlines()[0].split("reclaimed ")[1].split(" bytes")[0].replace(",", ""))
    assert reclaimed > 2 * (400 * 8 + 300 * 4) * 4 * 0.9
    assert cli.main(["verify", str(root)]) == 0


def test_import_into_a_bucket_seeds_a_store_a_fresh_machine_reads(tmp_path, bucket, capsys):
    """`cnrstore --remote URL import DIR SOURCE` imports locally, then attaches the store to the prefix (a failed
    import leaves the bucket untouched); another machine recovers it from the bucket alone."""
    import torch

    import cnrstore

    sd = {"emb.0.weight": torch.randn(300, 8, generator=torch.Generator().manual_seed(0)), "lin.bias": torch.ones(3)}
    torch.save(sd, tmp_path / "model.pt")
    torch.save({"nothing": 1}, tmp_path / "bad.pt")
    assert run(bucket, "import", tmp_path / "bad-dir", tmp_path / "bad.pt") == 2
    assert not (tmp_path / "bad-dir").exists()
    from cnrstore.engine.objects import FsspecObjectStore
    assert FsspecObjectStore(*bucket).list_tree("") == {}
    assert run(bucket, "import", tmp_path / "node", tmp_path / "model.pt") == 0
    assert run(bucket, "import", tmp_path / "node", tmp_path / "model.pt") == 2  # (not an empty directory)
    capsys.readouterr()
    url, opts = bucket
    with cnrstore.open(tmp_path / "fresh", readonly=True, remote=url, remote_options=opts) as st:
        assert [v.version for v in st.versions()] == [1]
        assert np.array_equal(st.read_table("emb.0"), sd["emb.0.weight"].numpy())


def test_a_store_prefix_whose_current_was_deleted_is_damage_not_an_empty_prefix(tmp_path, bucket, s3_endpoint,
                                                                                 s3_bucket, capsys):
    import cnrstore
    url, opts = bucket
    with cnrstore.open(tmp_path / "w", create=True, remote=url, remote_options=opts) as store:
        store.create_table("t", 8, 2)
        with store.checkpoint(step=1) as ck:
            ck.put_rows("t", np.arange(8), np.ones((8, 2), np.float32))
    client = boto3.client("s3", endpoint_url=s3_endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
    client.delete_object(Bucket=s3_bucket, Key="job/CURRENT")
    for command in ("ls", "verify"):
        assert run(bucket, command, tmp_path / command) == 2
        err = capsys.readouterr().err
        assert "RemoteObjectMissing" in err and "CURRENT is missing" in err and "holds neither" not in err
