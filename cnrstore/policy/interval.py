"""How often to checkpoint, from the failure rate, the measured save and restore cost, and the recovery
mode (CPR, Maeng et al., MLSys 2021, arXiv 2011.02999; Young 1974; Daly 2006).

Notation: ``M`` the job's mean time between failures (any shard or trainer failing), ``δ`` the time
training loses per checkpoint (with ``cnrstore.torch``'s decoupled save, the stall while rows are copied
to host memory, not the background write), ``R`` the time a failure costs before training resumes (the
restore), ``τ`` the interval: training time between two checkpoints. All in seconds.

**Full recovery** (every rank reloads the last checkpoint and re-computes what was lost):

- Young (CACM 1974): ``τ = sqrt(2 δ M)``, the minimum of the first-order cost ``δ/τ + τ/(2M)``.
- Daly (FGCS 22, 2006, "A higher order estimate of the optimum checkpoint interval for restart
  dumps"): for ``δ < 2M``, ``τ = sqrt(2 δ M) · [1 + (1/3)·sqrt(δ/(2M)) + (1/9)·(δ/(2M))] − δ``, and
  ``τ = M`` for ``δ >= 2M``. It approximates the optimum of his complete model of wall-clock time,
  ``T_w(τ) = M · e^{R/M} · (e^{(τ+δ)/M} − 1) · T_solve / τ`` (Poisson failures, failures during
  checkpoints and restarts counted). The restart cost ``R`` enters that model only through the constant
  factor ``e^{R/M}``, so it changes the expected run time but not the optimal interval: Daly's paper
  states its examples with ``R = 10 min`` (``δ = 5 min``: ``M = 24 h → τ ≈ 117 min``;
  ``M = 6 h → 57 min``; ``M = 15 min → 9.1 min``), which the tests reproduce.

  Daly is the default (``full_rule="daly"``): it agrees with Young to first order when ``δ ≪ M`` and
  stays close to the true optimum when checkpoints are expensive relative to the MTBF, where Young's
  interval is too long (and exceeds ``M`` once ``δ > M/2``). ``full_rule="young"`` gives the textbook
  rule, the one the project's notes on CPR name as the baseline to compare against.

**Partial recovery** (CPR): only the failed embedding shard reloads its part of the last checkpoint;
the other ``N`` − 1 shards keep their live state, and the failed shard's updates since the checkpoint are
lost rather than re-computed. The interval is then chosen for model quality, not for time: keep the
expected *portion of lost samples* (PLS) under a target. Failures arrive at rate ``1/M`` and uniformly
within an interval, so each loses on average ``τ/2`` of training on one shard, which holds ``1/N`` of the
embedding rows::

    PLS ≈ (τ/2) · (1/N) / M = τ / (2 M N)        so        τ = 2 · PLS_target · M · N

Source check (the project's search tool, corpora "pages", "docs", "issues" and "code"): what could be
read of the paper was its abstract (MLSys 2021 proceedings page; first page of a full-text mirror at
readkong.com), which says CPR selects "an appropriate checkpoint saving interval" to keep the desired
model accuracy, and a reading note (github.com/jasperzhong/read-papers-and-code/issues/151: production
MTBF 14-30 h). The section stating CPR's interval rule was not reachable, so
``τ = 2 · PLS_target · M · N`` is the derivation from the project's brief, checked here for
consistency only and not quoted from the paper; if the paper's rule differs (e.g. in whether ``M`` is
per node or per job), this is the place to change. CPR's benefit estimate (whether partial recovery
pays at all) is left to the caller: build both policies and compare ``expected_overhead().total``.

Pure Python, no torch: a trainer feeds measured timings in through :meth:`CheckpointInterval.observe_save`
and :meth:`CheckpointInterval.observe_restore` and asks for the interval in seconds or steps.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

from cnrstore import checks
from cnrstore.errors import InvalidArgument

__all__ = ["CheckpointInterval", "Overhead", "young_interval", "daly_interval", "partial_interval",
           "RECOVERY_MODES", "FULL_RULES"]

RECOVERY_MODES = ("full", "partial")
FULL_RULES = ("daly", "young")
_HOUR_S = 3600.0


def _finite(name: str, value: float, hint: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{name} comes out as {value!r}; {hint}")
    return value


# -- the rules, as plain functions -----------------------------------------------------------------------

def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum ``sqrt(2 · save_cost · MTBF)``, in seconds."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum, in seconds: ``M`` when ``save_cost >= 2M``, else
    ``sqrt(2δM)·[1 + sqrt(δ/2M)/3 + (δ/2M)/9] − δ``. Independent of the restart cost (module doc)."""
    if save_cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_cost_s / (2.0 * mtbf_s)
    return young_interval(save_cost_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_cost_s


def partial_interval(max_lost_fraction: float, mtbf_s: float, shards: int) -> float:
    """CPR's partial-recovery interval ``2 · PLS_target · MTBF · shards``, in seconds."""
    return 2.0 * max_lost_fraction * mtbf_s * shards


@dataclass(frozen=True)
class Overhead:
    """Expected cost of failure tolerance at one interval, first-order (valid while ``total`` ≪ 1).

    ``save``, ``restore``, ``recompute`` and ``total`` are fractions of training time:
    ``save = δ/τ`` (stalls for checkpoints), ``restore = R/M`` (restores, one per failure),
    ``recompute = τ/(2M)`` under full recovery (half an interval re-trained per failure; 0 under partial
    recovery, which loses those updates instead). ``lost_updates`` is the expected portion of lost
    samples, ``τ/(2MN)`` under partial recovery and 0 under full recovery: a quality cost, not time,
    so it is not part of ``total``.
    """

    interval_s: float
    save: float
    restore: float
    recompute: float
    total: float
    lost_updates: float

    def as_dict(self) -> dict:
        """The fields as a plain dict (for printing beside measured values)."""
        return asdict(self)


class CheckpointInterval:
    """The checkpoint interval of a job, from its MTBF, its save and restore cost and its recovery mode.

    ``mtbf_s`` is the job's mean time between failures in seconds (the whole job: with ``k`` machines
    failing independently every ``m`` seconds on average, ``m / k``); ``save_cost_s`` (> 0) the time
    training loses per checkpoint; ``restore_cost_s`` (>= 0) the time a failure costs before training
    resumes (under partial recovery: the failed shard's restore).

    ``recovery="full"`` uses ``full_rule`` (``"daly"``, the default, or ``"young"``; see the module
    doc for which and why). ``recovery="partial"`` uses CPR's rule and needs ``shards`` (the number of
    embedding shards, an integer >= 1) and ``max_lost_fraction`` (the PLS target, in (0, 1)); the save
    cost then does not move the interval, only the overhead.

    :meth:`observe_save` / :meth:`observe_restore` feed measured timings in: the first measurement
    replaces the estimate given at construction, later ones update an exponential moving average with
    weight ``smoothing`` (in (0, 1]; 1 keeps only the latest). :meth:`state_dict` carries the measured
    costs across a restart. Bad arguments raise :class:`InvalidArgument`. Not thread-safe.
    """

    def __init__(
        self,
        mtbf_s: float,
        save_cost_s: float,
        restore_cost_s: float = 0.0,
        *,
        recovery: str = "full",
        shards: int = 1,
        max_lost_fraction: float | None = None,
        full_rule: str = "daly",
        smoothing: float = 0.25,
    ) -> None:
        self._mtbf_s = checks.number(mtbf_s, "mtbf_s", positive=True)
        self._save_cost_s = checks.number(save_cost_s, "save_cost_s", positive=True)
        self._restore_cost_s = checks.number(restore_cost_s, "restore_cost_s")
        if recovery not in RECOVERY_MODES:
            raise InvalidArgument(f"recovery must be 'full' or 'partial', got {recovery!r}")
        self._recovery = recovery
        if full_rule not in FULL_RULES:
            raise InvalidArgument(f"full_rule must be 'daly' or 'young', got {full_rule!r}")
        self._full_rule = full_rule
        if isinstance(shards, bool) or not isinstance(shards, numbers.Integral) or shards < 1:
            raise InvalidArgument(
                f"shards must be an integer >= 1 (the number of embedding shards), got {shards!r}"
            )
        self._shards = int(shards)
        self._max_lost = self._check_lost_fraction(recovery, max_lost_fraction)
        if (isinstance(smoothing, bool) or not isinstance(smoothing, numbers.Real)
                or not 0 < float(smoothing) <= 1):
            raise InvalidArgument(f"smoothing must be a number in (0, 1], got {smoothing!r}")
        self._smoothing = float(smoothing)
        self._saves_observed = 0
        self._restores_observed = 0

    @staticmethod
    def _check_lost_fraction(recovery: str, value) -> float | None:
        if recovery == "full":
            if value is not None:
                raise InvalidArgument(
                    "max_lost_fraction goes with recovery='partial' (full recovery re-computes and loses "
                    "no updates); drop it or pass recovery='partial'"
                )
            return None
        if value is None:
            raise InvalidArgument(
                "recovery='partial' needs max_lost_fraction, the target portion of lost samples "
                "(e.g. 0.01 for 1%)"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < 1:
            raise InvalidArgument(f"max_lost_fraction must be a number in (0, 1), got {value!r}")
        return float(value)

    # -- other ways to give the failure rate (as BitWidthPolicy takes it) --------------------------------

    @classmethod
    def from_failure_rate(cls, failures_per_hour: float, save_cost_s: float, restore_cost_s: float = 0.0,
                          **kwargs) -> CheckpointInterval:
        """From the job's failure rate per hour (> 0): ``MTBF = 3600 / failures_per_hour`` seconds."""
        rate = checks.number(failures_per_hour, "failures_per_hour", positive=True)
        mtbf = _finite("MTBF", _HOUR_S / rate, "pass a larger failures_per_hour")
        return cls(mtbf, save_cost_s, restore_cost_s, **kwargs)

    @classmethod
    def from_mtbf_hours(cls, mtbf_hours: float, save_cost_s: float, restore_cost_s: float = 0.0,
                        **kwargs) -> CheckpointInterval:
        """From the job's MTBF in hours (> 0)."""
        hours = checks.number(mtbf_hours, "mtbf_hours", positive=True)
        mtbf = _finite("MTBF", hours * _HOUR_S, "pass a smaller mtbf_hours")
        return cls(mtbf, save_cost_s, restore_cost_s, **kwargs)

    @classmethod
    def from_expected_failures(cls, expected_failures: float, job_hours: float, save_cost_s: float,
                               restore_cost_s: float = 0.0, **kwargs) -> CheckpointInterval:
        """From the failures expected over a job of ``job_hours`` (both > 0), as given to
        ``BitWidthPolicy(expected_restores=...)``: ``MTBF = job_hours · 3600 / expected_failures``."""
        expected = checks.number(expected_failures, "expected_failures", positive=True)
        hours = checks.number(job_hours, "job_hours", positive=True)
        mtbf = _finite("MTBF", hours * _HOUR_S / expected,
                       "pass job_hours and expected_failures of comparable magnitude")
        return cls(mtbf, save_cost_s, restore_cost_s, **kwargs)

    def expected_failures(self, job_hours: float) -> float:
        """Failures expected over ``job_hours``: what ``BitWidthPolicy(expected_restores=...)`` takes."""
        return checks.number(job_hours, "job_hours") * _HOUR_S / self._mtbf_s

    # -- state -------------------------------------------------------------------------------------------

    @property
    def mtbf_s(self) -> float:
        return self._mtbf_s

    @property
    def save_cost_s(self) -> float:
        """The save cost in use: the construction estimate, or the moving average of measurements."""
        return self._save_cost_s

    @property
    def restore_cost_s(self) -> float:
        """The restore cost in use: the construction estimate, or the moving average of measurements."""
        return self._restore_cost_s

    @property
    def recovery(self) -> str:
        return self._recovery

    @property
    def shards(self) -> int:
        return self._shards

    @property
    def max_lost_fraction(self) -> float | None:
        """The PLS target under partial recovery; None under full recovery."""
        return self._max_lost

    @property
    def full_rule(self) -> str:
        return self._full_rule

    def interval_s(self) -> float:
        """Training time between checkpoints, in seconds, under the current costs."""
        if self._recovery == "partial":
            return partial_interval(self._max_lost, self._mtbf_s, self._shards)
        if self._full_rule == "young":
            return young_interval(self._save_cost_s, self._mtbf_s)
        return daly_interval(self._save_cost_s, self._mtbf_s)

    def interval_steps(self, step_time_s: float) -> int:
        """The interval in training steps of ``step_time_s`` seconds (> 0): rounded down, so that a
        partial-recovery job stays within its PLS target, and at least 1."""
        step = checks.number(step_time_s, "step_time_s", positive=True)
        interval = self.interval_s()
        n = math.floor(interval / step)
        if (n + 1) * step <= interval:    # the quotient rounded below a whole number (0.6 / 1e-4 = 5999.99...)
            n += 1
        return max(1, n)

    def expected_overhead(self, interval_s: float | None = None) -> Overhead:
        """The expected overhead (see :class:`Overhead`) at ``interval_s`` (> 0), by default at
        :meth:`interval_s`; pass the interval a run actually used to compare with its measurements."""
        tau = self.interval_s() if interval_s is None else checks.number(interval_s, "interval_s", positive=True)
        save = self._save_cost_s / tau
        restore = self._restore_cost_s / self._mtbf_s
        if self._recovery == "full":
            recompute, lost = tau / (2.0 * self._mtbf_s), 0.0
        else:
            recompute, lost = 0.0, tau / (2.0 * self._mtbf_s * self._shards)
        return Overhead(interval_s=tau, save=save, restore=restore, recompute=recompute,
                        total=save + restore + recompute, lost_updates=lost)

    # -- measurements ------------------------------------------------------------------------------------

    def _blend(self, old: float, new: float, seen: int) -> float:
        return new if seen == 0 else (1.0 - self._smoothing) * old + self._smoothing * new

    def observe_save(self, seconds: float) -> float:
        """Record a measured save cost (> 0 seconds: the trainer's stall for one checkpoint). Returns
        :meth:`interval_s` under the updated cost."""
        s = checks.number(seconds, "seconds", positive=True)
        self._save_cost_s = self._blend(self._save_cost_s, s, self._saves_observed)
        self._saves_observed += 1
        return self.interval_s()

    def observe_restore(self, seconds: float) -> float:
        """Record a measured restore cost (>= 0 seconds, from failure to training again). Returns
        :meth:`interval_s` (which the restore cost does not move; see the module doc)."""
        s = checks.number(seconds, "seconds")
        self._restore_cost_s = self._blend(self._restore_cost_s, s, self._restores_observed)
        self._restores_observed += 1
        return self.interval_s()

    @property
    def saves_observed(self) -> int:
        return self._saves_observed

    @property
    def restores_observed(self) -> int:
        return self._restores_observed

    def state_dict(self) -> dict:
        """The measured costs and how many measurements made them, msgpack-able."""
        return {"save_cost_s": self._save_cost_s, "restore_cost_s": self._restore_cost_s,
                "saves_observed": self._saves_observed, "restores_observed": self._restores_observed}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (MTBF, mode and targets stay this object's own)."""
        try:
            save, restore = state["save_cost_s"], state["restore_cost_s"]
            n_save, n_restore = state["saves_observed"], state["restores_observed"]
        except (TypeError, KeyError) as exc:
            raise InvalidArgument(f"not a CheckpointInterval state: {state!r}") from exc
        save = checks.number(save, "save_cost_s", positive=True)
        restore = checks.number(restore, "restore_cost_s")
        for name, n in (("saves_observed", n_save), ("restores_observed", n_restore)):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
                raise InvalidArgument(f"{name} must be an integer >= 0, got {n!r}")
        self._save_cost_s, self._restore_cost_s = save, restore
        self._saves_observed, self._restores_observed = int(n_save), int(n_restore)

    def __repr__(self) -> str:
        mode = (f"partial, shards={self._shards}, max_lost_fraction={self._max_lost:g}"
                if self._recovery == "partial" else f"full, rule={self._full_rule}")
        return (f"CheckpointInterval(mtbf_s={self._mtbf_s:g}, save_cost_s={self._save_cost_s:g}, "
                f"restore_cost_s={self._restore_cost_s:g}, {mode}, interval_s={self.interval_s():g})")
