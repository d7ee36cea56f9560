"""
lab/equivalence.py's analysis on rows made by hand: the pairs keyed by seed, no verdict before the
rule's seeds are in, and the rows it refuses. No runs; well under a second.

    .venv/bin/python -m pytest -q tests/test_equivalence.py
"""

import pytest

from lab import equivalence as eq

PILOT = dict(kind="pilot", budget=100.0, commit="abc1234")


def pair(name, seed, stale, recompute, processor="AMD", commit="abc1234", budget=100.0):
    run = lambda acc: dict(at_steps=acc, at_time=acc, steps_by_time=60, stale=0.3, lag=1.0, lag_max=2, kl=1e-3)
    return dict(
        kind="pair",
        comparison=name,
        seed=seed,
        stale=run(stale),
        recompute=run(recompute),
        processor=processor,
        commit=commit,
        budget=budget,
    )


def test_the_primary_pairs_seeds_by_number_not_by_position():
    """Seed 1 missing from tis-eta2 only. By hand: the seeds all four have are 0 and 2; seed 0's
    differences are 1, 2, 3, 4 points (mean 2.5), seed 2's 10, 20, 30, 40 (mean 25). Paired by list
    position, seed 2 of tis-eta2 (10) would be averaged with seed 1 of the others (-1, -1, -1)."""
    d = {0: (1, 2, 3, 4), 1: (None, -1, -1, -1), 2: (10, 20, 30, 40)}
    lines = [PILOT] + [
        pair(name, seed, 0.5 + x / 100, 0.5) for seed, xs in d.items() for name, x in zip(eq.TEST, xs) if x is not None
    ]
    cells = eq.differences(eq.parse(lines)["pairs"], eq.TEST, 3)
    assert cells["tis-eta2", "at_steps"].keys() == {0, 2}
    primary = eq.pooled_primary(cells)
    assert primary.keys() == {0, 2}
    assert primary[0] == pytest.approx(2.5) and primary[2] == pytest.approx(25.0)


def full(n, shift=0.0, processor=lambda s: "AMD"):
    """n seeds of every comparison: stale - recompute = shift + (1, -1, 1, -1, ...) points."""
    return [PILOT] + [
        pair(name, s, 0.5 + (shift + (1 if s % 2 else -1)) / 100, 0.5, processor(s))
        for s in range(n)
        for name in eq.COMPARISONS
    ]


def test_no_verdict_before_every_comparison_has_the_rules_seeds():
    lines = full(20)[:-1]  # the control's seed 19 not in
    table = eq.results_table(eq.parse(lines))
    assert table.startswith("19 of 20 seeds in") and "equivalent" not in table and "+-" not in table
    assert eq.measured_table(eq.parse(lines)) == table
    assert eq.results_table(eq.parse(full(9))).startswith("9 of 20 seeds in")


def test_the_verdicts_once_in():
    """d = +-1 around 0 over 20 seeds: sd = sqrt(20/19), se = 0.2294, the 90% interval
    t(0.95, 19) = 1.7291: [-0.40, +0.40] inside +-2: equivalent, all 8; the primary the same.
    Shifted by -5 points, the corrected interval (99.375%, t(0.996875, 19) = 3.0738) is -5 +- 0.71: a cost."""
    table = eq.results_table(eq.parse(full(20)))
    assert "| `tis` | 2 | 6e-05 | after 60 steps | 20 | +0.00 | [-0.40, +0.40] |" in table
    assert "Equivalent in all 8 at once: yes (8 of 8)." in table
    assert "Primary (after 60 steps, each seed's difference averaged over the 4 comparisons, 20 seeds): +0.00" in table
    cost = eq.results_table(eq.parse(full(20, shift=-5)))
    assert "99.38% [-5.71, -4.29] | a cost of 5.0 points |" in cost and "all 8 at once: no (0 of 8)" in cost
    mixed = eq.results_table(eq.parse(full(20, processor=lambda s: "AMD" if s < 12 else "Intel")))
    assert "Processors (pairs): AMD 60, Intel 40." in mixed and "on the AMD pairs alone (12 seeds)" in mixed


@pytest.mark.parametrize(
    "bad, said",
    [
        (pair("tis-eta2", 0, 0.5, 0.5), "two rows for tis-eta2 seed 0"),
        (pair("tis-eta2", 25, 0.5, 0.5, commit="def5678"), "made at def5678"),
        (pair("tis-eta2", 25, 0.5, 0.5, budget=99.0), "T 99.0"),
        (dict(PILOT), "2 pilot rows"),
    ],
)
def test_rows_the_analysis_refuses(bad, said):
    with pytest.raises(SystemExit, match=said):
        eq.parse(full(20) + [bad])
