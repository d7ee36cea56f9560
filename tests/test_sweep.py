"""
lab/sweep.py end to end, small: two regimes x one seed of 3 steps each, evaluated every
step, in a subprocess; then its tables and figures. Two train.py runs, ~30 s on 2 cores.

    .venv/bin/python -m pytest -q tests/test_sweep.py
"""

import json
import os
import re
import subprocess
import sys


def test_sweep_writes_tables_and_figures(tmp_path):
    out = str(tmp_path)
    r = subprocess.run(
        [
            sys.executable,
            "lab/sweep.py",
            "default",
            "--regimes",
            "sync",
            "stale",
            "--seeds",
            "0",
            "--out",
            out,
            "--",
            "--steps",
            "3",
            "--eval-every",
            "1",
            "--eval-n",
            "16",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    folder = os.path.join(out, "default")
    for regime in ("sync", "stale"):
        assert os.path.exists(os.path.join(folder, f"{regime}-fifo-s0", "ledger.json")), open(
            os.path.join(folder, f"{regime}-fifo-s0.log")
        ).read()[-3000:]
    for name in ("table.md", "runs.md", "acc_vs_wall.png", "time_share.png"):
        path = os.path.join(folder, name)
        assert os.path.getsize(path) > 0, path
    for name in ("acc_vs_wall.png", "time_share.png"):
        assert os.path.getsize(os.path.join(folder, name)) < 150_000
    table = open(os.path.join(folder, "table.md")).read()
    for regime in ("sync", "stale"):
        (row,) = [line for line in table.splitlines() if line.startswith(f"| {regime} |")]
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1:3] == ["fifo", "1"], row
        assert re.fullmatch(r"[01]\.\d{3}", cells[3]), row  # final eval pass@1
        assert float(cells[6]) > 0, row  # steps/min
    # no long runs: no contrast; a second call finds both runs finished and runs nothing
    assert not os.path.exists(os.path.join(out, "contrast.md"))
    r = subprocess.run(
        [sys.executable, "lab/sweep.py", "default", "--regimes", "sync", "stale", "--seeds", "0", "--out", out],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "2 of 2 runs finished already, 0 to run" in r.stdout, r.stdout + r.stderr
    # PACE's claims are against sync: a pace sweep without sync in --regimes still tables the sync runs on disk
    r = subprocess.run(
        [
            sys.executable,
            "lab/sweep.py",
            "default",
            "--regimes",
            "stale",
            "--pools",
            "fifo",
            "pace",
            "--seeds",
            "0",
            "--out",
            out,
            "--table-only",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    table = open(os.path.join(folder, "table.md")).read()
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| s")] == ["sync", "stale"]


def test_time_to_and_paired_by_hand():
    """The analysis' two measures, against numbers worked by hand: time to target on the
    3-eval smoothed curve, interpolated; a paired difference and its bootstrap interval."""
    from lab.sweep import paired, smooth, time_to

    curve = [(0, 0.40), (100, 0.46), (200, 0.52), (300, 0.58)]
    # smoothed: 0.43, 0.46, 0.52, 0.55; 0.50 is crossed between 100 s and 200 s, a third of the way
    assert [round(a, 3) for _, a in smooth(curve)] == [0.43, 0.46, 0.52, 0.55]
    assert abs(time_to(curve, 0.50) - (100 + 100 * 0.04 / 0.06)) < 1e-9
    assert time_to(curve, 0.60) is None and time_to(curve, 0.40) == 0
    rows = [
        dict(regime=reg, pool="fifo", seed=s, v=v)
        for reg, vals in (("stale", [3.0, 4.0, 5.0]), ("drain", [1.0, 1.0, 2.0, 9.0]))
        for s, v in enumerate(vals)
    ]
    mean, (lo, hi), n = paired(rows, ("stale", "fifo"), ("drain", "fifo"), lambda r: r["v"])
    assert (mean, n) == (8 / 3, 3)  # seeds 0-2: 2, 3, 3; seed 3 has no stale run
    assert lo == 2.0 and hi == 3.0  # every resample's mean lies in [2, 3] and both ends are drawn


def test_analysis_says_the_difference_as_a_share():
    """Each comparison also as a share of the second regime's mean over the paired seeds,
    worked by hand: steps/min 30, 33, 36 against 20, 22, 24 is +11 = +50% of 22."""
    from lab.sweep import analysis

    curve = [(0, 0.5), (100, 0.6)]
    rows = [
        dict(regime=reg, pool="fifo", seed=s, steps_per_min=v, acc1=0.6, curve=curve, cpu_curve=None)
        for reg, vals in (("stale", [30.0, 33.0, 36.0]), ("drain", [20.0, 22.0, 24.0]))
        for s, v in enumerate(vals)
    ]
    (row,) = [line for line in analysis(rows, None).splitlines() if line.startswith("| steps/min")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "+11.0" and cells[3].startswith("+50.0% [") and cells[4:6] == ["3", "yes"], row
    # the paired t-test beside it: differences 10, 11, 12, sd 1, t(0.975, 2) = 4.303: 11 ± 4.303 / sqrt(3)
    assert cells[6] == f"[{11 - 4.303 / 3**0.5:+.1f}, {11 + 4.303 / 3**0.5:+.1f}]" == "[+8.5, +13.5]", row


def test_pace_columns_and_claims_by_hand(tmp_path):
    """A pace sweep's tables say what PACE threw away and where it stands on its two claims,
    run by run: groups rejected per group trained, the trained answers' mean length
    (answers.jsonl), and CPU-seconds to the target on the smoothed CPU-time curve, worked by hand."""
    from lab.sweep import analysis, runs_table

    def run(regime, pool, seed, cpu_curve, groups_rejected):
        folder = tmp_path / f"{regime}-{pool}-s{seed}"
        folder.mkdir()
        with open(folder / "answers.jsonl", "w") as f:  # trained 40 and 60 tokens; the rejected one does not count
            f.writelines(
                json.dumps(dict(tokens=n, fate=fate)) + "\n"
                for n, fate in ((40, "consumed"), (60, "consumed"), (10, "rejected"))
            )
        return dict(
            run=str(folder),
            regime=regime,
            pool=pool,
            seed=seed,
            acc0=0.5,
            acc1=0.7,
            curve=[(0, 0.5), (100, 0.6), (200, 0.7)],
            cpu_curve=cpu_curve,
            steps_per_min=10.0,
            stale=0.0,
            lag=0.0,
            spanning=0.0,
            gen_idle=0.0,
            discarded=0.0,
            recomputed=0.0,
            rejected=0.5,
            groups_rejected=groups_rejected,
            groups_trained=1600,
        )

    # smoothed, both CPU curves read 0.55, 0.6, 0.65: 0.6 is first reached at their second point
    rows = [run("sync", "fifo", s, [(0, 0.5), (50, 0.6), (100, 0.7)], 0) for s in (0, 1)]
    rows += [run("stale", "pace", s, [(0, 0.5), (200, 0.6), (400, 0.7)], 2400) for s in (0, 1)]
    header, _, *lines = runs_table(rows, 0.6).splitlines()
    names = [c.strip() for c in header.strip("|").split("|")]
    pace = dict(zip(names, [c.strip() for c in lines[-1].strip("|").split("|")]))
    assert pace["groups rejected per group trained"] == "1.50" and pace["answer tokens trained (mean)"] == "50.0"
    assert pace["CPU-s to 0.6"] == "200" and pace["pass@1 at 200 s (smoothed)"] == "0.650", pace
    assert pace["CPU-s to sync's final 0.700"] == "-", pace  # the smoothed curves end at 0.65
    (row,) = [line for line in analysis(rows, 0.6).splitlines() if line.startswith("| CPU-s to 0.6: stale pace - sync")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:3] == ["+150", "[+150, +150]"] and cells[4:] == ["2", "yes", "[+150, +150]"], row


def test_frontier_rule_against_sync_by_hand():
    """lab/frontier.py's rule on numbers worked by hand. With 2 degrees of freedom Student's t has a closed
    form, t_p = a sqrt(2 / (1 - a^2)) with a = 2p - 1: t_.975 = 4.303, t_.80 = 1.061, and at 1 - 0.05/8 two-sided
    (p = 0.996875, a = 0.99375) 12.590. Against `sync` (0.5 at every seed): `stale` 1 by 4, 5, 6 points, mean 5,
    se 1/sqrt(3) = 0.5774: its 95% interval [+2.5, +7.5] excludes 0, but Bonferroni over 8 comparisons gives
    5 +- 12.590 x 0.5774 = [-2.3, +12.3]: cannot tell. `recompute` 1 by 20, 21, 22: [+13.7, +28.3], better;
    `stale` 2 by -22, -21, -20: worse; the other five by 0, 0, 0. Power from the pooled sd, sqrt((3 x 2 x 1 +
    5 x 0) / 16) = 0.6124: (12.590 + 1.061) x 0.6124 / sqrt(3) = 4.8, where `stale` 1's own pairs give 7.9 and
    the five whose pairs agree 0."""
    from lab.frontier import SETTINGS, against_sync
    from lab.stats import interval

    accs = {k: [0.5, 0.5, 0.5] for k in SETTINGS}
    accs[("stale", 1)] = [0.54, 0.55, 0.56]
    accs[("recompute", 1)] = [0.70, 0.71, 0.72]
    accs[("stale", 2)] = [0.28, 0.29, 0.30]
    assert [round(x, 1) for x in interval([4, 5, 6])[:3]] == [5.0, 2.5, 7.5]  # uncorrected: above 0
    ruled, power = against_sync(accs)
    show = lambda k: [round(x, 1) for x in ruled[k][:3]] + [ruled[k][3]]  # noqa: E731
    assert show(("stale", 1)) == [5.0, -2.3, 12.3, "cannot tell"]
    assert show(("recompute", 1)) == [21.0, 13.7, 28.3, "better"]
    assert show(("stale", 2)) == [-21.0, -28.3, -13.7, "worse"]
    assert show(("stale", 8)) == [0.0, 0.0, 0.0, "cannot tell"] and len(ruled) == 8
    assert round(power, 1) == 4.8


def frontier_data(block, loss, acc):
    """A made-up data file's contents for one (block, loss) at one budget: acc(regime, eta, seed) -> pass@1."""
    run = dict(steps=10, steps_per_min=1.0, lag_mean=0.0, lag_max=0, stale=0.0, recomputed=0.0, ess=1.0, kl=0.0)
    run |= dict(clipped=0.0, finished_right=1, answers=2, processor="p")
    from lab.frontier import SEEDS, SETTINGS, cell_name

    runs = {cell_name(block, loss, *k, s): run | dict(acc={"10.0": acc(*k, s)}) for k in SETTINGS for s in SEEDS}
    return dict(budgets={block: [10.0]}, runs=runs)


def test_frontier_power_comes_from_the_blocks_pooled_sd():
    """stale - recompute at one budget: at eta 1 by 0, 0, 0 points (its own pairs would say 80%: 0.0), at eta 2,
    4, 8 by -2, 0, +2 (variance 4 each): pooled, sqrt((0 + 3 x 2 x 4) / 8) = sqrt(3), and the difference 3 seeds
    detect with 80% power is (4.303 + 1.061) x sqrt(3) / sqrt(3) = 5.4 in every cell. Against `sync` (0.5
    throughout), the differences are recompute's zeros and stale's: pooled sqrt(3 x 2 x 4 / 16) = 1.2247, so
    (12.590 + 1.061) x 1.2247 / sqrt(3) = 9.7 at Bonferroni's 1 - 0.05/8."""
    from lab.frontier import block_table, decision

    ds = {1: (0, 0, 0), 2: (-2, 0, 2), 4: (-2, 0, 2), 8: (-2, 0, 2)}
    acc = lambda regime, eta, s: 0.5 + (ds[eta][s] / 100 if regime == "stale" else 0)  # noqa: E731
    data = frontier_data("gen-slower-lr-x1", "tis", acc)
    text, _ = block_table(data, "gen-slower-lr-x1", "tis")
    assert "80%: detectable from the block's pooled sd, 1.7 points" in text, text
    (row1,) = [line for line in text.splitlines() if line.startswith("| 1 |")]
    (row2,) = [line for line in text.splitlines() if line.startswith("| 2 |")]
    assert row1 == "| 1 | +0.0 [+0.0, +0.0] cannot tell; 80%: 5.4 |", row1
    assert row2 == "| 2 | +0.0 [-5.0, +5.0] cannot tell; 80%: 5.4 |", row2  # 2 / sqrt(3) x 4.303 = 4.97
    row = decision(data).splitlines()[2]
    assert "`tis`: `sync` 0.500; better: none; worse: none; cannot tell: all 8; 80%: 9.7<br>" in row, row


def test_frontier_labels_a_diverging_block_and_does_not_rank_it():
    """Every setting's mean pass@1 at the last budget below the starting model's 0.469 (sync 0.40, the rest
    0.30 and 0.44): the block diverges, and the tables say so instead of ranking it; sync at 0.47 (above 0.469)
    and the same block is ranked: the 8 others all worse (by 17 or 3 points at every seed)."""
    from lab.frontier import DIVERGES, START, block_table, decision, diverges

    assert START == 0.469
    low = lambda regime, eta, s: {"sync": 0.40, "stale": 0.30, "recompute": 0.44}[regime]  # noqa: E731
    data = frontier_data("gen-slower-lr-x4", "tis", low)
    text, ruled = block_table(data, "gen-slower-lr-x4", "tis")
    assert ruled == DIVERGES and text.endswith(f"Not ranked: at 10 s this block {DIVERGES} (0.469).")
    assert "Against `sync`" not in text
    assert "`tis`: diverges: every setting ends below the starting model (0.469)<br>" in decision(data)
    up = lambda regime, eta, s: 0.47 if regime == "sync" else low(regime, eta, s)  # noqa: E731
    data = frontier_data("gen-slower-lr-x4", "tis", up)
    assert not diverges({("sync", 0): [0.47, 0.47, 0.47], ("stale", 1): [0.3, 0.3, 0.3]})
    text, (against, _) = block_table(data, "gen-slower-lr-x4", "tis")
    assert [v[3] for v in against.values()] == ["worse"] * 8, against
    assert "diverges" not in decision(data)


def test_frontier_says_intervals_and_power_by_hand():
    """d = 1, 2, 3 points: mean 2, sd 1, se 1/sqrt(3) = 0.5774; the 95% interval 2 ± 4.303 x
    0.5774 = 2 ± 2.48 = [-0.5, +4.5] holds 0: "cannot tell"; the difference 3 seeds detect with 80% power
    is (4.303 + 1.061) x 0.5774 = 3.1 (not the half-width, 2.5). d = 4, 5, 6: [+2.5, +7.5], above 0."""
    from lab.stats import said

    assert said([1, 2, 3]) == "+2.0 [-0.5, +4.5] cannot tell; 80%: 3.1"
    assert said([4, 5, 6]) == "+5.0 [+2.5, +7.5] higher; 80%: 3.1"
    assert said([-6, -5, -4]) == "-5.0 [-7.5, -2.5] lower; 80%: 3.1"


def test_stress_pairs_and_spreads_by_hand():
    """lab/stats.py as the stress tables use it: a - b per seed in points, 25, 0, 12.5 (mean 12.5, sd 12.5), its
    t interval 12.5 ± 4.303 x 12.5 / sqrt(3) = [-18.6, +43.6]; one seed, the mean alone; 'mean ± sd' without
    the sign on the sd, and one value as it is."""
    from lab.stats import mean_std, paired_t, show_paired

    assert show_paired(paired_t([0.75, 0.5, 0.625], [0.5, 0.5, 0.5])) == "+12.5 [-18.6, +43.6]"
    assert paired_t([0.75], [0.5]) == [25.0] and show_paired([25.0]) == "+25.0"
    assert mean_std([0.5, 0.75], "{:+.3f}") == "+0.625 ± 0.177" and mean_std([0.5], "{:.3f}") == "0.500"


def test_frontier_tables_come_from_the_data_file_alone(tmp_path):
    """With no runs recorded, every table and the decision table say how many runs are missing,
    and nothing is read from out/."""
    from lab.frontier import decision, read_data, tables

    data = read_data(str(tmp_path / "none.jsonl"))
    assert data == dict(budgets={}, runs={})
    assert tables(data).count("27 of 27 runs not in the data file yet") == 7
    assert "| training is | not in the grid | `ppo`: 27 of 27 runs not in the data file yet |" in decision(data)


def test_record_keeps_each_run_once_and_the_quoted_difference_is_paired(tmp_path, monkeypatch):
    """sweep.record: a line per finished run in lab/data/sweep.jsonl (here in tmp_path), its
    right answers exact, recorded once however often the sweep is tabled; difference() pairs
    by seed and leaves out a seed one regime lacks: by hand, 100 x (0.75 - 0.5) = +25 at seed
    0 and 100 x (0.5 - 0.5) = 0 at seed 1; seed 2 has stale only. pace_ratios pairs the same
    way: 30/20 and 20/20 steps a minute."""
    from lab import sweep

    marked = sweep.marked  # the module sweep writes through (tools/ on its path: not tools.marked)
    monkeypatch.setattr(marked, "data_path", lambda tool: str(tmp_path / f"{tool}.jsonl"))
    written = []
    monkeypatch.setattr(marked, "write", lambda tables, values, **kw: written.append(sorted(tables | values)) or [])
    run = {k: 0.0 for k in sweep.KEPT} | dict(pool="fifo", cfg=dict(eval_n=16))
    finals = {("stale", 0): 0.75, ("stale", 1): 0.5, ("stale", 2): 0.25, ("sync", 0): 0.5, ("sync", 1): 0.5}
    pace = {("stale", 0): 30.0, ("stale", 1): 20.0, ("stale", 2): 99.0, ("sync", 0): 20.0, ("sync", 1): 20.0}
    rows = [run | dict(regime=r, seed=s, acc1=v, steps_per_min=pace[r, s]) for (r, s), v in finals.items()]
    sweep.record(rows, "t", "default")
    sweep.record(rows, "t", "default")
    lines = [json.loads(x) for x in open(tmp_path / "sweep.jsonl")]
    assert len(lines) == 5 and written == [sorted(sweep.TABLES | sweep.VALUES)] * 2
    assert {"sweep-finals", "t-cost", "t-level"} <= set(written[0])
    assert [x["right"] for x in lines] == [12, 8, 4, 8, 8] and {x["sweep"] for x in lines} == {"t"}
    assert sweep.difference("t", "stale", "sync") == [25.0, 0.0]
    assert sweep.pace_ratios("t", "stale", "sync") == "1.00-1.50x"  # seed 2 left out, as in difference


def test_frontier_counts_its_intervals_by_hand():
    """The course's and the README's count of stale - recompute intervals, on one block of made-up
    runs at one budget: at eta 1 stale leads by 10, 9, 8 points (an interval above 0); at eta 2 it
    trails by 10, 9, 8; at eta 4 and 8 the differences are +1, -1, 0 (intervals holding 0)."""
    from lab.frontier import cell_name, counts

    block, loss = "gen-slower-lr-x4", "ppo"
    runs = {}
    for eta, d in ((1, (10, 9, 8)), (2, (-10, -9, -8)), (4, (1, -1, 0)), (8, (1, -1, 0))):
        for seed, x in enumerate(d):
            for regime, acc in (("stale", 0.5 + x / 100), ("recompute", 0.5)):
                runs[cell_name(block, loss, regime, eta, seed)] = dict(acc={"10.0": acc})
    said = counts(dict(budgets={block: [10.0]}, runs=runs))
    assert said["runs"] == "24" and said["intervals"] == "4" and said["pairs"] == "1" and said["budgets"] == "1", said
    assert said["same"] == "2" and said["up"] == said["down"] == "1", said
    assert said["up-list"].startswith("`ppo` at 4x the rate, generation the slower side, eta 1, 10 s: +9.0 ["), said
    assert said["down-list"].startswith("`ppo` at 4x the rate, generation the slower side, eta 2, 10 s: -9.0 [")
    assert said["luck"] == "0", said  # 5% of 4 intervals


def test_the_equivalence_test_on_numbers_worked_by_hand():
    """stats.tost on differences whose mean and sd are known: d = 0.5 +- 1 (n = 4, sd = sqrt(4/3)):
    se = 0.5774, t(0.95, 3) = 2.3534, so the 90% interval is [-0.859, +1.859]: inside +-2, equivalent;
    not inside +-1.5. Shifted by -5, the interval the Bonferroni correction asks for with 8 tests,
    -4.5 +- t(0.996875, 3) x se = -4.5 +- 6.895 x 0.5774 = [-8.48, -0.52], lies below 0: a cost of 4.5
    points; shifted by -4 it holds 0 (high +0.48): cannot conclude. TOST's 80% margin and the
    difference detectable at 80% by their formulas."""
    from lab.stats import detectable, pooled_sd, tost, tost_detectable

    d = [-0.5, -0.5, 1.5, 1.5]
    v = tost(d, 2.0)
    assert (round(v["low90"], 3), round(v["high90"], 3)) == (-0.859, 1.859) and v["verdict"].startswith("equivalent")
    assert tost(d, 1.5)["verdict"] == "cannot conclude"
    cost = tost([x - 5 for x in d], 2.0, tests=8)
    assert cost["verdict"].startswith("a cost of 4.5 points") and round(cost["high"], 2) == -0.52
    assert tost([x - 4 for x in d], 2.0, tests=8)["verdict"] == "cannot conclude"
    assert round(pooled_sd([d, [0.0, 2.0]]), 4) == round(((3 * 4 / 3 + 1 * 2) / 4) ** 0.5, 4)
    assert round(tost_detectable(1.0, 20), 3) == round((1.7291 + 1.3277) / 20**0.5, 3)
    assert round(detectable(1.0, 20), 3) == round((2.0930 + 0.8610) / 20**0.5, 3)
