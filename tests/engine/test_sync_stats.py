"""SyncBatchNorm's statistics across simulated ranks (cunorm/_engine/sync_stats.py)
against NumPy's float64 over the concatenated batch: uneven and empty
ranks, a large mean, one framework's arrays at a time."""
import numpy as np
import pytest

from cunorm._engine import sync_stats


def _rank_stats(batches, dtype):
    """Each rank's (count, mean, M2) per channel in ``dtype``, as a rank
    computes them over its (n, C, spatial) batch; an empty rank sends zeros."""
    channels = batches[0].shape[1]
    counts, means, m2s = (np.zeros((len(batches), channels), dtype) for _ in range(3))
    for r, b in enumerate(batches):
        per_channel = np.moveaxis(b, 1, 0).reshape(channels, -1).astype(dtype)
        if per_channel.shape[1]:
            counts[r] = per_channel.shape[1]
            means[r] = per_channel.mean(axis=1, dtype=dtype)
            m2s[r] = ((per_channel - means[r][:, None]) ** 2).sum(axis=1, dtype=dtype)
    return counts, means, m2s


def _want(batches):
    data = np.concatenate(batches).astype(np.float64)
    per_channel = np.moveaxis(data, 1, 0).reshape(data.shape[1], -1)
    return per_channel.shape[1], per_channel.mean(axis=1), per_channel.var(axis=1)


@pytest.mark.parametrize("sizes", [(4, 4), (3, 0, 5, 1), (0, 7), (1, 1, 1, 1, 1, 1, 1, 9), (0, 0, 2)],
                         ids=["even", "uneven with an empty rank", "first empty", "eight ranks", "two empty first"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_combined_statistics_match_the_concatenated_batch(rng, sizes, dtype):
    channels, spatial = 6, 37
    offset = rng.uniform(-1e3, 1e3, size=(1, channels, 1))  # means large against the spread
    batches = [rng.standard_normal((n, channels, spatial)) + offset for n in sizes]
    counts, means, m2s = _rank_stats(batches, dtype)
    n, mean, m2 = sync_stats.combine(counts, means, m2s)
    total, want_mean, want_var = _want(batches)
    assert n.dtype == mean.dtype == m2.dtype == dtype
    np.testing.assert_array_equal(n, total)
    eps = np.finfo(dtype).eps
    # the conditioning: rounding a mean of magnitude |mean| costs eps * |mean|
    assert np.all(np.abs(mean - want_mean) <= 64 * eps * np.abs(want_mean) + 1e-30)
    assert np.all(np.abs(m2 / n - want_var) <= 64 * eps * (want_var + np.abs(want_mean) * np.sqrt(want_var)))


def test_rank_order_is_the_order_of_the_rows(rng):
    """The same rows give the same bits; reordered ranks are still right
    (within rounding), which is why every rank combines in rank order."""
    batches = [rng.standard_normal((n, 3, 11)) * 5 + 2 for n in (2, 5, 3)]
    stats = _rank_stats(batches, np.float32)
    first = sync_stats.combine(*stats)
    again = sync_stats.combine(*(a.copy() for a in stats))
    for a, b in zip(first, again):
        assert a.tobytes() == b.tobytes()
    reordered = sync_stats.combine(*(a[::-1] for a in stats))
    np.testing.assert_allclose(reordered[1], first[1], rtol=1e-5)


def test_all_ranks_empty_gives_count_zero():
    zeros = np.zeros((3, 4), np.float32)
    n, mean, m2 = sync_stats.combine(zeros, zeros, zeros)
    assert not n.any() and not mean.any() and not m2.any()


def test_nan_in_a_rank_reaches_the_result(rng):
    batches = [rng.standard_normal((2, 3, 5)) for _ in range(3)]
    batches[1][0, 1, 2] = np.nan
    n, mean, m2 = sync_stats.combine(*_rank_stats(batches, np.float32))
    assert np.isnan(mean[1]) and np.isnan(m2[1])
    assert np.isfinite(mean[[0, 2]]).all() and np.isfinite(m2[[0, 2]]).all()


def test_mismatched_ranks_are_refused():
    a = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="same number"):
        sync_stats.combine(a, a[:1], a)
    with pytest.raises(ValueError, match="same number"):
        sync_stats.combine(a[:0], a[:0], a[:0])


def test_running_update_is_torchs(rng):
    """(1 - momentum) * running + momentum * batch, the variance unbiased
    over the global count."""
    batches = [rng.standard_normal((n, 4, 9)) for n in (3, 0, 2)]
    n, mean, m2 = sync_stats.combine(*_rank_stats(batches, np.float64))
    rm, rv = rng.standard_normal(4), rng.uniform(0.5, 2, 4)
    new_mean, new_var = sync_stats.running_update(rm, rv, mean, m2, n, 0.1)
    total, want_mean, want_var = _want(batches)
    np.testing.assert_allclose(new_mean, 0.9 * rm + 0.1 * want_mean, rtol=1e-12)
    np.testing.assert_allclose(new_var, 0.9 * rv + 0.1 * want_var * total / (total - 1), rtol=1e-12)


def test_torch_tensors_combine_as_numpy_arrays(rng):
    torch = pytest.importorskip("torch")
    batches = [rng.standard_normal((n, 5, 13)) + 10 for n in (4, 0, 3)]
    stats = _rank_stats(batches, np.float32)
    want = sync_stats.combine(*stats)
    got = sync_stats.combine(*(torch.from_numpy(a) for a in stats))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-6)
