"""Study statistics against hand-worked numbers, textbook examples, exact enumerations and scipy."""

import itertools

import numpy as np
import pytest
import scipy.stats

from polykv.errors import StudyError
from polykv.studies import stats
from polykv.profiling import stats as paired_stats


# -- Wilson ---------------------------------------------------------------------------------------
# Newcombe (1998), "Two-sided confidence intervals for the single proportion", Statistics in Medicine
# 17:857-872, Table II, method 3 (score interval without continuity correction).
@pytest.mark.parametrize("k,n,low,high", [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605),
                                          (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718), (29, 29, 0.8830, 1.0)])
def test_wilson_matches_newcombe_table(k, n, low, high):
    iv = paired_stats.wilson_interval(k, n)
    assert iv.estimate == pytest.approx(k / n)
    assert round(iv.low, 4) == pytest.approx(low, abs=1e-9)
    assert round(iv.high, 4) == pytest.approx(high, abs=1e-9)


@pytest.mark.parametrize("k,n,level", [(3, 10, 0.95), (50, 100, 0.99), (7, 1000, 0.9), (199, 200, 0.95)])
def test_wilson_matches_scipy(k, n, level):
    iv = paired_stats.wilson_interval(k, n, level)
    ref = scipy.stats.binomtest(k, n).proportion_ci(confidence_level=level, method="wilson")
    assert (iv.low, iv.high) == pytest.approx((ref.low, ref.high), abs=1e-12)


def test_wilson_rejects_bad_counts():
    with pytest.raises(StudyError, match="successes"):
        paired_stats.wilson_interval(5, 4)
    with pytest.raises(StudyError, match="level"):
        paired_stats.wilson_interval(1, 4, level=1.5)


# -- bootstrap ------------------------------------------------------------------------------------
def test_bootstrap_matches_exact_bootstrap_distribution():
    # n = 6: all 6^6 equally likely resamples enumerated give the exact bootstrap distribution.
    x = np.array([0.3, 1.1, 2.9, 4.2, 7.5, 10.0])
    exact = np.array([x[list(idx)].mean() for idx in itertools.product(range(6), repeat=6)])
    lo, hi = np.quantile(exact, [0.025, 0.975])
    iv = paired_stats.bootstrap_mean(x, seed=3)
    assert iv.estimate == pytest.approx(x.mean())
    assert iv.low == pytest.approx(lo, abs=0.15)
    assert iv.high == pytest.approx(hi, abs=0.15)
    assert iv.replicates == 10_000


def test_paired_bootstrap_matches_scipy_and_normal_theory():
    rng = np.random.default_rng(7)
    base = rng.normal(size=400)
    a = base + rng.normal(0.15, 0.5, size=400)
    b = base
    iv = paired_stats.paired_bootstrap(a, b, seed=1)
    ref = scipy.stats.bootstrap((a, b), lambda u, v, axis=-1: np.mean(u - v, axis=axis), paired=True,
                                method="percentile", n_resamples=10_000, random_state=2).confidence_interval
    d = a - b
    half = 1.959964 * d.std(ddof=1) / np.sqrt(d.size)
    assert iv.estimate == pytest.approx(d.mean())
    assert iv.low == pytest.approx(ref.low, abs=0.01) and iv.high == pytest.approx(ref.high, abs=0.01)
    assert iv.low == pytest.approx(d.mean() - half, abs=0.01) and iv.high == pytest.approx(d.mean() + half, abs=0.01)
    assert iv.excludes_zero() and iv.p_value < 0.01


def test_pairing_narrows_the_interval():
    # Items vary far more than policies: resampling pairs keeps the shared item effect out of the interval.
    rng = np.random.default_rng(0)
    item = rng.normal(0, 5, size=200)
    a, b = item + 0.2 + rng.normal(0, 0.1, 200), item + rng.normal(0, 0.1, 200)
    paired = paired_stats.paired_bootstrap(a, b)
    assert paired.high - paired.low < 0.1
    assert paired.low > 0.1


def test_bootstrap_is_seeded_and_collapses_on_constant_differences():
    rng = np.random.default_rng(1)
    a, b = rng.random(50), rng.random(50)
    assert paired_stats.paired_bootstrap(a, b, seed=5) == paired_stats.paired_bootstrap(a, b, seed=5)
    assert paired_stats.paired_bootstrap(a, b, seed=5).low != paired_stats.paired_bootstrap(a, b, seed=6).low
    iv = paired_stats.paired_bootstrap(b + 0.25, b)
    assert (iv.low, iv.estimate, iv.high) == pytest.approx((0.25, 0.25, 0.25))
    assert iv.p_value == 0.0


def test_paired_bootstrap_rejects_unpaired_input():
    with pytest.raises(StudyError, match="same items"):
        paired_stats.paired_bootstrap([1, 0, 1], [1, 0])
    with pytest.raises(StudyError, match="NaN"):
        paired_stats.paired_bootstrap([1, float("nan")], [1, 0])


def test_task_bootstrap_by_hand():
    # Two tasks with differences 0.0 and 0.5: a resample of tasks has mean 0 (p=1/4), 0.25 (1/2) or 0.5 (1/4).
    a = {"passkey": [1, 1, 0, 1], "niah": 0.9}   # task means 0.75 and 0.9
    b = {"passkey": [1, 0, 1, 1], "niah": 0.4}   # task means 0.75 and 0.4
    iv = paired_stats.paired_bootstrap_tasks(a, b, seed=0)
    assert iv.estimate == pytest.approx(0.25)
    assert (iv.low, iv.high) == pytest.approx((0.0, 0.5))
    assert iv.n == 2
    with pytest.raises(StudyError, match="only in a"):
        paired_stats.paired_bootstrap_tasks({"x": 1.0, "y": 1.0}, {"x": 1.0})


# -- correlation ----------------------------------------------------------------------------------
IQ = [106, 100, 86, 101, 99, 103, 97, 113, 112, 110]
TV = [7, 27, 2, 50, 28, 29, 20, 12, 6, 17]


def test_spearman_textbook_example():
    # The worked example of Wikipedia's "Spearman's rank correlation coefficient": rho = -29/165.
    c = paired_stats.spearman(IQ, TV)
    assert c.r == pytest.approx(-29 / 165, abs=1e-12)
    assert c.p_value == pytest.approx(0.627, abs=0.03)


def _exact_permutation_p(x, y, fn):
    r = fn(x, y)
    null = np.array([fn(x, [y[i] for i in perm]) for perm in itertools.permutations(range(len(y)))])
    return float(np.mean(np.abs(null) >= abs(r) - 1e-12))


def test_permutation_p_values_match_exact_enumeration():
    x = [3.1, 0.4, 2.2, 5.0, 4.4, 1.3, 2.9]
    y = [2.0, 0.9, 1.1, 3.7, 4.0, 1.2, 1.0]
    rho = lambda u, v: scipy.stats.spearmanr(u, v).statistic  # noqa: E731
    r = lambda u, v: np.corrcoef(u, v)[0, 1]  # noqa: E731
    s, p = paired_stats.spearman(x, y, seed=11), paired_stats.pearson(x, y, seed=11)
    assert s.r == pytest.approx(rho(x, y)) and p.r == pytest.approx(r(x, y))
    assert s.p_value == pytest.approx(_exact_permutation_p(x, y, rho), abs=0.01)
    assert p.p_value == pytest.approx(_exact_permutation_p(x, y, r), abs=0.01)


def test_spearman_with_ties_matches_scipy_and_alternatives_split():
    x = [1, 2, 2, 3, 4, 4, 4, 5, 6, 7]
    y = [2, 1, 4, 3, 3, 6, 5, 8, 7, 9]
    c = paired_stats.spearman(x, y)
    assert c.r == pytest.approx(scipy.stats.spearmanr(x, y).statistic, abs=1e-12)
    assert np.array_equal(paired_stats.rankdata(x), scipy.stats.rankdata(x))
    greater, less = paired_stats.spearman(x, y, alternative="greater"), paired_stats.spearman(x, y, alternative="less")
    assert greater.p_value < 0.01 < 0.99 < less.p_value


def test_correlation_errors():
    with pytest.raises(StudyError, match="constant"):
        paired_stats.pearson([1, 1, 1, 1], [1, 2, 3, 4])
    with pytest.raises(StudyError, match="at least 3"):
        paired_stats.spearman([1, 2], [2, 1])


# -- placement control ----------------------------------------------------------------------------
def test_placement_control_by_hand():
    pc = stats.placement_control(0.5, [0.1, 0.6, 0.5, 0.2])
    assert (pc.rank, pc.total, pc.p_value) == (3, 5, pytest.approx(3 / 5))
    # PolyKV's report: the guided route ranked 2/100 -> p = 2/100.
    pc = stats.placement_control(41.0, [40.0] * 98 + [42.0])
    assert (pc.rank, pc.total, pc.p_value) == (2, 100, pytest.approx(0.02))
    # Lower is better (perplexity): only the 9.0 is at least as good as 10.0.
    pc = stats.placement_control(10.0, [12.0, 9.0, 11.0], higher_is_better=False)
    assert (pc.rank, pc.p_value) == (2, pytest.approx(0.5))


def test_random_placements_are_unique_count_matched_and_exclude_the_guided_route():
    guided = ("snapkv",) * 6 + ("tova",) * 4
    out = stats.random_placements({"snapkv": 6, "tova": 4}, 99, seed=0, exclude=[guided])
    assert len(out) == len(set(out)) == 99
    assert guided not in out
    assert all(p.count("snapkv") == 6 and p.count("tova") == 4 for p in out)
    assert out == stats.random_placements({"snapkv": 6, "tova": 4}, 99, seed=0, exclude=[guided])
    with pytest.raises(StudyError, match="only 2 placements are left"):
        stats.random_placements({"a": 2, "b": 1}, 3, exclude=[("a", "a", "b")])


# -- study summaries ------------------------------------------------------------------------------
def test_moend_ablation_chain_by_hand():
    scores = {"2d_uniform": [0, 1, 0, 1], "2d": [1, 1, 0, 1], "2d_hetero": [1, 1, 1, 1], "1d": [0, 0, 0, 1]}
    out = stats.moend_ablation(scores)
    assert out["d_quant"].estimate == pytest.approx(0.25)
    assert out["d_evict"].estimate == pytest.approx(0.25)
    assert out["d_total"].estimate == pytest.approx(out["d_quant"].estimate + out["d_evict"].estimate)
    assert out["hetero_vs_1d"].estimate == pytest.approx(0.75)
    assert "hetero_vs_full" not in out
    # Differences are 0 or 1 with one 1 in four items: the interval spans [0, 0.75].
    assert (out["d_quant"].low, out["d_quant"].high) == pytest.approx((0.0, 0.75))
    with pytest.raises(StudyError, match="2d_hetero"):
        stats.moend_ablation({"2d_uniform": [1], "2d": [1]})


def test_polykv_factorial_by_hand():
    x = np.linspace(0.2, 0.6, 12)
    scores = {"homogeneous_uniform": x, "homogeneous_allocated": x + 0.1, "routed_uniform": x + 0.2,
              "routed_allocated": x + 0.35}
    out = stats.polykv_factorial(scores)
    expect = {"route_only": 0.2, "allocation_only": 0.1, "joint": 0.35, "routing": 0.225, "allocation": 0.125,
              "interaction": 0.05}
    for name, value in expect.items():
        assert (out[name].low, out[name].estimate, out[name].high) == pytest.approx((value,) * 3), name
    assert out["mean:routed_allocated"].estimate == pytest.approx(x.mean() + 0.35)
    with pytest.raises(StudyError, match="routed_allocated"):
        stats.polykv_factorial({k: v for k, v in scores.items() if k != "routed_allocated"})


# -- when an interval can support a claim ---------------------------------------------------------------
def test_the_fewest_items_that_can_show_a_difference_follow_the_sign_test():
    """2 * 0.5**n <= 1 - level: 6 items at 95% (p = 0.031; 5 give 0.0625), 8 at 99%."""
    assert paired_stats.min_units_for_difference(0.95) == 6
    assert paired_stats.min_units_for_difference(0.99) == 8
    assert paired_stats.min_units_for_difference(0.5) == 2
    with pytest.raises(StudyError, match="level"):
        paired_stats.min_units_for_difference(1.0)


def test_one_item_never_shows_a_difference():
    """``polykv demo --samples 1``: one item that fails gives [-1, -1]; that claims nothing."""
    iv = paired_stats.paired_bootstrap([0.0], [1.0], replicates=200)
    assert (iv.low, iv.high) == (-1.0, -1.0) and iv.excludes_zero()
    assert not iv.shows_difference()
    assert "too few items to tell at 95%" in iv.difference_verdict("the full cache")
    assert "at least 6" in iv.difference_verdict("the full cache")


def test_enough_disagreeing_items_show_a_difference_and_ties_do_not():
    many = paired_stats.paired_bootstrap([0.0] * 12 + [1.0] * 8, [1.0] * 20, replicates=2000)
    assert many.shows_difference()
    assert many.difference_verdict("full") == "differs from full at 95%"
    same = paired_stats.paired_bootstrap([1.0] * 20, [1.0] * 20, replicates=200)
    assert not same.excludes_zero() and not same.shows_difference()
    assert same.difference_verdict("full") == "no difference from full at 95%"
    few = paired_stats.paired_bootstrap([0.0] * 3, [1.0] * 3, replicates=200)   # all three disagree: still too few
    assert few.excludes_zero() and not few.shows_difference()
