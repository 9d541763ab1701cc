"""Adaptive cadence against fixed cadence on a simulated corpus, at the same render budget.

`python -m bench cadence [--quick]`

Every page changes as a Poisson process of its own rate; the mean time between changes is
spread log-uniformly from an hour to 1,000 hours (three orders of magnitude). Two schedules
render the corpus:

- adaptive: the product's own decisions (store.cadence.learn), each render telling whether
  the page changed since the last one, on a route adapting from 30 minutes to 60 days with
  the default rates (Nutch's 0.4 and 0.2), every page starting at a day;
- fixed: one cadence for every page, chosen so that it spends the renders the adaptive
  schedule spent in the measured window.

The first third of the horizon is the adaptive schedule's warm-up and is not measured. In
the measured window, for each schedule: renders spent; the share of renders that found a
change; freshness as Cho and Garcia-Molina define it (the time-averaged share of pages
whose copy is up to date); and staleness, the mean age of a copy (how long since the page
first changed after its last render; 0 while fresh), in hours. Cho and Garcia-Molina's
model is the yardstick: each page's expected freshness at a fixed interval I is
(1 - exp(-lambda I)) / (lambda I), which the fixed arm's simulated freshness must match, and
their optimal allocation of the same budget (each page's own interval, from their
Lagrangian) bounds what any schedule could reach.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from bench.harness import report
from store.cadence import Adaptation, learn

HOUR_S = 3600.0
DAY_S = 86_400.0
# Two ladders from 30 minutes: to 60 days (past the slowest page's mean change interval),
# and to 7 days, whose top bounds how long a slow page's copy can go stale.
LADDERS = (
    ("30 min to 60 days", Adaptation(min_s=1800, max_s=60 * 86_400)),
    ("30 min to 7 days", Adaptation(min_s=1800, max_s=7 * 86_400)),
)
START_CADENCE_S = 86_400  # the global default a page starts from
FASTEST_MEAN_S = HOUR_S  # mean time between changes, fastest page
SLOWEST_MEAN_S = 1000 * HOUR_S


class Config(msgspec.Struct, frozen=True, kw_only=True):
    pages: int
    horizon_days: float
    seed: int = 29


FULL = Config(pages=10_000, horizon_days=180)
QUICK = Config(pages=600, horizon_days=60)


class Arm(msgspec.Struct, frozen=True, kw_only=True):
    """One schedule's figures over the measured window."""

    renders: int
    found_change: float  # share of renders that found a change
    freshness: float  # time-averaged share of pages up to date (Cho and Garcia-Molina)
    staleness_h: float  # mean age of a copy, hours
    # Per page: its last cadence (s) and its time-averaged freshness, for the chart.
    cadence_s: list[float] = []
    page_freshness: list[float] = []


def change_times(rates: npt.NDArray[np.float64], horizon_s: float, seed: int) -> list[Any]:
    """Each page's change instants in [0, horizon_s), sorted (Poisson, its own rate)."""
    generator = np.random.default_rng(seed)
    out = []
    for rate in rates:
        count = generator.poisson(rate * horizon_s)
        out.append(np.sort(generator.uniform(0.0, horizon_s, count)))
    return out


def simulate(
    changes: list[Any],
    window: tuple[float, float],
    *,
    adapt: Adaptation | None = None,
    fixed_s: float | None = None,
    seed: int,
) -> Arm:
    """Render every page on its schedule over [0, window end); count in the window.
    `adapt`: adaptive (store.cadence.learn at each render), else every `fixed_s`."""
    begin, end = window
    generator = np.random.default_rng(seed)
    renders = found = 0
    stale_total = age_total = 0.0
    cadences: list[float] = []
    per_page: list[float] = []
    for page_changes in changes:
        cadence = float(START_CADENCE_S if fixed_s is None else fixed_s)
        assert (adapt is None) != (fixed_s is None)
        learned: int | None = None
        history = 0
        # A random phase, so pages of one cadence do not render in lock-step.
        at = float(generator.uniform(0.0, cadence))
        last = 0.0  # the copy as of time 0 is fresh
        page_stale = 0.0
        while True:
            span_start, span_end = max(last, begin), min(at, end)
            if span_end > span_start:
                # The copy is stale from the first change after `last`, counted in the window.
                first = int(np.searchsorted(page_changes, last, side="right"))
                if first < len(page_changes) and page_changes[first] < span_end:
                    stale_from = max(page_changes[first], span_start)
                    stale = span_end - stale_from
                    page_stale += stale
                    stale_total += stale
                    # Age at t is t - the first change; integrate over [stale_from, span_end).
                    first_change = page_changes[first]
                    age_total += (
                        (span_end - first_change) ** 2 - (stale_from - first_change) ** 2
                    ) / 2
            if at >= end:
                break
            first = int(np.searchsorted(page_changes, last, side="right"))
            changed = first < len(page_changes) and page_changes[first] <= at
            if at >= begin:
                renders += 1
                found += changed
            if adapt is not None:
                decided = learn(adapt, learned, START_CADENCE_S, history, changed)
                learned, history = decided.cadence_s, decided.history
                assert learned is not None
                cadence = float(learned)
            last = at
            at += cadence
        cadences.append(cadence)
        per_page.append(1.0 - page_stale / (end - begin))
    span = (end - begin) * len(changes)
    return Arm(
        renders=renders,
        found_change=found / renders if renders else 0.0,
        freshness=1.0 - stale_total / span,
        staleness_h=age_total / span / HOUR_S,
        cadence_s=cadences,
        page_freshness=per_page,
    )


def expected_freshness(rates: npt.NDArray[np.float64], intervals: npt.NDArray[np.float64]) -> float:
    """Cho and Garcia-Molina: a page of rate lambda refreshed every I is fresh a share
    (1 - exp(-lambda I)) / (lambda I) of the time; the corpus's mean."""
    x = rates * intervals
    return float(np.mean(-np.expm1(-x) / x))


def optimal_intervals(
    rates: npt.NDArray[np.float64], renders_per_s: float
) -> npt.NDArray[np.float64]:
    """Cho and Garcia-Molina's optimal refresh frequencies for a total of `renders_per_s`:
    each page's f with dF/df equal to one multiplier mu (0 where even its first render is
    worth less than mu), found by bisection on mu, each f by bisection on its own curve."""

    def gain(f: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
        # d/df of (f / lambda)(1 - exp(-lambda / f)), for f > 0.
        r = rates / f
        return (-np.expm1(-r)) / rates - np.exp(-r) / f

    def frequencies(mu: float) -> npt.NDArray[np.float64]:
        low = np.full_like(rates, 1e-12)
        high = np.full_like(rates, 1e3)
        for _ in range(80):
            mid = np.sqrt(low * high)
            above = gain(mid) > mu  # the gain falls as f grows: go higher
            low = np.where(above, mid, low)
            high = np.where(above, high, mid)
        f = np.sqrt(low * high)
        return np.where(gain(np.full_like(rates, 1e-12)) > mu, f, 0.0)

    low_mu, high_mu = 1e-30, 1e6
    for _ in range(80):
        mu = math.sqrt(low_mu * high_mu)
        if frequencies(mu).sum() > renders_per_s:
            low_mu = mu
        else:
            high_mu = mu
    f = frequencies(math.sqrt(low_mu * high_mu))
    with np.errstate(divide="ignore"):
        return np.where(f > 0, 1.0 / np.maximum(f, 1e-300), np.inf)


def optimal_freshness(rates: npt.NDArray[np.float64], intervals: npt.NDArray[np.float64]) -> float:
    finite = np.isfinite(intervals)
    x = rates[finite] * intervals[finite]
    return float(np.sum(-np.expm1(-x) / x) / len(rates))


ROWS = (
    ("renders spent", "renders", "lower"),
    ("share of renders that found a change", "%", "higher"),
    ("freshness (time-averaged share of pages up to date)", "%", "higher"),
    ("mean staleness (age of a copy)", "h", "lower"),
)
FIXED, FIXED_MODEL, OPTIMUM = "fixed", "fixed (model)", "Cho-GM optimum (model)"


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """One ladder's adaptive arm, the fixed arm spending its renders, and the models."""

    ladder: str
    adaptive: Arm
    fixed: Arm
    fixed_interval_s: float
    model_fixed: float  # Cho-GM's expected freshness of the fixed arm
    model_optimum: float  # their optimal allocation of the same renders
    optimum_interval_s: list[float]


def compare(
    name: str,
    adapt: Adaptation,
    rates: npt.NDArray[np.float64],
    changes: list[Any],
    window: tuple[float, float],
    seed: int,
) -> Comparison:
    adaptive = simulate(changes, window, adapt=adapt, seed=seed)
    report.progress(f"cadence: {name}: adaptive spent {adaptive.renders} renders in the window")
    span_s = window[1] - window[0]
    fixed_interval = span_s * len(changes) / adaptive.renders
    fixed = simulate(changes, window, fixed_s=fixed_interval, seed=seed + 1)
    report.progress(
        f"cadence: {name}: fixed every {fixed_interval / HOUR_S:.1f} h spent {fixed.renders}"
    )
    optimum = optimal_intervals(rates, adaptive.renders / span_s)
    return Comparison(
        ladder=name,
        adaptive=adaptive,
        fixed=fixed,
        fixed_interval_s=fixed_interval,
        model_fixed=expected_freshness(rates, np.full_like(rates, fixed_interval)),
        model_optimum=optimal_freshness(rates, optimum),
        optimum_interval_s=optimum.tolist(),
    )


def figures(table: str, found: Comparison) -> list[report.Figure]:
    adaptive, fixed = found.adaptive, found.fixed
    values: dict[str, tuple[float, dict[str, float | None]]] = {
        "renders spent": (adaptive.renders, {FIXED: fixed.renders}),
        "share of renders that found a change": (
            100 * adaptive.found_change,
            {FIXED: 100 * fixed.found_change},
        ),
        "freshness (time-averaged share of pages up to date)": (
            100 * adaptive.freshness,
            {
                FIXED: 100 * fixed.freshness,
                FIXED_MODEL: 100 * found.model_fixed,
                OPTIMUM: 100 * found.model_optimum,
            },
        ),
        "mean staleness (age of a copy)": (adaptive.staleness_h, {FIXED: fixed.staleness_h}),
    }
    out = []
    for what, unit, better in ROWS:
        ours, peers = values[what]
        note = ""
        if what == "renders spent":
            note = f"fixed: every {found.fixed_interval_s / HOUR_S:.2f} h, set to spend the same"
        out.append(
            report.Figure(
                table=table,
                what=what,
                unit=unit,
                ours=float(ours),
                better=better,  # type: ignore[arg-type]
                peers={name: float(v) if v is not None else None for name, v in peers.items()},
                note=note,
            )
        )
    return out


def run(config: Config, quick: bool) -> report.SectionResult:
    result = report.new_result("cadence", quick, ours_label="adaptive")
    horizon_s = config.horizon_days * DAY_S
    window = (horizon_s / 3.0, horizon_s)
    generator = np.random.default_rng(config.seed)
    means = np.exp(
        generator.uniform(math.log(FASTEST_MEAN_S), math.log(SLOWEST_MEAN_S), config.pages)
    )
    rates = 1.0 / means
    report.progress(f"cadence: {config.pages} pages, {config.horizon_days:g} days")
    changes = change_times(rates, horizon_s, config.seed + 1)
    comparisons = []
    for number, (name, adapt) in enumerate(LADDERS):
        table = f"adaptive ({name}) vs fixed cadence, same renders"
        result.promised += [f"{table}/{what}" for what, _, _ in ROWS]
        found = compare(name, adapt, rates, changes, window, config.seed + 10 * (number + 1))
        result.figures += figures(table, found)
        comparisons.append(found)
    result.pending[FIXED_MODEL] = "a model's figure, given for freshness only"
    result.pending[OPTIMUM] = "a model's figure, given for freshness only"
    result.raw = {
        "config": msgspec.to_builtins(config),
        "ladders": {name: msgspec.to_builtins(adapt) for name, adapt in LADDERS},
        "start_cadence_s": START_CADENCE_S,
        "mean_change_interval_s": [FASTEST_MEAN_S, SLOWEST_MEAN_S],
        "window_s": list(window),
        "fixed_interval_h": {c.ladder: c.fixed_interval_s / HOUR_S for c in comparisons},
    }
    path = chart(result, rates, comparisons)
    report.progress(f"cadence: chart {path}")
    return result


def chart(
    result: report.SectionResult, rates: npt.NDArray[np.float64], found: list[Comparison]
) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.harness.charts import save

    wide = found[0]
    means_h = 1.0 / rates / HOUR_S
    order = np.argsort(means_h)
    figure, (learned, fresh, bars) = plt.subplots(1, 3, figsize=(19, 5.8))
    for comparison in found:
        label = f"adaptive {comparison.ladder}: learned cadence"
        cadence_h = np.array(comparison.adaptive.cadence_s) / HOUR_S
        learned.scatter(means_h, cadence_h, s=3, alpha=0.35, label=label)
    learned.plot(means_h[order], math.log(2) * means_h[order], color="black", lw=1,
                 label="ln 2 x mean change interval (half the renders find a change)")  # fmt: skip
    optimum = np.array(wide.optimum_interval_s)[order] / HOUR_S
    finite = np.isfinite(optimum)
    learned.plot(means_h[order][finite], optimum[finite], color="tab:green", lw=1,
                 label=f"Cho-GM optimum, the {wide.ladder} budget")  # fmt: skip
    learned.axhline(wide.fixed_interval_s / HOUR_S, color="tab:red", lw=1,
                    label=f"fixed, the {wide.ladder} budget")  # fmt: skip
    learned.set_xscale("log")
    learned.set_yscale("log")
    learned.set_xlabel("page's mean time between changes (h)")
    learned.set_ylabel("cadence (h)")
    learned.set_title("the cadence each page ends at")
    learned.legend(fontsize=7)
    for comparison in found:
        fresh.scatter(means_h, comparison.adaptive.page_freshness, s=3, alpha=0.35,
                      label=f"adaptive {comparison.ladder}")  # fmt: skip
    fresh.scatter(means_h, wide.fixed.page_freshness, s=3, alpha=0.35, color="tab:red",
                  label=f"fixed every {wide.fixed_interval_s / HOUR_S:.1f} h")  # fmt: skip
    fresh.set_xscale("log")
    fresh.set_xlabel("page's mean time between changes (h)")
    fresh.set_ylabel("share of the window its copy was up to date")
    fresh.set_title("freshness per page (higher is better)")
    fresh.legend(fontsize=7)
    names = ["found a change\n(% of renders)", "freshness\n(% of page-time)",
             "staleness\n(mean age, h)"]  # fmt: skip
    arms = []
    for comparison in found:
        arms.append((f"adaptive {comparison.ladder} ({comparison.adaptive.renders:,} renders)",
                     comparison.adaptive))  # fmt: skip
        arms.append((f"fixed every {comparison.fixed_interval_s / HOUR_S:.1f} h "
                     f"({comparison.fixed.renders:,})", comparison.fixed))  # fmt: skip
    width = 0.8 / len(arms)
    xs = np.arange(len(names))
    for position, (label, arm) in enumerate(arms):
        values = [100 * arm.found_change, 100 * arm.freshness, arm.staleness_h]
        at = xs - 0.4 + width * (position + 0.5)
        bars.bar(at, values, width, label=label)
        for x, value in zip(at, values, strict=True):
            bars.text(x, value, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
    bars.set_xticks(xs, names)
    bars.set_ylim(0, 125)  # room above the bars for the legend
    bars.set_title("each adaptive arm beside a fixed one spending its renders")
    bars.legend(fontsize=7, loc="upper center", ncol=2)
    return save(figure, result, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cadence", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    return report.emit(run(config, args.quick))


if __name__ == "__main__":
    sys.exit(main())
