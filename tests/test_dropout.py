"""Dropout on P (common/tile/dropout.py) in fa2's forward and backward: Philox against Random123's
known answers and the kernels' Philox against its NumPy model; the mask's statistics; the forward
and both backward paths (dQ by atomics, and the separate dQ kernel) against the float64 reference
that applies the mask `keep_mask` makes, dense and packed; and the errors. Each case also checks
that dropout moved the answer past the tolerance (a kernel that ignored the mask would fail)."""
import numpy as np
import pytest
from numba import cuda, uint32

import variants
from common.host import arrays
from common.tile import dropout, masks
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU
from tests.test_backward import SMALL
from tests.test_varlen import SMALL_BACKWARD, VARIANT_OPTIONS, packed

FORWARD = {} if ON_GPU else dict(block_m=64, block_n=32, warps=2)

# Random123's kat_vectors for philox4x32_10: (counter, key) -> output
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
    ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
    ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
     (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1)),
]


@pytest.mark.parametrize("counter, key, expected", KNOWN_ANSWERS)
def test_philox_model_known_answers(counter, key, expected):
    got = dropout.philox_numpy(*counter, *key, rounds=10)
    assert tuple(int(x) for x in got) == expected


@cuda.jit
def _philox_kernel(counters, key, out, out10):
    i = cuda.grid(1)
    if i < counters.shape[0]:
        c = (uint32(counters[i, 0]), uint32(counters[i, 1]), uint32(counters[i, 2]),
             uint32(counters[i, 3]))
        x = dropout.philox(c[0], c[1], c[2], c[3], key[0], key[1])
        y = dropout.philox_rounds(c[0], c[1], c[2], c[3], key[0], key[1], 10)
        for w in range(4):
            out[i, w] = x[w]
            out10[i, w] = y[w]


def test_philox_kernel_matches_model(rng):
    """The device function (the same source in the simulator and on the GPU) gives the model's
    numbers, at the kernels' 7 rounds and at 10 (Random123's known answers among them)."""
    counters = np.concatenate([np.array([c for c, _, _ in KNOWN_ANSWERS], np.uint32),
                               rng.integers(0, 1 << 32, (29, 4), dtype=np.uint64).astype(np.uint32)])
    for key in (np.array([0x12345678, 0x9abcdef0], np.uint32), np.zeros(2, np.uint32)):
        out = cuda.device_array((len(counters), 4), np.uint32)
        out10 = cuda.device_array((len(counters), 4), np.uint32)
        _philox_kernel[1, 32](cuda.to_device(counters), cuda.to_device(key), out, out10)
        for got, rounds in ((out, dropout.ROUNDS), (out10, 10)):
            want = np.stack(dropout.philox_numpy(*counters.T, *key, rounds=rounds), axis=1)
            np.testing.assert_array_equal(got.copy_to_host(), want)
    assert tuple(int(x) for x in out10.copy_to_host()[0]) == KNOWN_ANSWERS[0][2]   # key 0


def test_keep_mask_statistics():
    """Each element kept with probability round(256 (1 - p)) / 256, independently of its place
    (rows, columns, heads in the mask's 16-element groups all near it); another offset or seed
    another mask; the same three the same mask."""
    p, shape = 0.17, (2, 2, 160, 192)
    z = dropout.keep_mask(7, 4096, p, *shape)
    keep = dropout.threshold(p) / 256
    n = z.size
    assert abs(z.mean() - keep) < 4 * np.sqrt(keep * (1 - keep) / n)
    for axis_mean in (z.mean(axis=(0, 1, 3)), z.mean(axis=(0, 1, 2)), z.mean(axis=(2, 3))):
        m = z.size // axis_mean.size
        assert np.abs(axis_mean - keep).max() < 5 * np.sqrt(keep * (1 - keep) / m)
    # every byte position of a call (i mod 16, j mod 32 classes) is as likely kept
    classes = z.reshape(2, 2, 10, 16, 6, 32).mean(axis=(0, 1, 2, 4))
    assert np.abs(classes - keep).max() < 5 * np.sqrt(keep * (1 - keep) / (n // 512))
    np.testing.assert_array_equal(z, dropout.keep_mask(7, 4096, p, *shape))
    for other in (dropout.keep_mask(7, 4100, p, *shape), dropout.keep_mask(8, 4096, p, *shape)):
        agree = (other == z).mean()
        assert abs(agree - (keep ** 2 + (1 - keep) ** 2)) < 0.01


# (N_q, N_k, mask, heads, heads_kv, backward options): in the simulator each case exercises
# something the others do not; on the GPU the default tiles at awkward lengths.
CASES = [
    (70, 90, dict(causal=True), 2, 1, {}),                          # GQA, ragged, atomic dQ
    (64, 96, dict(window_size=(20, 8), align=masks.TOP_LEFT), 1, 1, dict(dq="separate")),
]
if ON_GPU:
    CASES += [(n_q, n_k, mask, 4, 2, opts)
              for n_q, n_k, mask in ((1000, 2048, dict(causal=True)), (2048, 2048, dict()),
                                     (777, 1500, dict(window_size=(256, 0))))
              for opts in ({}, dict(dq="separate"))]


@pytest.mark.parametrize("n_q, n_k, mask, heads, heads_kv, options", CASES,
                         ids=lambda x: str(x).replace(" ", ""))
def test_dropout_forward_backward(rng, n_q, n_k, mask, heads, heads_kv, options):
    head_dim = 128 if ON_GPU else 64
    batch, dtype, p, seed, offset = 2, "bfloat16", 0.3, 0x1234_5678_9abc, 8 * 2 ** 32 + 12
    q, k, v = inputs.random_qkv(rng, batch, n_q, heads, head_dim, dtype, seqlen_k=n_k,
                                heads_kv=heads_kv)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v, do)]
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    o = inputs.poison(arrays.empty(library, q.shape, dtype, like=dev[0]))
    lse = inputs.poison(arrays.empty(library, (batch, heads, n_q), "float32", like=dev[0]))
    variants.forward(*dev[:3], variant="fa2", out=(o, lse), **mask, **drop, **FORWARD)
    z = dropout.keep_mask(seed, offset, p, batch, heads, n_q, n_k)
    ref_drop = dict(dropout_p=p, dropout_mask=z)
    where = f"N_q={n_q} N_k={n_k} {mask} {options}"
    checks.assert_moved_forward(inputs.to_host(o), inputs.to_host(lse),
                                reference.attention(q, k, v, **mask, **ref_drop),
                                reference.attention(q, k, v, **mask), dtype, where, "dropout")

    grads = variants.backward(dev[3], *dev[:3], o, lse, variant="fa2", **mask, **drop,
                              **dict(SMALL["fa2"], **options))
    ref = reference.attention_backward(q, k, v, do, **mask, **ref_drop)
    errors = checks.compare_gradients([inputs.to_host(x) for x in grads], ref, dtype)
    assert errors["ok"], f"backward {where}: " + ", ".join(f"{g} {errors[g]:.2e}"
                                                           for g in ("dq", "dk", "dv"))
    # another offset is another mask: the gradients of this one's forward no longer match
    other = variants.backward(dev[3], *dev[:3], o, lse, variant="fa2", **mask,
                              **dict(drop, dropout_offset=offset + 4), **dict(SMALL["fa2"], **options))
    errors = checks.compare_gradients([inputs.to_host(x) for x in other], ref, dtype)
    assert not errors["ok"], f"{where}: the backward ignored the offset"


def test_dropout_packed(rng):
    """A packed batch: sequence b's mask is keep_mask's batch b over its own rows and keys, the
    column groups of the longest key sequence."""
    lengths = [(17, 40), (0, 5), (33, 12), (9, 0), (30, 30)]
    heads, heads_kv, head_dim, dtype = 2, 1, 64, "bfloat16"
    p, seed, offset = 0.25, 99, 40
    q, k, v, cu_q, cu_k = packed(rng, lengths, heads, heads_kv, head_dim, dtype)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    library = inputs.default_library()
    dq_, dk_, dv_, ddo, dcq, dck = (inputs.to_device(x, library) for x in (q, k, v, do, cu_q, cu_k))
    mask, drop = dict(causal=True), dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    o, lse = variants.forward_varlen(dq_, dk_, dv_, dcq, dck, max_q, max_k, variant="fa2",
                                     **mask, **drop, **VARIANT_OPTIONS["fa2"])
    grads = variants.backward_varlen(ddo, dq_, dk_, dv_, o, lse, dcq, dck, max_q, max_k,
                                     variant="fa2", **mask, **drop, **SMALL_BACKWARD)
    z = dropout.keep_mask(seed, offset, p, len(lengths), heads, max_q, max_k)
    o_h, lse_h = inputs.to_host(o), inputs.to_host(lse)
    dq, dk, dv = (inputs.to_host(x).astype(np.float32) for x in grads)
    for b, (n_q, n_k) in enumerate(lengths):
        if n_q == 0 or n_k == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        where = f"sequence {b} (N_q={n_q}, N_k={n_k})"
        ref_drop = dict(dropout_p=p, dropout_mask=z[b:b + 1, :, :n_q, :n_k])
        ref_o, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], **mask,
                                             **ref_drop)
        got = checks.compare(o_h[None, rows], lse_h[None, :, rows], ref_o, ref_lse, dtype)
        assert got["ok"], f"{where}: " + checks.describe_failure(got)
        ref = reference.attention_backward(q[None, rows], k[None, keys], v[None, keys],
                                           do[None, rows], **mask, **ref_drop)
        errors = checks.compare_gradients([dq[None, rows], dk[None, keys], dv[None, keys]], ref,
                                          dtype)
        assert errors["ok"], f"{where}: {errors}"


@pytest.mark.parametrize("call, match", [
    (dict(variant="fa2", dropout_p=1.0), "dropout_p must be a probability"),
    (dict(variant="fa2", dropout_p=-0.1), "dropout_p must be a probability"),
    (dict(variant="fa2", dropout_p=0.1, dropout_seed=-1), "dropout_seed must be an integer"),
    (dict(variant="fa2", dropout_p=0.1, block_n=48, block_m=64, warps=2), "multiple of 16 \\(with dropout: 32"),
    (dict(variant="fa3", dropout_p=0.1), "fa3 has no dropout"),
])
def test_dropout_errors(rng, call, match):
    q, k, v = inputs.random_qkv(rng, 1, 32, 1, 64, "bfloat16")
    dev = [inputs.to_device(x, inputs.default_library()) for x in (q, k, v)]
    with pytest.raises(ValueError, match=match):
        variants.forward(*dev, **call)
