"""Bit-width selection by the expected number of restores (Check-N-Run, section on quantization).

Quantization error compounds with every restore: a restored model trains on from quantized rows, and
the next checkpoint quantizes those again. So the fewer restores a job expects, the fewer bits its
checkpoints need. The paper's rule, with ``E`` the expected number of restores over the job::

    E <= 1  -> 2-bit        E <= 3  -> 3-bit        E <= 20 -> 4-bit        more -> 8-bit

and, once the restores that actually happen exceed ``E``, 8-bit for the rest of the job.

That table is ``PAPER_TABLE``. The default is ``CALIBRATED_TABLE``, read off this project's accuracy study
(benchmarks/bench_accuracy.py; benchmarks/RESULTS.md, the two Accuracy sections): on a converging DLRM,
held-out logloss against the same run without failures, 8 paired seeds, the paper's bound 0.01%:

- 1 restore: 4-bit holds in every family (int4 +0.0030% ± 0.0037, adaptive4 +0.0007% ± 0.0026,
  kmeans4 +0.0014% ± 0.0014); 2-bit does not (int2 fails, adaptive2/kmeans2 unresolved at +0.03%);
- 3 restores: 3-bit fails in every family, and so does 4-bit uniform and adaptive (+0.060%, +0.037%);
- 20 restores: 4-bit uniform and adaptive fail (+0.28%, +0.16%); 8-bit is unresolved, within the
  noise (int8 -0.029% ± 0.073 at 20, +0.025% ± 0.030 at 40; the fp16 control's spread is as wide).

So: at most one expected restore, 4-bit; more, 8-bit. No cell shows 8-bit to hold 0.01%: the study
cannot resolve 0.01% there (its minimum detectable effect is 0.04-0.1%); fp32 is exact.

``E`` is the cluster's failure rate times the job's length (``failures_per_hour * job_hours``, or
``job_hours / mtbf_hours``), or given directly as ``expected_restores``.

Pure Python: the policy names codecs (``"int4"``, ``"adaptive4"``, ...), it does not load them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from cnrstore import checks
from cnrstore.errors import InvalidArgument

__all__ = ["BitWidthPolicy", "PAPER_TABLE", "CALIBRATED_TABLE", "FALLBACK_BITS"]

#: The paper's table: ``(most expected restores, bits)``, by increasing restores.
PAPER_TABLE: tuple[tuple[float, int], ...] = ((1.0, 2), (3.0, 3), (20.0, 4))
#: The default: what the accuracy study measured (module docstring): 4-bit for at most one restore.
CALIBRATED_TABLE: tuple[tuple[float, int], ...] = ((1.0, 4),)
#: Bits past the table's last row, and after the actual restores exceed the estimate.
FALLBACK_BITS = 8
#: Bit widths that have an adaptive (searched clipping range) codec.
_ADAPTIVE_BITS = frozenset({2, 3, 4})


def _bits(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= 8:
        raise InvalidArgument(f"{name} must be an integer bit width in 1..8, got {value!r}")
    return int(value)


class BitWidthPolicy:
    """Picks the bit width of a job's checkpoints from the number of restores it expects.

    Give exactly one of:

    - ``expected_restores``: the expected number of restores over the job;
    - ``failures_per_hour`` and ``job_hours``: expected restores = their product;
    - ``mtbf_hours`` and ``job_hours``: expected restores = ``job_hours / mtbf_hours``.

    ``table`` maps the expected count to bits: a sequence of ``(most restores, bits)`` rows with the
    restores strictly increasing and the bits strictly increasing, all below ``fallback_bits``; the
    first row whose bound is ``>=`` the expected count gives the bits, past the last row
    ``fallback_bits``. The default is ``CALIBRATED_TABLE`` (``<= 1`` 4-bit, more 8-bit: what this
    project's accuracy study measured); ``table=PAPER_TABLE`` gives the paper's (``<= 1`` 2-bit, ``<= 3``
    3-bit, ``<= 20`` 4-bit, more 8-bit). With ``adaptive=True``, :meth:`codec` names the adaptive (searched clipping
    range) codec of the bit width where there is one (2, 3 and 4 bits).

    :meth:`record_restore` counts the restores that happen; once they exceed the expected count the
    policy falls back to ``fallback_bits`` for good. The count lives in this object: a job that
    restarts in a new process carries it over with :meth:`state_dict` / :meth:`load_state_dict`
    (e.g. as an ``extra`` of ``cnrstore.torch.Checkpointer``), loading it before recording the
    restore. Bad arguments raise :class:`InvalidArgument`. Not thread-safe.
    """

    def __init__(
        self,
        *,
        expected_restores: float | None = None,
        failures_per_hour: float | None = None,
        mtbf_hours: float | None = None,
        job_hours: float | None = None,
        table: Sequence[tuple[float, int]] = CALIBRATED_TABLE,
        fallback_bits: int = FALLBACK_BITS,
        adaptive: bool = False,
    ) -> None:
        self._expected = self._estimate(expected_restores, failures_per_hour, mtbf_hours, job_hours)
        self._fallback_bits = _bits("fallback_bits", fallback_bits)
        self._table = self._check_table(table, self._fallback_bits)
        if not isinstance(adaptive, bool):
            raise InvalidArgument(f"adaptive must be True or False, got {adaptive!r}")
        self._adaptive = adaptive
        self._planned_bits = next((b for bound, b in self._table if self._expected <= bound),
                                  self._fallback_bits)
        self._restores = 0
        self._fallen_back = False

    # -- construction helpers -----------------------------------------------------------------------

    @staticmethod
    def _estimate(expected, failures_per_hour, mtbf_hours, job_hours) -> float:
        given = [n for n, v in (("expected_restores", expected), ("failures_per_hour", failures_per_hour),
                                ("mtbf_hours", mtbf_hours)) if v is not None]
        if len(given) != 1:
            raise InvalidArgument(
                "give exactly one of expected_restores, failures_per_hour (with job_hours) or mtbf_hours "
                f"(with job_hours); got {', '.join(given) or 'none'}"
            )
        if expected is not None:
            if job_hours is not None:
                raise InvalidArgument(
                    "job_hours goes with failures_per_hour or mtbf_hours, not with expected_restores"
                )
            return checks.number(expected, "expected_restores")
        if job_hours is None:
            raise InvalidArgument(f"{given[0]} needs job_hours, the job's expected length in hours")
        hours = checks.number(job_hours, "job_hours")
        if failures_per_hour is not None:
            estimate = checks.number(failures_per_hour, "failures_per_hour") * hours
        else:
            estimate = hours / checks.number(mtbf_hours, "mtbf_hours", positive=True)
        if not math.isfinite(estimate):
            raise InvalidArgument(f"expected restores overflow: {estimate!r}")
        return estimate

    @staticmethod
    def _check_table(table, fallback_bits: int) -> tuple[tuple[float, int], ...]:
        try:
            rows = [tuple(row) for row in table]
        except TypeError as exc:
            raise InvalidArgument(
                f"table must be a sequence of (most restores, bits) pairs, got {table!r}"
            ) from exc
        out = []
        for i, row in enumerate(rows):
            if len(row) != 2:
                raise InvalidArgument(f"table row {i} must be a (most restores, bits) pair, got {row!r}")
            bound = checks.number(row[0], f"table row {i} restores")
            bits = _bits(f"table row {i} bits", row[1])
            if out and not (bound > out[-1][0] and bits > out[-1][1]):
                raise InvalidArgument(
                    f"table rows must have strictly increasing restores and bits; row {i} {row!r} follows "
                    f"{out[-1]!r}"
                )
            out.append((bound, bits))
        if out and out[-1][1] >= fallback_bits:
            raise InvalidArgument(
                f"table bits must stay below fallback_bits={fallback_bits}; row {len(out) - 1} has {out[-1][1]}"
            )
        return tuple(out)

    # -- state -----------------------------------------------------------------------------------------

    @property
    def expected_restores(self) -> float:
        """The expected number of restores over the job, as estimated at construction."""
        return self._expected

    @property
    def restores(self) -> int:
        """Restores recorded so far."""
        return self._restores

    @property
    def fallen_back(self) -> bool:
        """True once the recorded restores have exceeded the estimate (sticky)."""
        return self._fallen_back

    @property
    def bits(self) -> int:
        """Bit width for the next checkpoint: the table's choice, or ``fallback_bits`` after a fallback."""
        return self._fallback_bits if self._fallen_back else self._planned_bits

    def codec(self) -> str:
        """Codec name for the next checkpoint: ``"int{bits}"``, or ``"adaptive{bits}"`` with
        ``adaptive=True`` where that codec exists (2, 3 and 4 bits)."""
        bits = self.bits
        if self._adaptive and bits in _ADAPTIVE_BITS:
            return f"adaptive{bits}"
        return f"int{bits}"

    def record_restore(self) -> int:
        """Count one restore; fall back to ``fallback_bits`` for good once the count exceeds the
        estimate. Returns :attr:`bits` as of now."""
        self._restores += 1
        if self._restores > self._expected:
            self._fallen_back = True
        return self.bits

    def state_dict(self) -> dict:
        """The mutable state (restores counted, fallen back), msgpack-able."""
        return {"restores": self._restores, "fallen_back": self._fallen_back}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (the estimate and table stay this object's own)."""
        try:
            restores, fallen_back = state["restores"], state["fallen_back"]
        except (TypeError, KeyError) as exc:
            raise InvalidArgument(f"not a BitWidthPolicy state: {state!r}") from exc
        if isinstance(restores, bool) or not isinstance(restores, numbers.Integral) or restores < 0:
            raise InvalidArgument(f"restores must be an integer >= 0, got {restores!r}")
        if not isinstance(fallen_back, bool):
            raise InvalidArgument(f"fallen_back must be True or False, got {fallen_back!r}")
        self._restores = int(restores)
        self._fallen_back = fallen_back or self._restores > self._expected

    def __repr__(self) -> str:
        return (f"BitWidthPolicy(expected_restores={self._expected:g}, restores={self._restores}, "
                f"bits={self.bits}, codec={self.codec()!r}{', fallen back' if self._fallen_back else ''})")
