"""The float64 reference against a deliberately naive per-row implementation."""
import math

import numpy as np
import pytest

from experiments.measure import reference


def naive(q, k, v, causal, scale):
    b, n_q, h, d = q.shape
    n_k, h_kv = k.shape[1], k.shape[2]
    o = np.zeros((b, n_q, h, d))
    lse = np.zeros((b, h, n_q))
    for bi in range(b):
        for hi in range(h):
            hk = hi // (h // h_kv)
            for i in range(n_q):
                s = [scale * float(np.dot(q[bi, i, hi], k[bi, j, hk])) for j in range(n_k)
                     if not (causal and j > i)]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                lse[bi, hi, i] = m + math.log(sum(w))
                o[bi, i, hi] = sum(wj * v[bi, j, hk] for j, wj in enumerate(w)) / sum(w)
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h, h_kv", [(2, 2), (4, 2), (3, 1)])
def test_matches_naive(rng, causal, h, h_kv):
    q = rng.standard_normal((2, 7, h, 8))
    k = rng.standard_normal((2, 7, h_kv, 8))
    v = rng.standard_normal((2, 7, h_kv, 8))
    o, lse = reference.attention(q, k, v, causal=causal, softmax_scale=0.3)
    o_n, lse_n = naive(q, k, v, causal, 0.3)
    np.testing.assert_allclose(o, o_n, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-12, atol=1e-12)


def test_rows_subset_equals_full(rng):
    q, k, v = (rng.standard_normal((1, 33, 2, 16)) for _ in range(3))
    rows = np.array([0, 5, 32])
    o, lse = reference.attention(q, k, v, causal=True)
    o_r, lse_r = reference.attention(q, k, v, causal=True, rows=rows)
    np.testing.assert_array_equal(o_r, o[:, rows])
    np.testing.assert_array_equal(lse_r, lse[:, :, rows])


def test_rectangular_and_default_scale(rng):
    q = rng.standard_normal((1, 3, 1, 16))
    k, v = (rng.standard_normal((1, 11, 1, 16)) for _ in range(2))
    o, lse = reference.attention(q, k, v)
    o_n, lse_n = naive(q, k, v, False, 1 / 4)
    # atol too: an output element can cancel to near 0, where a few ulps of rounding order are a
    # large relative error (seed 1638409051: 5.76e-5 off by 2.7e-16). A wrong scale is off by ~0.1.
    np.testing.assert_allclose(o, o_n, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_n, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_gradients_match_finite_differences(rng, causal):
    """attention_backward is the gradient of sum(O * dO): central differences in float64, with
    row blocks smaller than the problem (the blocked path) and a K/V head shared by two heads."""
    n_k = 5 if causal else 6
    q, k, v, do = (rng.standard_normal(s) for s in [(1, 5, 2, 4), (1, n_k, 1, 4), (1, n_k, 1, 4),
                                                       (1, 5, 2, 4)])
    grads = reference.attention_backward(q, k, v, do, causal=causal, block_rows=2)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for idx in [(0, 0, 0, 0), (0, 3, x.shape[2] - 1, 2), (0, x.shape[1] - 1, 0, 3)]:
            values = []
            for step in (eps, -eps):
                moved = x.copy()
                moved[idx] += step
                args = [moved if y is x else y for y in (q, k, v)]
                values.append((reference.attention(*args, causal=causal)[0] * do).sum())
            assert abs((values[0] - values[1]) / (2 * eps) - g[idx]) < 1e-6
