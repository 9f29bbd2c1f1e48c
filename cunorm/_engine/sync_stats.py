"""Per-channel statistics of several ranks combined into the global batch's
(SyncBatchNorm's forward after its one collective).

Each rank contributes (count, mean, M2) per channel, M2 the sum of squared
deviations from its own mean (count times its biased variance). Ranks are
combined one at a time in rank order by Chan et al.'s pairwise update,
never through E[x^2] - E[x]^2 (which cancels when the mean is large against
the spread). Every rank runs this same function on the same gathered
arrays, so every rank gets the same bits, run to run.

The functions use array operators only, so they take NumPy, CuPy or torch
arrays alike (the (ranks, channels) arrays of one framework, in the
statistics' dtype: float32, float64 for float64 data).
"""
from __future__ import annotations


def combine(counts, means, m2s):
    """(count, mean, M2) of the union of the ranks' samples, per channel.

    ``counts``, ``means``, ``m2s``: (ranks, channels) arrays, row r rank r's.
    A rank with no samples sends count 0, mean 0 and M2 0 (then it changes
    nothing). Ranks are added in row order."""
    if not (len(counts) == len(means) == len(m2s)) or len(counts) == 0:
        raise ValueError(f"combine needs the same number (>= 1) of ranks' counts, means and M2s, got "
                         f"{len(counts)}, {len(means)}, {len(m2s)}")
    n, mean, m2 = counts[0], means[0], m2s[0]
    for r in range(1, len(counts)):
        n_b = counts[r]
        n_ab = n + n_b
        # n_ab is 0 only while every rank so far was empty: divide by 1 then
        share = n_b / (n_ab + (n_ab == 0))
        delta = means[r] - mean
        mean = mean + delta * share
        m2 = m2 + m2s[r] + delta * delta * n * share
        n = n_ab
    return n, mean, m2


def running_update(running_mean, running_var, mean, m2, count, momentum: float):
    """torch's running statistics after one training step over the global
    batch: ``(1 - momentum) * running + momentum * batch``, the variance the
    unbiased one, M2 / (count - 1). New arrays; the caller writes them where
    it keeps its buffers. ``count`` must exceed 1 (torch refuses a training
    step of one value a channel)."""
    unbiased = m2 / (count - 1)
    return ((1 - momentum) * running_mean + momentum * mean,
            (1 - momentum) * running_var + momentum * unbiased)
