"""CheckpointInterval: Young's and Daly's rules for full recovery (against hand-computed values and
Daly's published examples), CPR's rule for partial recovery, the expected-overhead model, the measured
costs fed in by observe_*, the failure-rate forms, monotonicity, and parameter validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from cnrstore.errors import InvalidArgument
from cnrstore.policy import BitWidthPolicy, CheckpointInterval, Overhead
from cnrstore.policy.interval import daly_interval, partial_interval, young_interval

HOUR, MINUTE = 3600.0, 60.0


def daly_wall_time(tau, save, mtbf, restart=0.0):
    """Daly's complete model of expected wall-clock time per unit of solve time (Poisson failures)."""
    return mtbf * math.exp(restart / mtbf) * (math.exp((tau + save) / mtbf) - 1.0) / tau


def numeric_optimum(f, lo, hi, iters=200):
    """Golden-section minimum of a unimodal f on [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    for _ in range(iters):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if f(a) < f(b):
            hi = b
        else:
            lo = a
    return (lo + hi) / 2


# -- the rules against hand-computed values ------------------------------------------------------------

def test_young_hand_computed():
    # sqrt(2 * 50 * 10000) = sqrt(1e6) = 1000
    p = CheckpointInterval(10_000, 50, full_rule="young")
    assert p.interval_s() == pytest.approx(1000.0)
    assert young_interval(60, 86_400) == pytest.approx(3219.937887)  # sqrt(10_368_000)
    assert p.interval_steps(0.5) == 2000 and p.interval_steps(3) == 333  # rounded down


def test_daly_hand_computed():
    # delta/2M = 0.0025, sqrt = 0.05: 1000 * (1 + 0.05/3 + 0.0025/9) - 50 = 966.9444...
    p = CheckpointInterval(10_000, 50)
    assert p.full_rule == "daly" and p.recovery == "full"
    assert p.interval_s() == pytest.approx(1000 * (1 + 0.05 / 3 + 0.0025 / 9) - 50)
    assert p.interval_s() == pytest.approx(966.9444, abs=1e-4)


@pytest.mark.parametrize("mtbf_min,expected_min,tol", [(24 * 60, 117, 0.5), (6 * 60, 57, 0.5), (15, 9.1, 0.05)])
def test_daly_reproduces_the_papers_examples(mtbf_min, expected_min, tol):
    # Daly 2006, figures 3-5: delta = 5 min, R = 10 min; the restart cost does not move the optimum.
    p = CheckpointInterval(mtbf_min * MINUTE, 5 * MINUTE, 10 * MINUTE)
    assert p.interval_s() / MINUTE == pytest.approx(expected_min, abs=tol)
    assert CheckpointInterval(mtbf_min * MINUTE, 5 * MINUTE, 0).interval_s() == p.interval_s()


def test_daly_caps_at_mtbf_when_saves_cost_more_than_two_mtbf():
    assert daly_interval(200, 100) == 100 and daly_interval(1e6, 100) == 100
    assert daly_interval(199.999, 100) < 100  # just below the switch the series applies
    assert CheckpointInterval(100, 300).interval_s() == 100
    assert CheckpointInterval(100, 300, full_rule="young").interval_s() == pytest.approx(math.sqrt(60_000))


def test_partial_hand_computed():
    # 2 * 0.01 * 86400 * 8 = 13824 s, whatever the save cost
    p = CheckpointInterval(86_400, 60, recovery="partial", shards=8, max_lost_fraction=0.01)
    assert p.interval_s() == pytest.approx(13_824.0)
    assert CheckpointInterval(86_400, 1, recovery="partial", shards=8, max_lost_fraction=0.01).interval_s() \
        == p.interval_s()
    assert partial_interval(0.05, 1000, 1) == pytest.approx(100.0)
    assert p.expected_overhead().lost_updates == pytest.approx(0.01)  # the target, at its own interval
    assert p.interval_steps(1.0) == 13_824


def test_partial_is_longer_than_full_when_failures_are_rare():
    kw = dict(recovery="partial", shards=4, max_lost_fraction=0.01)
    # full ~ sqrt(2 delta M) grows as sqrt(M), partial 2 PLS N M linearly: they cross at M = delta / (2 PLS^2 N^2)
    crossing = 30 / (2 * 0.01**2 * 4**2)  # 9375 s for delta = 30 s
    for mtbf in (2 * crossing, 14 * HOUR, 30 * HOUR):
        assert CheckpointInterval(mtbf, 30, **kw).interval_s() > CheckpointInterval(mtbf, 30).interval_s()
        assert CheckpointInterval(mtbf, 30, **kw).interval_s() > CheckpointInterval(
            mtbf, 30, full_rule="young").interval_s()
    # frequent failures: the PLS target forces partial recovery to checkpoint more often than full would
    assert CheckpointInterval(crossing / 4, 30, **kw).interval_s() < CheckpointInterval(
        crossing / 4, 30, full_rule="young").interval_s()


# -- the expected-overhead model ------------------------------------------------------------------------

def test_expected_overhead_full_hand_computed():
    p = CheckpointInterval(10_000, 50, 100, full_rule="young")  # tau = 1000
    o = p.expected_overhead()
    assert isinstance(o, Overhead)
    assert o.interval_s == pytest.approx(1000)
    assert o.save == pytest.approx(0.05)        # 50 / 1000
    assert o.restore == pytest.approx(0.01)     # 100 / 10000
    assert o.recompute == pytest.approx(0.05)   # 500 / 10000
    assert o.total == pytest.approx(0.11) and o.lost_updates == 0
    o2 = p.expected_overhead(interval_s=500)
    assert (o2.save, o2.recompute, o2.total) == pytest.approx((0.1, 0.025, 0.135))
    assert set(o.as_dict()) == {"interval_s", "save", "restore", "recompute", "total", "lost_updates"}


def test_expected_overhead_partial_hand_computed():
    p = CheckpointInterval(10_000, 50, 20, recovery="partial", shards=4, max_lost_fraction=0.02)  # tau = 1600
    o = p.expected_overhead()
    assert o.interval_s == pytest.approx(1600)
    assert o.save == pytest.approx(50 / 1600) and o.restore == pytest.approx(0.002)
    assert o.recompute == 0 and o.total == pytest.approx(50 / 1600 + 0.002)
    assert o.lost_updates == pytest.approx(0.02)  # 1600 / (2 * 10000 * 4)
    assert p.expected_overhead(800).lost_updates == pytest.approx(0.01)


def test_young_minimizes_the_first_order_overhead():
    p = CheckpointInterval(50_000, 40, 300, full_rule="young")
    best = p.expected_overhead().total
    for k in (0.5, 0.8, 0.95, 1.05, 1.25, 2):
        assert p.expected_overhead(p.interval_s() * k).total > best


@pytest.mark.parametrize("save,mtbf", [(5, 1440), (5, 360), (5, 15), (60, 86_400), (1, 1), (0.5, 1), (10, 3)])
def test_daly_is_near_the_optimum_of_his_complete_model(save, mtbf):
    opt = numeric_optimum(lambda t: daly_wall_time(t, save, mtbf), 1e-6 * mtbf, 50 * mtbf)
    best = daly_wall_time(opt, save, mtbf)
    daly = daly_wall_time(daly_interval(save, mtbf), save, mtbf)
    young = daly_wall_time(young_interval(save, mtbf), save, mtbf)
    assert daly <= best * (1 + 2e-4)   # within 0.02% of the optimal run time everywhere
    assert daly <= young * (1 + 1e-12)  # and never worse than Young's
    if save >= mtbf / 10:
        assert young > best * 1.02  # Young's is measurably off when saves are expensive


# -- measured costs --------------------------------------------------------------------------------------

def test_observe_save_first_replaces_then_averages():
    p = CheckpointInterval(10_000, 50, full_rule="young", smoothing=0.5)
    assert p.saves_observed == 0
    assert p.observe_save(8) == pytest.approx(math.sqrt(2 * 8 * 10_000))  # the estimate is replaced
    assert p.save_cost_s == 8 and p.saves_observed == 1
    p.observe_save(12)
    assert p.save_cost_s == pytest.approx(10)  # 0.5 * 8 + 0.5 * 12
    p.observe_save(2)
    assert p.save_cost_s == pytest.approx(6)
    assert p.interval_s() == pytest.approx(math.sqrt(2 * 6 * 10_000))
    q = CheckpointInterval(10_000, 50, smoothing=1.0)
    for s in (3, 30, 7):
        q.observe_save(s)
    assert q.save_cost_s == 7  # smoothing 1 keeps only the latest


def test_observe_save_moves_full_but_not_partial_interval():
    full = CheckpointInterval(10_000, 50)
    partial = CheckpointInterval(10_000, 50, recovery="partial", shards=2, max_lost_fraction=0.05)
    before_full, before_partial = full.interval_s(), partial.interval_s()
    assert full.observe_save(200) > before_full
    assert partial.observe_save(200) == before_partial
    assert partial.expected_overhead().save == pytest.approx(200 / before_partial)


def test_observe_restore_updates_cost_but_not_interval():
    p = CheckpointInterval(10_000, 50, 100, smoothing=0.25)
    before = p.interval_s()
    assert p.observe_restore(40) == before
    assert p.restore_cost_s == 40 and p.restores_observed == 1
    p.observe_restore(80)
    assert p.restore_cost_s == pytest.approx(50)  # 0.75 * 40 + 0.25 * 80
    assert p.expected_overhead().restore == pytest.approx(50 / 10_000)
    p.observe_restore(0)
    assert p.restore_cost_s == pytest.approx(37.5)


def test_state_dict_carries_measurements():
    p = CheckpointInterval(10_000, 50, 100)
    p.observe_save(10)
    p.observe_restore(30)
    state = p.state_dict()
    assert state == {"save_cost_s": 10.0, "restore_cost_s": 30.0, "saves_observed": 1, "restores_observed": 1}
    q = CheckpointInterval(10_000, 50, 100)  # the restarted job, constructed with the old estimates
    q.load_state_dict(state)
    assert q.interval_s() == p.interval_s()
    q.observe_save(20)  # averages with the carried measurement instead of replacing it
    assert q.save_cost_s == pytest.approx(0.75 * 10 + 0.25 * 20)
    for bad in [None, {}, {**state, "save_cost_s": 0}, {**state, "restore_cost_s": -1},
                {**state, "saves_observed": -1}, {**state, "restores_observed": 1.5},
                {**state, "saves_observed": True}]:
        with pytest.raises(InvalidArgument):
            q.load_state_dict(bad)


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", True, None])
def test_observe_save_rejects_bad_timings(bad):
    p = CheckpointInterval(10_000, 50)
    with pytest.raises(InvalidArgument):
        p.observe_save(bad)
    assert p.save_cost_s == 50 and p.saves_observed == 0


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, "5", False])
def test_observe_restore_rejects_bad_timings(bad):
    p = CheckpointInterval(10_000, 50, 7)
    with pytest.raises(InvalidArgument):
        p.observe_restore(bad)
    assert p.restore_cost_s == 7 and p.restores_observed == 0


# -- failure-rate forms -----------------------------------------------------------------------------------

def test_failure_rate_forms_agree():
    a = CheckpointInterval.from_failure_rate(0.05, 30, 60)  # MTBF 20 h
    b = CheckpointInterval.from_mtbf_hours(20, 30, 60)
    c = CheckpointInterval.from_expected_failures(5, 100, 30, 60)  # 5 failures over 100 h
    d = CheckpointInterval(20 * HOUR, 30, 60)
    for p in (a, b, c):
        assert p.mtbf_s == pytest.approx(d.mtbf_s) and p.interval_s() == pytest.approx(d.interval_s())
    e = CheckpointInterval.from_mtbf_hours(14, 30, recovery="partial", shards=8, max_lost_fraction=0.01)
    assert e.interval_s() == pytest.approx(2 * 0.01 * 14 * HOUR * 8)
    assert d.expected_failures(100) == pytest.approx(5)
    assert BitWidthPolicy(expected_restores=d.expected_failures(100)).bits == \
        BitWidthPolicy(mtbf_hours=20, job_hours=100).bits == 8


# -- monotonicity --------------------------------------------------------------------------------------

seconds = st.floats(1e-2, 1e7, allow_nan=False)
fractions = st.floats(1e-6, 0.99, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(m1=seconds, m2=seconds, s1=seconds, s2=seconds, rule=st.sampled_from(["daly", "young"]))
def test_full_interval_monotone_in_mtbf_and_save_cost(m1, m2, s1, s2, rule):
    (m_lo, m_hi), (s_lo, s_hi) = sorted((m1, m2)), sorted((s1, s2))
    i = lambda m, s: CheckpointInterval(m, s, full_rule=rule).interval_s()  # noqa: E731
    assert i(m_lo, s_lo) <= i(m_hi, s_lo) * (1 + 1e-12)
    assert i(m_lo, s_lo) <= i(m_lo, s_hi) * (1 + 1e-12)
    assert 0 < i(m_lo, s_lo) and math.isfinite(i(m_hi, s_hi))


@settings(max_examples=100, deadline=None)
@given(m1=seconds, m2=seconds, n1=st.integers(1, 512), n2=st.integers(1, 512), f1=fractions, f2=fractions)
def test_partial_interval_monotone_in_mtbf_shards_and_target(m1, m2, n1, n2, f1, f2):
    (m_lo, m_hi), (n_lo, n_hi), (f_lo, f_hi) = sorted((m1, m2)), sorted((n1, n2)), sorted((f1, f2))

    def i(m, n, f):
        return CheckpointInterval(m, 1, recovery="partial", shards=n, max_lost_fraction=f).interval_s()

    base = i(m_lo, n_lo, f_lo)
    assert base <= i(m_hi, n_lo, f_lo) and base <= i(m_lo, n_hi, f_lo) and base <= i(m_lo, n_lo, f_hi)
    p = CheckpointInterval(m_lo, 1, recovery="partial", shards=n_lo, max_lost_fraction=f_lo)
    assert p.expected_overhead().lost_updates == pytest.approx(f_lo)


@settings(max_examples=100, deadline=None)
@given(m=seconds, s=seconds, n=st.integers(1, 64), f=fractions)
def test_partial_beats_full_interval_past_the_crossing(m, s, n, f):
    # partial 2fnM > sqrt(2sM) (Young's, and Daly's below it) exactly when M > s / (2 f^2 n^2)
    assume(m > 1.01 * s / (2 * f * f * n * n))
    partial = CheckpointInterval(m, s, recovery="partial", shards=n, max_lost_fraction=f).interval_s()
    assert partial > CheckpointInterval(m, s, full_rule="young").interval_s()
    assert partial > CheckpointInterval(m, s).interval_s()


@settings(max_examples=100, deadline=None)
@given(m=seconds, s=seconds, r=st.floats(0, 1e5), t1=seconds, t2=seconds)
def test_overhead_terms_move_the_right_way_with_the_interval(m, s, r, t1, t2):
    lo, hi = sorted((t1, t2))
    assume(lo < hi)
    full = CheckpointInterval(m, s, r)
    a, b = full.expected_overhead(lo), full.expected_overhead(hi)
    assert a.save >= b.save and a.recompute <= b.recompute and a.restore == b.restore
    part = CheckpointInterval(m, s, r, recovery="partial", shards=3, max_lost_fraction=0.1)
    a, b = part.expected_overhead(lo), part.expected_overhead(hi)
    assert a.lost_updates <= b.lost_updates and a.recompute == b.recompute == 0
    assert a.total == pytest.approx(a.save + a.restore)


@settings(max_examples=60, deadline=None)
@given(m=seconds, s=seconds, step=st.floats(1e-4, 1e4))
@example(m=15.0, s=1.0, step=0.0001)    # 0.6 / 1e-4 is 5999.99... in floats; 6000 steps fit exactly
def test_interval_steps_never_exceed_the_interval(m, s, step):
    p = CheckpointInterval(m, s, recovery="partial", shards=2, max_lost_fraction=0.01)
    n = p.interval_steps(step)
    assert n >= 1
    assert n == 1 or n * step <= p.interval_s() * (1 + 1e-12)
    assert (n + 1) * step > p.interval_s()


# -- validation ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,kwargs", [
    ((0, 10), {}),
    ((-1, 10), {}),
    ((math.inf, 10), {}),
    ((math.nan, 10), {}),
    (("100", 10), {}),
    ((True, 10), {}),
    ((100, 0), {}),
    ((100, -5), {}),
    ((100, math.inf), {}),
    ((100, None), {}),
    ((100, 10, -1), {}),
    ((100, 10, math.nan), {}),
    ((100, 10), {"recovery": "fast"}),
    ((100, 10), {"recovery": None}),
    ((100, 10), {"full_rule": "young-daly"}),
    ((100, 10), {"shards": 0}),
    ((100, 10), {"shards": 2.0}),
    ((100, 10), {"shards": True}),
    ((100, 10), {"max_lost_fraction": 0.01}),  # full recovery loses no updates
    ((100, 10), {"recovery": "partial"}),  # needs a target
    ((100, 10), {"recovery": "partial", "max_lost_fraction": 0}),
    ((100, 10), {"recovery": "partial", "max_lost_fraction": 1}),
    ((100, 10), {"recovery": "partial", "max_lost_fraction": -0.1}),
    ((100, 10), {"recovery": "partial", "max_lost_fraction": math.nan}),
    ((100, 10), {"recovery": "partial", "max_lost_fraction": "0.1"}),
    ((100, 10), {"smoothing": 0}),
    ((100, 10), {"smoothing": 1.5}),
    ((100, 10), {"smoothing": math.nan}),
    ((100, 10), {"smoothing": True}),
])
def test_bad_parameters_raise_invalid_argument(args, kwargs):
    with pytest.raises(InvalidArgument):
        CheckpointInterval(*args, **kwargs)


def test_error_messages_say_what_to_pass():
    with pytest.raises(InvalidArgument, match="max_lost_fraction"):
        CheckpointInterval(100, 10, recovery="partial")
    with pytest.raises(InvalidArgument, match="recovery='partial'"):
        CheckpointInterval(100, 10, max_lost_fraction=0.1)
    with pytest.raises(InvalidArgument, match="mtbf_s must be a finite number > 0"):
        CheckpointInterval(0, 10)


@pytest.mark.parametrize("call", [
    lambda: CheckpointInterval.from_failure_rate(0, 10),
    lambda: CheckpointInterval.from_failure_rate(-1, 10),
    lambda: CheckpointInterval.from_failure_rate(1e-320, 10),  # MTBF overflows
    lambda: CheckpointInterval.from_mtbf_hours(0, 10),
    lambda: CheckpointInterval.from_mtbf_hours(1e307, 10),
    lambda: CheckpointInterval.from_expected_failures(0, 10, 10),
    lambda: CheckpointInterval.from_expected_failures(1, 0, 10),
    lambda: CheckpointInterval.from_expected_failures(1e-320, 1e300, 10),
    lambda: CheckpointInterval.from_failure_rate(0.1, 0),
    lambda: CheckpointInterval(100, 10).interval_steps(0),
    lambda: CheckpointInterval(100, 10).interval_steps(-1),
    lambda: CheckpointInterval(100, 10).interval_steps(math.inf),
    lambda: CheckpointInterval(100, 10).expected_overhead(0),
    lambda: CheckpointInterval(100, 10).expected_overhead(-3),
    lambda: CheckpointInterval(100, 10).expected_failures(-1),
])
def test_bad_calls_raise_invalid_argument(call):
    with pytest.raises(InvalidArgument):
        call()


def test_repr_names_mode_and_interval():
    assert "full, rule=daly" in repr(CheckpointInterval(10_000, 50))
    r = repr(CheckpointInterval(10_000, 50, recovery="partial", shards=4, max_lost_fraction=0.02))
    assert "partial, shards=4, max_lost_fraction=0.02" in r and "interval_s=1600" in r
