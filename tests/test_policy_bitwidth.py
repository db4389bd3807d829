"""BitWidthPolicy: the calibrated default table, the paper's table and their boundaries, the estimate's sources, the sticky 8-bit
fallback, parameter validation, monotonicity."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cnrstore.errors import InvalidArgument
from cnrstore.policy import BitWidthPolicy
from cnrstore.policy.bitwidth import CALIBRATED_TABLE, PAPER_TABLE


@pytest.mark.parametrize("expected,bits", [(0, 4), (1, 4), (math.nextafter(1, 2), 8), (3, 8), (20, 8), (1e6, 8)])
def test_the_default_is_the_calibrated_table(expected, bits):
    """What the accuracy study measured (RESULTS.md): 4-bit held at 1 restore, failed at 3 (uniform, adaptive)."""
    assert CALIBRATED_TABLE == ((1.0, 4),)
    p = BitWidthPolicy(expected_restores=expected)
    assert p.bits == bits and p.codec() == f"int{bits}"
    assert BitWidthPolicy(expected_restores=expected, adaptive=True).codec() == ("adaptive4" if bits == 4 else "int8")
    p.record_restore()
    p.record_restore()
    assert p.bits == (8 if 2 > expected else bits)


@pytest.mark.parametrize("expected,bits", [
    (0, 2), (0.5, 2), (1, 2), (math.nextafter(1, 2), 3), (2, 3), (3, 3), (3.0001, 4), (10, 4), (20, 4),
    (math.nextafter(20, 21), 8), (21, 8), (1e6, 8),
])
def test_paper_table_boundaries(expected, bits):
    p = BitWidthPolicy(expected_restores=expected, table=PAPER_TABLE)
    assert p.bits == bits and p.codec() == f"int{bits}"
    assert p.expected_restores == expected and p.restores == 0 and not p.fallen_back
    assert PAPER_TABLE == ((1.0, 2), (3.0, 3), (20.0, 4))


def test_estimate_from_failure_rate_or_mtbf():
    assert BitWidthPolicy(failures_per_hour=0.05, job_hours=40, table=PAPER_TABLE).expected_restores == pytest.approx(2.0)
    assert BitWidthPolicy(failures_per_hour=0.05, job_hours=40, table=PAPER_TABLE).bits == 3
    p = BitWidthPolicy(mtbf_hours=20, job_hours=300, table=PAPER_TABLE)  # 15 restores
    assert p.expected_restores == 15 and p.bits == 4
    assert BitWidthPolicy(mtbf_hours=30, job_hours=30, table=PAPER_TABLE).bits == 2
    assert BitWidthPolicy(failures_per_hour=0, job_hours=1e6, table=PAPER_TABLE).bits == 2
    assert BitWidthPolicy(failures_per_hour=1, job_hours=0, table=PAPER_TABLE).bits == 2
    assert BitWidthPolicy(mtbf_hours=1, job_hours=21, table=PAPER_TABLE).bits == 8


@pytest.mark.parametrize("expected,codec", [(1, "adaptive2"), (3, "adaptive3"), (20, "adaptive4"), (21, "int8")])
def test_adaptive_names(expected, codec):
    assert BitWidthPolicy(expected_restores=expected, adaptive=True, table=PAPER_TABLE).codec() == codec


def test_falls_back_to_8_bit_once_restores_exceed_the_estimate_and_stays():
    p = BitWidthPolicy(expected_restores=2, adaptive=True, table=PAPER_TABLE)
    assert (p.bits, p.codec()) == (3, "adaptive3")
    assert p.record_restore() == 3 and p.record_restore() == 3  # 2 restores: within the estimate
    assert p.restores == 2 and not p.fallen_back
    assert p.record_restore() == 8  # the third exceeds it
    assert p.fallen_back and p.bits == 8 and p.codec() == "int8" and p.restores == 3
    for _ in range(5):
        p.record_restore()
    assert p.bits == 8 and p.restores == 8


def test_fallback_with_fractional_estimate():
    p = BitWidthPolicy(failures_per_hour=0.01, job_hours=50, table=PAPER_TABLE)  # 0.5 expected
    assert p.bits == 2
    p.record_restore()
    assert p.fallen_back and p.bits == 8
    p = BitWidthPolicy(expected_restores=0, table=PAPER_TABLE)
    assert p.record_restore() == 8


def test_custom_table_and_fallback_bits():
    table = [(0.5, 1), (2, 3), (5, 5), (50, 6)]
    cases = {0.5: 1, 0.6: 3, 2: 3, 4: 5, 50: 6, 51: 7}
    for expected, bits in cases.items():
        assert BitWidthPolicy(expected_restores=expected, table=table, fallback_bits=7).bits == bits
    p = BitWidthPolicy(expected_restores=1, table=table, fallback_bits=7, adaptive=True)
    assert p.codec() == "adaptive3"
    p.record_restore()
    p.record_restore()
    assert p.codec() == "int7"
    assert BitWidthPolicy(expected_restores=0, table=()).bits == 8  # no table: always the fallback


def test_state_dict_carries_the_count_across_processes():
    p = BitWidthPolicy(expected_restores=3, table=PAPER_TABLE)
    p.record_restore()
    state = p.state_dict()
    assert state == {"restores": 1, "fallen_back": False}
    q = BitWidthPolicy(expected_restores=3, table=PAPER_TABLE)  # the restarted job
    q.load_state_dict(state)
    q.record_restore()
    q.record_restore()
    assert q.restores == 3 and q.bits == 3
    q.record_restore()
    assert q.bits == 8 and q.state_dict() == {"restores": 4, "fallen_back": True}
    r = BitWidthPolicy(expected_restores=30, table=PAPER_TABLE)
    r.load_state_dict(q.state_dict())
    assert r.fallen_back and r.bits == 8  # sticky, even under a larger estimate
    for bad in [None, {}, {"restores": -1, "fallen_back": False}, {"restores": 1.5, "fallen_back": False},
                {"restores": 1, "fallen_back": 1}]:
        with pytest.raises(InvalidArgument):
            r.load_state_dict(bad)


@pytest.mark.parametrize("kwargs", [
    {},
    {"expected_restores": 1, "failures_per_hour": 0.1, "job_hours": 10},
    {"failures_per_hour": 0.1, "mtbf_hours": 10, "job_hours": 10},
    {"expected_restores": 1, "job_hours": 10},
    {"failures_per_hour": 0.1},
    {"mtbf_hours": 10},
    {"job_hours": 10},
    {"expected_restores": -1},
    {"expected_restores": math.nan},
    {"expected_restores": math.inf},
    {"expected_restores": "3"},
    {"expected_restores": True},
    {"failures_per_hour": -0.1, "job_hours": 10},
    {"failures_per_hour": 0.1, "job_hours": -10},
    {"failures_per_hour": 1e300, "job_hours": 1e300},
    {"mtbf_hours": 0, "job_hours": 10},
    {"mtbf_hours": -5, "job_hours": 10},
    {"mtbf_hours": 1e-320, "job_hours": 1e300},
    {"expected_restores": 1, "fallback_bits": 9},
    {"expected_restores": 1, "fallback_bits": 0},
    {"expected_restores": 1, "fallback_bits": 4},  # the table's 4-bit row is not below it
    {"expected_restores": 1, "fallback_bits": 8.0},
    {"expected_restores": 1, "table": [(1, 2), (1, 3)]},  # bounds not strictly increasing
    {"expected_restores": 1, "table": [(1, 3), (2, 2)]},  # bits decreasing
    {"expected_restores": 1, "table": [(1, 3), (2, 3)]},
    {"expected_restores": 1, "table": [(1, 2, 3)]},
    {"expected_restores": 1, "table": [(1, 0)]},
    {"expected_restores": 1, "table": [(-1, 2)]},
    {"expected_restores": 1, "table": [(math.nan, 2)]},
    {"expected_restores": 1, "table": [(1, 2.5)]},
    {"expected_restores": 1, "table": 5},
    {"expected_restores": 1, "table": [5]},
    {"expected_restores": 1, "adaptive": "yes"},
])
def test_bad_parameters_raise_invalid_argument(kwargs):
    with pytest.raises(InvalidArgument):
        BitWidthPolicy(**kwargs)


def test_positional_arguments_refused():
    with pytest.raises(TypeError):
        BitWidthPolicy(3)  # which of the three sources? keywords only


restores = st.floats(0, 1e4, allow_nan=False)
@st.composite
def tables(draw):
    """Valid tables: strictly increasing bounds paired with strictly increasing bits below 8."""
    bits = sorted(draw(st.sets(st.integers(1, 7), max_size=5)))
    bounds = sorted(draw(st.sets(st.floats(0, 1e3, allow_nan=False), min_size=len(bits), max_size=len(bits))))
    return list(zip(bounds, bits))


@settings(max_examples=100, deadline=None)
@given(a=restores, b=restores, table=st.one_of(st.just(list(PAPER_TABLE)), tables()))
def test_bits_monotone_in_expected_restores(a, b, table):
    lo, hi = sorted((a, b))
    p_lo = BitWidthPolicy(expected_restores=lo, table=table)
    p_hi = BitWidthPolicy(expected_restores=hi, table=table)
    assert p_lo.bits <= p_hi.bits
    assert p_lo.bits in {bits for _, bits in table} | {8}


@settings(max_examples=60, deadline=None)
@given(expected=restores, n=st.integers(0, 40))
def test_fallback_exactly_when_restores_exceed_estimate(expected, n):
    p = BitWidthPolicy(expected_restores=expected)
    planned = p.bits
    seen = []
    for _ in range(n):
        seen.append(p.record_restore())
    assert p.restores == n
    assert p.fallen_back == (n > expected)
    assert p.bits == (8 if n > expected else planned)
    assert seen == sorted(seen)  # never goes back down
