"""Every ```python and ```sh block of README.md, and every ```python block of docs/API.md, runs as written;
docs/API.md names what the code has.

Each block runs in a fresh directory, in a fresh interpreter (python) or bash with ``set -eo pipefail``
and the virtualenv's ``cnrstore`` on PATH (sh). A block is found by a piece of its text (``SPECS``); a
block that needs what stands for the user's data or model (``model``, ``train_step``, a process group)
gets it from an explicit prelude below, and a check after it asserts what the block did. Every block of
the README must be in ``SPECS`` or in ``NOT_RUN`` (and every entry there must match one block), so a
new or changed block cannot go untested unnoticed.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
API = ROOT / "docs" / "API.md"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           TESTS_DIR=os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence


def readme_blocks() -> list[Block]:
    text = README.read_text()
    found = []
    for m in re.finditer(r"^```(python|sh)\n(.*?)^```", text, re.M | re.S):
        found.append(Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1))
    return found


#: sh blocks not run, and why. Keep this short: only what cannot run inside a test.
NOT_RUN = {
    "git clone https://github.com/<you>/cnrstore.git": "clones from the network into a new environment (make test "
                                                        "is what it does, on this checkout)",
    "make demo": "`make demo` builds .venv and trains for ~2 minutes; `make test` is this whole suite (10-12 min)",
    "download.pytorch.org/whl/$CUDA": "installs CUDA builds of torch's kin from the network into the environment "
                                      "(tests/test_packaging.py checks the metadata it relies on)",
}


@dataclass(frozen=True)
class Spec:
    #: python run first, in the same interpreter: what stands for the user's data, model or process group
    prelude: str = ""
    #: python run after the block (in the same interpreter; after an sh block, in the same directory): asserts
    #: what the block did
    check: str = ""
    #: key of a block run first: in the same interpreter (a python block), or in the same directory before
    #: an sh block
    after: str | None = None
    #: processes that run the block, a gloo process group between them
    ranks: int = 1
    #: not run alone: the block of that key runs it (with ``after=``)
    covered_by: str | None = None
    #: an optional dependency the block needs (skipped without it, unless make test's
    #: CNRSTORE_REQUIRE_TORCHREC=1 says it is installed)
    needs: str | None = None
    #: fresh interpreters that run prelude, block and check one after another in the same directory (a
    #: restart of the script); each sees its run's number, from 0, as RUN in its environment
    runs: int = 1
    #: a python block that is a script: written to this file in the directory (by the sh block that runs
    #: it, whose ``after`` names it) instead of run
    file: str | None = None
    #: what the block must print on stdout (a python block: its run's, or its last run's, prelude and check
    #: included)
    stdout: tuple[str, ...] = ()


TRAINER = '''
import os
import torch
from torch import nn
import cnrstore

torch.manual_seed(0)
model = nn.Sequential(nn.EmbeddingBag(1000, 16), nn.Linear(16, 1))   # stands for your model
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)


class StatefulLoader:  # stands for torchdata's StatefulDataLoader: batches, and the position as its state
    def __init__(self, batches):
        self.batches, self.pos = batches, 0

    def __iter__(self):
        while self.pos < self.batches:
            self.pos += 1
            yield torch.randint(0, 1000, (32, 4))

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


data_loader = StatefulLoader(2500 + 1000 * int(os.environ["RUN"]))   # the restart has 1000 batches more


def train_step(model, optimizer, batch):
    loss = model(batch).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
'''

RANKS = '''
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo", init_method=os.environ["RDZV"], rank=int(os.environ["RANK"]),
                        world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))
rank, world_size = dist.get_rank(), dist.get_world_size()
step = 1000  # the training step the job is at


class MyDLRM(nn.Module):  # stands for your model: an EmbeddingBag per shard this rank holds
    def __init__(self, shards):
        super().__init__()
        self.emb = nn.ModuleDict({name.split(".")[1]: nn.EmbeddingBag(s.num_rows, 64) for name, s in shards.items()})
        self.top = nn.Linear(64, 1)
'''

TORCHREC = RANKS + '''
import sys
sys.path.insert(0, os.environ["TESTS_DIR"])
from support.torchrec_worker import build, train   # a DMP-sharded EmbeddingBagCollection on CPU, as the tests build it

model, optimizer = build({"plan": {"t0": "row_wise", "t1": "column_wise", "t2": "table_wise"}}, rank, world_size, 0)
train(model, optimizer, range(3))
'''

S3_ENDPOINT = '''
import logging
import os
from moto.server import ThreadedMotoServer   # stands for S3: an endpoint on localhost, named by the environment
logging.getLogger("werkzeug").setLevel(logging.ERROR)
_s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
_s3.start()
os.environ.update(AWS_ENDPOINT_URL="http://%s:%d" % _s3.get_host_and_port(), AWS_ACCESS_KEY_ID="testing",
                  AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
import boto3
boto3.client("s3").create_bucket(Bucket="my-bucket")
'''
S3 = TRAINER + S3_ENDPOINT
#: one rank of a job on a bucket: a one-rank gloo group, the README's MyDLRM and plan
BUCKET_RANK = S3_ENDPOINT + '''
import torch
import torch.distributed as dist
from torch import nn
from cnrstore.distributed import ShardingPlan
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rdzv"), rank=0, world_size=1)
rank, world_size, step = 0, 1, 1000
class MyDLRM(nn.Module):  # stands for your model: an EmbeddingBag per shard this rank holds
    def __init__(self, shards):
        super().__init__()
        self.emb = nn.ModuleDict({name.split(".")[1]: nn.EmbeddingBag(s.num_rows, 64) for name, s in shards.items()})
        self.top = nn.Linear(64, 1)
plan = ShardingPlan.row_wise({"emb.0": (100_000, 64), "emb.1": (5_000, 64)}, world_size)
model = MyDLRM(plan.shards_of(rank))
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
'''

USE = 'with cnrstore.open("ckpt", create=True) as store:\n    store.create_table("user_emb"'
WHOLE_TRAINER = 'with Checkpointer("ckpt", model, [sparse, dense], keep_last=3)'
#: the first run of the README's trainer dies at its 150th batch (a crash: SystemExit out of the loop, so the
#: with block closes as an exception's unwinding does); the second runs to the end
CRASH_AT_150 = '''
import os
import torch.utils.data

if os.environ["RUN"] == "0":
    _iter = torch.utils.data.DataLoader.__iter__

    def _crashing(self):
        for i, batch in enumerate(_iter(self)):
            if i == 150:  # (status 0: the harness asserts every run's status; the restart checks what stood)
                raise SystemExit(0)
            yield batch

    torch.utils.data.DataLoader.__iter__ = _crashing
'''
DIST = 'DistributedCheckpointer("ckpt", model, optimizer, plan=plan, codec="int4"'
#: README's trainer shapes: its two-tower model and optimizers, a Checkpointer that clones the state at each save()
SHAPES = "# gradient accumulation over 4 micro-batches"
TWO_TOWERS = '''
import copy, itertools
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from cnrstore.torch import Checkpointer


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.users = nn.EmbeddingBag(100_000, 32, mode="sum", sparse=True)
        self.items = nn.EmbeddingBag(50_000, 32, mode="sum", sparse=True)
        self.top = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, users, items):
        return self.top(torch.cat([self.users(users), self.items(items)], 1)).squeeze(1)


def trainer():
    torch.manual_seed(0)
    m = TwoTowers()
    return m, torch.optim.Adagrad([m.users.weight, m.items.weight], lr=0.05), torch.optim.Adam(m.top.parameters(), lr=1e-3)


g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randint(0, 100_000, (8192, 4), generator=g),
                     torch.randint(0, 50_000, (8192, 4), generator=g), torch.rand(8192, generator=g).round())
loader = itertools.islice(DataLoader(data, batch_size=256), 24)
model, sparse, dense = trainer()
ckpt = Checkpointer("ckpt", model, [sparse, dense])
clones = {}
_save = ckpt.save


def _cloning_save(step, *args, **kwargs):  # the state at each save(), to compare its version with
    clones[step] = copy.deepcopy((model.state_dict(), sparse.state_dict(), dense.state_dict()))
    return _save(step, *args, **kwargs)


ckpt.save = _cloning_save
rows, evicted = torch.tensor([3, 5, 99_999]), torch.tensor([7, 49_999])
'''

SPECS = {
    SHAPES: Spec(covered_by='ckpt.changing("users", rows)'),
    'ckpt.changing("users", rows)': Spec(prelude=TWO_TOWERS, after=SHAPES, check='''
import cnrstore
ckpt.save(10_000).wait()  # (after the announced writes)
ckpt.close()
with cnrstore.open("ckpt", readonly=True) as s:
    versions = s.versions()
assert [v.step for v in versions] == [4, 9, 14, 19, 10_000], [v.step for v in versions]
def bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x
for v in versions:  # every version is the state at its save(), bit for bit
    m, o1, o2 = trainer()
    with Checkpointer("ckpt", m, [o1, o2]) as reader:
        reader.restore(v.version)
    want_model, want_sparse, want_dense = clones[v.step]
    for k, t in m.state_dict().items():
        assert torch.equal(bits(t), bits(want_model[k])), (v.step, k)
    for got, want in ((o1.state_dict(), want_sparse), (o2.state_dict(), want_dense)):
        for i, st in want["state"].items():
            for k, t in st.items():
                assert torch.equal(bits(got["state"][i][k]), bits(t)), (v.step, i, k)
'''),
    USE: Spec(check='''
with cnrstore.open("ckpt", readonly=True) as s:
    assert [v.step for v in s.versions()] == [1000, 2000] and s.verify().ok
    assert s.latest().meta is None and s.versions()[0].meta == {"loader_pos": 123_456}
    assert (s.read_rows("user_emb", touched_rows[:3]) == s.read_rows("user_emb", touched_rows[:3], v1)).all()
'''),
    "compaction=policy": Spec(check='''
with cnrstore.open("ckpt", readonly=True) as s:
    steps = [v.step for v in s.versions()]
assert steps[-5:] == [16_000, 17_000, 18_000, 19_000, 20_000] and 10_000 in steps, steps
assert set(steps) <= {10_000, *range(11_000, 21_000, 1_000)}
'''),
    WHOLE_TRAINER: Spec(prelude=CRASH_AT_150, runs=2, check='''
import cnrstore
with cnrstore.open("ckpt", readonly=True) as s:
    steps = [v.step for v in s.versions()]
# (reached by the restart only: the first run died before step 150, after its saves at steps 63 and 127 committed;
# the restart resumed at step 128, the batch after the 128 steps done, and saved after steps 191 and 255)
assert os.environ["RUN"] == "1" and start == 128 and steps == [127, 191, 255], (start, steps)
'''),
    'remote="s3://my-bucket/dlrm/run-7", cache_bytes': Spec(prelude=S3, check='''
assert info.step == 1999, info   # saved after steps 999 and 1999 of the loader's 2500
with cnrstore.open("ckpt-fresh", readonly=True, remote="s3://my-bucket/dlrm/run-7") as s:
    assert [v.step for v in s.versions()] == [999, 1999] and s.verify().ok
'''),
    'remote="s3://my-bucket/dlrm/job-3"': Spec(prelude=BUCKET_RANK, check='''
import cnrstore.distributed
ckpt.close()  # (waits for the publication the block's save left running)
assert [g.step for g in cnrstore.distributed.versions("elsewhere", remote="s3://my-bucket/dlrm/job-3")] == [1000]
model2 = MyDLRM(plan.shards_of(rank))  # another machine: an empty directory, a model built afresh
fresh = DistributedCheckpointer("empty-dir", model2, torch.optim.Adagrad(model2.parameters(), lr=0.01), plan=plan,
                                remote="s3://my-bucket/dlrm/job-3")
assert fresh.restore().step == 1000
for (k, a), (_, b) in zip(fresh.model.state_dict().items(), model.state_dict().items()):
    assert torch.equal(a, b), k
fresh.close()
'''),
    "# train.py": Spec(covered_by="torchrun --standalone", file="train.py"),
    "torchrun --standalone": Spec(after="# train.py", stdout=("rank 0: ckpt/gen-000001/rank-00000",
                                                              "rank 1: ckpt/gen-000001/rank-00001"), check='''
import cnrstore.distributed
gvs = cnrstore.distributed.versions("ckpt")
assert [g.step for g in gvs] == [299, 349, 399], [g.step for g in gvs]  # keep_last=3 of the two runs' saves
'''),
    DIST: Spec(covered_by="ECRM(model, optimizer"),
    "ECRM(model, optimizer": Spec(prelude=RANKS, after=DIST, ranks=3, check='''
import cnrstore.distributed
assert report.failed_ranks == (2,) and report.restored == (rank == 2)  # the CPR report of the block before
assert [g.step for g in cnrstore.distributed.versions("ckpt")] == [1000]
assert ecrm.memory_bytes()
ecrm.close()
ckpt.close()
'''),
    "from torchft._torchft import LighthouseServer": Spec(needs="torchft", check='''
import cnrstore
with cnrstore.open("ckpt/replica-0", readonly=True) as s:
    assert [v.step for v in s.versions()] == [10, 20, 30], s.versions()
'''),
    'DistributedCheckpointer("trec", model': Spec(prelude=TORCHREC, ranks=2, needs="torchrec", check='''
import cnrstore.distributed
assert [g.step for g in cnrstore.distributed.versions("trec")] == [100]
assert cnrstore.distributed.versions("trec")[0].plan.row_ids == "global"
'''),
    "follower = Follower(\"ckpt\", replica)": Spec(stdout=("served version 4 lag FollowerLag(versions=0, seconds=0.0) ",),
                                                  check='''
import cnrstore
with cnrstore.open("ckpt", readonly=True) as s:   # the replica served the newest version, at steps 0-3
    assert [v.step for v in s.versions()] == [0, 1, 2, 3] and version == s.latest().version == 4
    assert scores.shape == (1, 1)
'''),
    "BitWidthPolicy(mtbf_hours": Spec(check='assert codec == "adaptive4" and bits.bits == 4'),
    "cnrstore ls ckpt --long": Spec(after=USE, check='''
import numpy as np
with np.load("ckpt.npz") as z:
    assert z["tables/user_emb"].shape == (100_000, 64) and z["dense/mlp.0.weight"].shape == (64, 32)
import cnrstore
with cnrstore.open("ckpt", readonly=True) as s:
    assert [v.step for v in s.versions()] == [2000] and s.verify().ok
'''),
}


def _only_block(blocks: list, key: str, doc: str) -> Block:
    """The one block of ``blocks`` (of document ``doc``) whose code contains ``key``."""
    matches = [b for b in blocks if key in b.code]
    assert len(matches) == 1, f"{len(matches)} {doc} blocks contain {key!r}"
    return matches[0]


def _check_run_or_excused(blocks: list, specs: dict, not_run: dict, doc: str, python_must_run: bool) -> None:
    """Every block of ``blocks`` is claimed by exactly one key of ``specs`` (run) or ``not_run`` (excused),
    and every key claims one block; with ``python_must_run`` a python block may not be excused."""
    keys = list(specs) + list(not_run)
    for block in blocks:
        owners = [k for k in keys if k in block.code]
        assert len(owners) == 1, f"{doc} block at line {block.line} is matched by {owners} (needs exactly one)"
        if python_must_run and block.lang == "python":
            assert owners[0] in specs, f"python block at line {block.line} must run"
    for key in keys:
        _only_block(blocks, key, doc)


def _block(key: str) -> Block:
    return _only_block(readme_blocks(), key, "README")


def test_every_block_is_run_or_excused():
    _check_run_or_excused(readme_blocks(), SPECS, NOT_RUN, "README", python_must_run=True)
    assert len(NOT_RUN) <= 3, "keep the list of blocks not run short"


def _python(code: str, cwd, rank: int | None = None, world: int = 1, rdzv: str = "", env=None) -> subprocess.Popen:
    env = dict(ENV, **(env or {})) if rank is None else dict(ENV, RANK=str(rank), WORLD_SIZE=str(world), RDZV=rdzv)
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait(procs: list[subprocess.Popen], what: str) -> list[str]:
    """Wait for ``procs``, each of which must exit 0; their stdout."""
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{out}\n{err}"
    return [out for out, _err in outs]


@pytest.mark.parametrize("key", [k for k, spec in SPECS.items() if spec.covered_by is None])
def test_readme_block_runs_as_written(key, tmp_path):
    spec = SPECS[key]
    if spec.needs and os.environ.get("CNRSTORE_REQUIRE_TORCHREC") != "1":
        pytest.importorskip(spec.needs)
    block = _block(key)
    where = f"README block at line {block.line}"
    before = _block(spec.after) if spec.after else None
    for s in SPECS.values():  # a block covered by this one runs with it
        if s.covered_by == key:
            assert spec.after is not None and SPECS[spec.after] is s
    if block.lang == "sh":
        if before is not None and SPECS[spec.after].file:
            (tmp_path / SPECS[spec.after].file).write_text(before.code)
        elif before is not None:
            _wait([_python(before.code, tmp_path)], f"README block at line {before.line}")
        proc = subprocess.run(["bash", "-c", "set -eo pipefail\n" + block.code], cwd=tmp_path, env=ENV,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{where} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        assert "Traceback" not in proc.stderr
        for text in spec.stdout:
            assert text in proc.stdout, (text, proc.stdout)
        _wait([_python(spec.check, tmp_path)], f"the check after {where}")
        return
    parts = [spec.prelude, before.code if before is not None else "", block.code, spec.check]
    code = "\n".join(parts)
    if spec.ranks == 1:
        for run in range(spec.runs):
            [out] = _wait([_python(code, tmp_path, env={"RUN": str(run)})], f"{where} (run {run})")
        for text in spec.stdout:
            assert text in out, (text, out)
    else:
        assert not spec.stdout, "stdout= checks one process's output"
        rdzv = f"file://{tmp_path / 'rdzv'}"
        _wait([_python(code, tmp_path, r, spec.ranks, rdzv) for r in range(spec.ranks)], where)


def test_readme_links_the_projects_own_api_reference():
    text = README.read_text()
    assert "../shared" not in text
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which is not in the repository"
    assert "docs/API.md" in text and API.exists()


def test_api_reference_names_every_public_name_and_no_stale_one(tmp_path):
    import cnrstore
    from cnrstore import errors, knobs
    from cnrstore.maintenance.compaction import GCReport, CompactReport

    api = API.read_text()
    for name in cnrstore.__all__ + errors.__all__:
        assert re.search(rf"\b{name}\b", api), f"docs/API.md does not mention {name}"
    for name in (n for n in dir(knobs) if n.isupper()):
        assert name in api, f"docs/API.md does not mention knobs.{name}"
    for cls in (GCReport, CompactReport):
        for field in cls.__dataclass_fields__:
            assert f"`{field}" in api or f" {field}" in api, f"docs/API.md does not mention {cls.__name__}.{field}"
    with cnrstore.open(tmp_path / "s", create=True) as store:
        keys = store.stats()
    for key in keys:
        assert f"`{key}`" in api, f"docs/API.md does not list stats() key {key!r}"
    # what the shared page said and the code no longer does
    assert "retain` materializes a baseline" not in api and "materializes nothing" in api


# -- docs/API.md: every python block runs too ------------------------------------------------------------------

def api_blocks() -> list[Block]:
    text = API.read_text()
    return [Block(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```(python)\n(.*?)^```", text, re.M | re.S)]


#: what stands for the reader's store, data and model in API.md's blocks (each block runs after one of these)
API_STORE = '''
import numpy as np
import cnrstore
path = "s"
with cnrstore.open(path, create=True) as _s:
    _s.create_table("t", 100, 8)
    for _step in (10, 20):
        with _s.checkpoint(step=_step) as _ck:
            _ck.put_rows("t", np.arange(100), np.full((100, 8), _step, np.float32))
            _ck.put_dense("d", np.arange(3))
store = cnrstore.open(path)
table, rows, values, name, array = "t", [0, 5], np.ones((2, 8), np.float32), "d", np.arange(4)
num_rows, dim = 50, 8
'''
API_MODEL = '''
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.EmbeddingBag(100, 8), nn.Linear(8, 1))
optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
store_or_path, step = "ckpt0", 1
table, rows = "0", [1, 2]   # (the EmbeddingBag's table and two of its rows)
'''

#: API.md python blocks, by a piece of their text: (prelude, check after)
API_SPECS = {
    "import cnrstore          # never imports torch": ("", "import sys; assert 'torch' not in sys.modules"),
    "store = cnrstore.open(path, create=False": ('import cnrstore\npath = "s"\ncnrstore.open(path, create=True).close()',
                                                 "assert isinstance(store, cnrstore.Store); store.close()"),
    "store.create_table(name, num_rows, dim": (API_STORE + 'name = "u"', "assert 'u' in store.tables()"),
    "store.create_table(name, dim=64, keyed=True": (
        API_STORE + 'name, s, n = "ids", 7, 3\nkeys = np.array([5, 1 << 40, -2])\nvalues = np.ones((n, 64))\n'
        'score, last_step, momentum = np.ones(n), np.arange(n), np.zeros((n, 64))\nevicted = [9]',
        "assert store.keys(name).tolist() == sorted(keys.tolist()) and store.read_keys(name, [5, 9]).found.tolist() "
        "== [True, False]\nassert store.partition_of(name, keys).max() < store.tables()[name].partitions"),
    'codec = cnrstore.codecs.get("int4")': ("import numpy as np\nimport cnrstore\n"
                                           "values = np.random.default_rng(0).standard_normal((6, 8), dtype=np.float32)\n"
                                           "dim = 8", "assert out.shape == (6, 8)"),
    "with store.checkpoint(step=None, meta=None) as ck:": (API_STORE, "assert store.latest().version == ck.version"),
    "store.versions()                              # -> list[VersionInfo]": (API_STORE, ""),
    "store.compact(version=None, progress=None)": (API_STORE, "assert [v.version for v in store.versions()] == [1, 2]"),
    "for tc in store.changes(since=1, until=None": (API_STORE, "assert tc.rows.size == 100 and tc.values[0, 0] == 20"),
    "from cnrstore.serving import Follower, FollowerLag": (API_STORE, "assert v == 1 and (batch == 10).all() and "
                                                           "f.stats['full_syncs'] == 1 and f.version == 1 and FollowerLag(0, 0.0).versions == 0"),
    "report = cnrstore.repair(path, progress=None": ('import cnrstore\npath = "s"\ncnrstore.open(path, create=True).close()',
                                                    "assert report.ok"),
    "from cnrstore.policy import CompactionPolicy, MaxChain": ("mtbf_s, save_cost_s, step_time_s, seconds = 3600.0, 2.0, "
                                                              "0.1, 1.5", "assert ci.interval_s() > 0"),
    "from cnrstore.export import export, export_path": (API_STORE + 'snapshot = store.restore(); fmt = "npz"; '
                                                        'path, path2 = "out.npz", "out2.npz"; source = store',
                                                        "import os; assert os.path.exists(path) and os.path.exists(path2)"),
    "from cnrstore.torch import Checkpointer\nckpt = Checkpointer(store_or_path": (API_MODEL, "assert info is not None"),
    "from cnrstore.torch import Checkpointer, KeyedEmbedding": (
        "", "import cnrstore\nwith cnrstore.open('kckpt') as s:\n    assert s.latest().step == 19 and "
        "s.keys('emb').size == int((model.emb.slot_ids >= 0).sum())\nassert model.emb.lookup(ids).min() >= 0"),
    "options = cnrstore.Options(segment_bytes=64 << 20": ('import dataclasses\nimport cnrstore\npath = "s"',
                                                         "assert store.options.merge_trigger == 2.0; store.close()"),
}
#: API.md blocks not run, and why: reference listings of collectives over several ranks (the README's torchrun
#: and ECRM blocks, and tests/test_distributed*.py / test_ecrm.py, run those calls)
API_NOT_RUN = {
    "from cnrstore.distributed import DistributedCheckpointer, ShardingPlan, ECRM": "collectives over several ranks",
    "from cnrstore.distributed import failures": "a launcher and its ranks, and a failure to report",
    "emb = KeyedEmbedding(capacity, dim, partitions=64": "a rank of a multi-rank job (tests/test_distributed_keyed.py)",
    "from torchft import Manager, ProcessGroupGloo": "replica groups under a torchft lighthouse (the README's torchft "
                                                    "block runs one; tests/test_torchft_recovery.py runs a job)",
}


def _api_block(key: str) -> Block:
    return _only_block(api_blocks(), key, "API.md")


def test_every_api_block_is_run_or_excused():
    _check_run_or_excused(api_blocks(), API_SPECS, API_NOT_RUN, "API.md", python_must_run=False)


@pytest.mark.parametrize("key", sorted(API_SPECS))
def test_api_block_runs_as_written(key, tmp_path):
    prelude, check = API_SPECS[key]
    block = _api_block(key)
    _wait([_python("\n".join([prelude, block.code, check]), tmp_path)], f"API.md block at line {block.line}")
