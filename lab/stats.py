"""
The statistics the lab's tools share, each once: a paired difference over seeds, its 95% t
interval, the difference the seeds would detect with 80% power, the verdict an interval allows,
and how the pages write them ('mean [low, high]', 'mean ± sd'). The experiments pair by seed:
the same seed samples the same problems, so a - b seed by seed removes what the seeds share.
"""

import statistics

# t(0.975, df), df = seeds - 1: the paired t-test's quantiles (a table: the project does not
# depend on scipy, and the experiments have 2-11 seeds)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}

# t(0.80, df): with T975, the difference a paired test of these seeds detects with 80% power
T80 = {1: 1.376, 2: 1.061, 3: 0.978, 4: 0.941, 5: 0.920, 6: 0.906, 7: 0.896, 8: 0.889, 9: 0.883, 10: 0.879}


def detectable(sd, n):
    """The difference n paired seeds of spread sd detect with 80% power at 95%: (t_.975 + t_.80) x sd / sqrt(n)
    (the interval's half-width alone is found only about half the time)."""
    return (T975[n - 1] + T80[n - 1]) * (sd / n**0.5)


def interval(d):
    """(mean, low, high, detectable at 80% power) of paired differences d, in points; None bounds with < 2."""
    m = statistics.mean(d)
    if len(d) < 2:
        return m, None, None, None
    sd = statistics.stdev(d)
    se = sd / len(d) ** 0.5
    return m, m - T975[len(d) - 1] * se, m + T975[len(d) - 1] * se, detectable(sd, len(d))


def t_interval(d):
    """The paired differences d's 95% interval by a paired t-test, mean ± t * sd / sqrt(n) (interval's):
    a second opinion beside a bootstrap, which is narrow on few seeds. None outside 2-11 seeds."""
    return interval(d)[1:3] if 2 <= len(d) <= len(T975) + 1 else None


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


def said(d):
    """Paired differences d as the write-up says them: mean [low, high], the verdict, and what 80% power detects."""
    m, lo, hi, power = interval(d)
    if lo is None:
        return f"{m:+.1f} (one seed)"
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
