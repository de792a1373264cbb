"""Interleaved timing of contenders on a shared, noisy machine: one call of each per round, so
load that comes and goes hits them alike."""

from __future__ import annotations

import statistics
import time


def interleaved_times_ms(
    contenders: dict, repeats: int, warmup: int = 2, rotate: bool = False
) -> dict[str, list[float]]:
    """name -> milliseconds of each of `repeats` rounds' call of `contenders[name]()`, after
    `warmup` untimed calls each. With `rotate`, round r starts at the r-th contender, so that
    no contender always runs right after the same one (whose threads, caches and freed memory
    it would otherwise meet alike every round)."""
    for run in contenders.values():
        for _ in range(warmup):
            run()
    names = list(contenders)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(repeats):
        first = round_ % len(names) if rotate else 0
        for name in names[first:] + names[:first]:
            start = time.perf_counter()
            contenders[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def interleaved_medians_ms(
    contenders: dict, repeats: int, warmup: int = 2, rotate: bool = False
) -> dict[str, float]:
    """name -> median milliseconds of `interleaved_times_ms`."""
    times = interleaved_times_ms(contenders, repeats, warmup, rotate)
    return {name: statistics.median(samples) for name, samples in times.items()}


def paired_ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> tuple:
    """(median, lower quartile, upper quartile) of the per-round ratio numerator/denominator:
    each round's two calls ran back to back, so load that drifts over the run divides out
    (the ratio of the two medians mixes rounds of different load)."""
    ratios = [a / b for a, b in zip(times[numerator], times[denominator], strict=True)]
    low, median, high = statistics.quantiles(ratios, n=4)
    return median, low, high
