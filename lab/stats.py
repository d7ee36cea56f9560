"""
The statistics the lab's tools share, each once: a paired difference over seeds, its 95% t
interval, the difference the seeds would detect with 80% power, the verdict an interval allows,
and how the pages write them ('mean [low, high]', 'mean ± sd'). The experiments pair by seed:
the same seed samples the same problems, so a - b seed by seed removes what the seeds share.
And the equivalence test (tost) with its power. t quantiles from scipy.
"""

import statistics

from scipy.stats import t as student_t


def t(p, df):
    """Student's t quantile: P(T <= t) = p with df degrees of freedom (seeds - 1)."""
    return float(student_t.ppf(p, df))


def detectable(sd, n, tests=1):
    """The difference n paired seeds of spread sd detect with 80% power at 95%: (t_.975 + t_.80) x sd / sqrt(n)
    (the interval's half-width alone is found only about half the time); with `tests`, at 1 - 0.05/tests each."""
    return (t(1 - 0.025 / tests, n - 1) + t(0.80, n - 1)) * (sd / n**0.5)


def tost_detectable(sd, n):
    """The margin two one-sided tests at 0.05 confirm with 80% power when the true difference is 0:
    (t_.95 + t_.90) x sd / sqrt(n)."""
    return (t(0.95, n - 1) + t(0.90, n - 1)) * (sd / n**0.5)


def pooled_sd(groups):
    """The sd of several groups of differences pooled: their variances weighted by their degrees of freedom."""
    groups = [g for g in groups if len(g) > 1]
    df = sum(len(g) - 1 for g in groups)
    return (sum((len(g) - 1) * statistics.variance(g) for g in groups) / df) ** 0.5


def tost(d, margin, alpha=0.05, tests=1):
    """Two one-sided tests of paired differences d against +-margin: "equivalent" when the 1 - 2 alpha
    t interval lies inside (-margin, margin); else "a cost" ("a gain") when the 1 - alpha/tests interval
    (two-sided, Bonferroni over `tests`) lies below (above) 0; else "cannot conclude"."""
    n, m = len(d), statistics.mean(d)
    se = statistics.stdev(d) / n**0.5
    low90, high90 = m - t(1 - alpha, n - 1) * se, m + t(1 - alpha, n - 1) * se
    low, high = m - t(1 - alpha / (2 * tests), n - 1) * se, m + t(1 - alpha / (2 * tests), n - 1) * se
    if -margin < low90 and high90 < margin:
        said = f"equivalent within +-{margin:g}"
    elif high < 0 or low > 0:
        level = f"{1 - alpha / tests:.2%}"
        said = f"a {'cost' if high < 0 else 'gain'} of {abs(m):.1f} points ({level} [{low:+.1f}, {high:+.1f}])"
    else:
        said = "cannot conclude"
    return dict(mean=m, low90=low90, high90=high90, low=low, high=high, verdict=said)


def interval(d, tests=1):
    """(mean, low, high, detectable at 80% power) of paired differences d, in points; None bounds with < 2.
    The interval is 95%, or with `tests` 1 - 0.05/tests (Bonferroni: `tests` intervals all hold 95% of the time)."""
    m = statistics.mean(d)
    if len(d) < 2:
        return m, None, None, None
    sd = statistics.stdev(d)
    half = t(1 - 0.025 / tests, len(d) - 1) * sd / len(d) ** 0.5
    return m, m - half, m + half, detectable(sd, len(d), tests)


def t_interval(d):
    """The paired differences d's 95% interval by a paired t-test, mean ± t * sd / sqrt(n) (interval's):
    a second opinion beside a bootstrap, which is narrow on few seeds. None with fewer than 2."""
    return interval(d)[1:3] if len(d) >= 2 else None


def paired_t(a, b):
    """a - b over seeds (lists in seed order), in points: [mean, low, high] by the t interval, [mean] without one."""
    d = [100 * (x - y) for x, y in zip(a, b)]
    return [statistics.mean(d), *(t_interval(d) or ())]


def verdict(lo, hi):
    """What an interval lets the write-up say: 'cannot tell' where it holds 0."""
    return "cannot tell" if lo <= 0 <= hi else ("higher" if lo > 0 else "lower")


def show_paired(d):
    """(mean, low, high) in points as the pages write it, 'mean [low, high]'; (mean,) alone as the mean."""
    return f"{d[0]:+.1f} [{d[1]:+.1f}, {d[2]:+.1f}]" if len(d) == 3 else f"{d[0]:+.1f}"


def said(d, sd=None):
    """Paired differences d as the write-up says them: mean [low, high], the verdict, and what 80% power detects
    (from d's own spread, or from `sd`, a spread pooled over more than d)."""
    m, lo, hi, power = interval(d)
    if lo is None:
        return f"{m:+.1f} (one seed)"
    power = power if sd is None else detectable(sd, len(d))
    return f"{show_paired((m, lo, hi))} {verdict(lo, hi)}; 80%: {power:.1f}"


def spread(values):
    """[mean, sample std] over seeds, [value] for one."""
    return [statistics.mean(values), statistics.stdev(values)] if len(values) > 1 else [values[0]]


def show_spread(s, fmt="{:.3f}"):
    """spread()'s [mean, std] as the pages write it, 'm ± s' (the format's sign dropped for s); [value] alone."""
    return fmt.format(s[0]) + "".join(f" ± {fmt.replace('+', '').format(x)}" for x in s[1:])


def mean_std(values, fmt):
    """'m ± s' over seeds (sample std), or just the value for one seed."""
    return show_spread(spread(values), fmt)
