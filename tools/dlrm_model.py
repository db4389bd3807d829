"""The reference DLRM that ``tools/train_dlrm.py`` trains and ``tools/dlrm_dist.py`` shards: the model, its
synthetic Criteo-shaped data, the held-out metrics, and the progress line and number formats both report
with.

The single-process trainer (``train_dlrm.py``) and its multi-rank mode (``dlrm_dist.py``) both import this
module and neither imports the other at module level: ``train_dlrm.main`` hands ``--world-size N`` to
``dlrm_dist.run``, and ``dlrm_dist`` needs nothing of the trainer but what is here. The benchmarks import
it for the same workload.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

import numpy as np
import torch
from torch import nn

#: Criteo Kaggle (Display Advertising Challenge) cardinalities of the 26 categorical features.
CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
NUM_DENSE = 13
ZIPF_EXPONENT = 1.05
#: Seed offsets: the teacher, the held-out set and the per-restart student inits never share a stream.
TEACHER_SEED_OFFSET = 10_007
HOLDOUT_STREAM = 1
TRAIN_STREAM = 0
#: Teacher logits are standardized then scaled: a positive rate near Criteo's ~25%, a learnable signal.
TEACHER_LOGIT_SCALE = 2.0
TEACHER_LOGIT_BIAS = -1.4
#: The teacher's embedding init range: small enough that the dense features and the hot rows carry most
#: of the signal, so a student sees enough of it in a short run (AUC ~0.50 -> ~0.73 in 300 steps).
TEACHER_EMB_SCALE = 0.1



# ---------------------------------------------------------------------------------------------- model


def mlp(sizes: list[int], final_sigmoid: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    if final_sigmoid:
        layers.append(nn.Sigmoid())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP, EmbeddingBags (sum), pairwise dot interaction, top MLP. ``forward`` returns logits."""

    def __init__(self, cardinalities: list[int], dim: int, bottom: list[int], top: list[int],
                 emb_scale: float = 0.05):
        super().__init__()
        self.dim = dim
        self.bottom = mlp([NUM_DENSE, *bottom, dim])
        self.embs = nn.ModuleList(nn.EmbeddingBag(n, dim, mode="sum") for n in cardinalities)
        for e in self.embs:
            nn.init.uniform_(e.weight, -emb_scale, emb_scale)
        f = len(cardinalities) + 1
        self._tri = torch.triu_indices(f, f, offset=1)
        self.top = mlp([dim + f * (f - 1) // 2, *top, 1])

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)                                            # (B, d)
        # One id per feature per sample: each row of the (B, 1) input is a bag of one.
        pooled = torch.stack([e(ids[:, t:t + 1]) for t, e in enumerate(self.embs)], dim=1)   # (B, 26, d)
        return self.top(interaction(x, pooled, self._tri)).squeeze(1)


def interaction(x: torch.Tensor, pooled: torch.Tensor, tri: torch.Tensor) -> torch.Tensor:
    """The top MLP's input: the bottom MLP's output ``x`` (B, d) and the dot product of every pair of the
    feature vectors ``[x, pooled[:, 0], ...]`` (``pooled``: (B, T, d); ``tri``: the pairs, upper triangle)."""
    feats = torch.cat([x.unsqueeze(1), pooled], dim=1)                    # (B, 27, d)
    z = torch.bmm(feats, feats.transpose(1, 2))                           # (B, 27, 27)
    return torch.cat([x, z[:, tri[0], tri[1]]], dim=1)                    # (B, d + 351)


class TorchRecDLRM(nn.Module):
    """``DLRM`` with its tables in one torchrec ``EmbeddingBagCollection`` (table ``t<i>`` pools feature
    ``f<i>``, sum), built from a ``DLRM``: the same bottom/top MLP modules and interaction, the tables'
    initial weights copied in (on ``device="meta"`` nothing is copied: the tables are made to be sharded
    by ``DistributedModelParallel``, which materializes them). ``forward(dense, ids)`` takes the same
    (B, 26) id batch as ``DLRM``, as a ``KeyedJaggedTensor`` of one id per feature per sample."""

    def __init__(self, plain: DLRM, device: torch.device | str | None = None):
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType  # noqa: PLC0415

        self.dim = plain.dim
        self.bottom, self.top, self._tri = plain.bottom, plain.top, plain._tri
        self.keys = [f"f{t}" for t in range(len(plain.embs))]
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=e.embedding_dim, num_embeddings=e.num_embeddings,
                                       feature_names=[k], pooling=PoolingType.SUM)
                    for t, (k, e) in enumerate(zip(self.keys, plain.embs))], device=device)
        if torch.device(device or "cpu").type != "meta":
            with torch.no_grad():
                for t, e in enumerate(plain.embs):
                    self.ebc.embedding_bags[f"t{t}"].weight.copy_(e.weight)

    def features(self, ids: torch.Tensor):
        """The (B, T) id batch as a ``KeyedJaggedTensor``: key ``f<t>`` holds column ``t``, one id per sample."""
        from torchrec import KeyedJaggedTensor  # noqa: PLC0415

        return KeyedJaggedTensor.from_lengths_sync(keys=self.keys, values=ids.t().reshape(-1),
                                                   lengths=torch.ones(ids.numel(), dtype=torch.int64))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        by_key = self.ebc(self.features(ids)).to_dict()    # a sharded collection may order its keys otherwise
        pooled = torch.stack([by_key[k] for k in self.keys], dim=1)                 # (B, 26, d)
        return self.top(interaction(x, pooled, self._tri)).squeeze(1)


def build_model(args, seed: int, emb_scale: float = 0.05) -> DLRM:
    torch.manual_seed(seed)
    return DLRM(cardinalities(args), args.dim, [64, 32], [64, 32], emb_scale=emb_scale)


def make_model(args, seed: int) -> nn.Module:
    """The model a run trains: ``build_model``'s DLRM, or with ``--torchrec`` the same one (same init) as a
    ``TorchRecDLRM``."""
    plain = build_model(args, seed)
    return TorchRecDLRM(plain) if getattr(args, "torchrec", False) else plain


def build_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(model.parameters(), lr=lr)


def cardinalities(args) -> list[int]:
    return [min(c, args.max_rows) for c in CRITEO_KAGGLE_CARDINALITIES]


# ----------------------------------------------------------------------------------------------- data


class SyntheticCriteo:
    """Criteo-Kaggle-shaped batches, each a pure function of ``(seed, stream, batch index)``.

    Categorical ids follow a finite Zipf(``ZIPF_EXPONENT``) over each table's rows, ranked by a fixed
    random permutation; labels are Bernoulli(sigmoid(teacher logits)). The loader's whole state is its
    position (the next batch index): ``state_dict()`` / ``load_state_dict()`` save and restore it.
    """

    def __init__(self, args, stream: int = TRAIN_STREAM):
        self.seed = args.seed
        self.stream = stream
        self.batch_size = args.batch_size
        self.position = 0
        rng = np.random.default_rng([args.seed, 7])
        self.perms = []
        self.cdfs = []
        for n in cardinalities(args):
            self.perms.append(rng.permutation(n).astype(np.int64))
            w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** ZIPF_EXPONENT
            cdf = np.cumsum(w)
            self.cdfs.append(cdf / cdf[-1])
        self.teacher = build_model(args, args.seed + TEACHER_SEED_OFFSET, emb_scale=TEACHER_EMB_SCALE).eval()
        with torch.no_grad():  # calibrate the teacher's logits once, on a fixed batch
            d, i = self._features(np.random.default_rng([args.seed, 99]), 8192)
            t = self.teacher(d, i)
            self._t_mean, self._t_std = float(t.mean()), float(t.std()) + 1e-6

    def _features(self, rng: np.random.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        counts = np.floor(rng.lognormal(mean=1.0, sigma=1.5, size=(n, NUM_DENSE)))
        dense = torch.from_numpy(np.log1p(counts).astype(np.float32))    # DLRM's log(1 + x) transform
        ids = np.empty((n, len(self.perms)), dtype=np.int64)
        u = rng.random((n, len(self.perms)))
        for t, (perm, cdf) in enumerate(zip(self.perms, self.cdfs)):
            ranks = np.minimum(np.searchsorted(cdf, u[:, t], side="right"), perm.size - 1)
            ids[:, t] = perm[ranks]
        return dense, torch.from_numpy(ids)

    def batch(self, k: int, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Batch ``k`` of this stream: (dense float32 (B,13), ids int64 (B,26), labels float32 (B,))."""
        rng = np.random.default_rng([self.seed, self.stream, k])
        dense, ids = self._features(rng, n or self.batch_size)
        with torch.no_grad():
            logit = self.teacher(dense, ids)
        p = self.teacher_probs(logit)
        labels = (rng.random(p.shape[0]) < p).astype(np.float32)
        return dense, ids, torch.from_numpy(labels)

    def teacher_probs(self, logit: torch.Tensor) -> np.ndarray:
        """P(label = 1) given the teacher's raw logits: standardized, scaled and shifted."""
        logit = TEACHER_LOGIT_SCALE * (logit - self._t_mean) / self._t_std + TEACHER_LOGIT_BIAS
        return torch.sigmoid(logit).numpy()

    def next(self):
        b = self.batch(self.position)
        self.position += 1
        return b

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "stream": self.stream,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        if (state["seed"], state["stream"], state["batch_size"]) != (self.seed, self.stream, self.batch_size):
            raise ValueError(f"loader state is for seed/stream/batch size {state['seed']}/{state['stream']}/"
                             f"{state['batch_size']}, this loader is {self.seed}/{self.stream}/{self.batch_size}")
        self.position = int(state["position"])


# -------------------------------------------------------------------------------------------- metrics


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum (Mann-Whitney) formula, ties given their average rank."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(scores.size, dtype=np.float64)
    # Average rank over each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    avg = (starts + ends + 1) / 2.0                                       # 1-based average rank of a run
    ranks[order] = np.repeat(avg, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    p = np.clip(np.asarray(probs, dtype=np.float64), 1e-7, 1 - 1e-7)
    y = np.asarray(labels, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


class Holdout:
    """A fixed held-out set from its own stream of the same distribution."""

    def __init__(self, args, batches: int):
        data = SyntheticCriteo(args, stream=HOLDOUT_STREAM)
        parts = [data.batch(k, 4096) for k in range(batches)]
        self.dense = torch.cat([p[0] for p in parts])
        self.ids = torch.cat([p[1] for p in parts])
        self.labels = torch.cat([p[2] for p in parts]).numpy()
        with torch.no_grad():   # the Bayes-optimal predictor: the teacher's own probabilities
            self.ceiling = (logloss(self.labels, data.teacher_probs(data.teacher(self.dense, self.ids))),
                            auc(self.labels, data.teacher_probs(data.teacher(self.dense, self.ids))))

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        with torch.no_grad():
            probs = torch.sigmoid(model(self.dense, self.ids)).numpy()
        return logloss(self.labels, probs), auc(self.labels, probs)


# ------------------------------------------------------------------------------------------- progress


class Progress:
    """One stderr line redrawn in place on a TTY; otherwise a plain line every ~10%."""

    def __init__(self, total: int, label: str, enabled: bool = True):
        self.total, self.label, self.enabled = total, label, enabled
        self.tty = sys.stderr.isatty()
        self.t0 = time.perf_counter()
        self.last_draw = 0.0
        self.last_step = -1
        self.every = max(1, total // 10)
        self.note = ""

    def update(self, step: int, loss: float, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if force and step == self.last_step:
            return
        if self.tty and not force and now - self.last_draw < 0.1 and step < self.total:
            return
        if not self.tty and not force and step % self.every and step != self.total:
            return
        self.last_draw, self.last_step = now, step
        el = now - self.t0
        rate = step / el if el > 0 else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        width = 24
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        line = (f"{self.label} [{bar}] {step}/{self.total} loss {loss:.4f} {rate:5.1f} it/s "
                f"eta {eta:4.0f}s {self.note}")
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(150))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r" + " " * 150 + "\r")
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def fmt_ms(s: float) -> str:
    return "n/a" if s != s else f"{1000 * s:.1f} ms"


# -------------------------------------------------------------------------------------------- torchrec


def quiet_torchrec() -> None:
    """Silence what torch and torchrec say on every ``--torchrec`` run about their own APIs (deprecations,
    the planner's heuristics), which this tool cannot act on; errors still show."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in ("torchrec", "torch.fx._symbolic_trace"):
        logging.getLogger(name).setLevel(logging.ERROR)
