"""The score terms of fa2 and fa3 (common/host/problem.py: with_score_terms): ALiBi's bias by
distance (flash_attn's alibi_slopes, (H,) or (B, H)) and learnable attention sinks (gpt-oss: a
logit a head joining each row's softmax, with its gradient), forward and backward, dense and
packed, against the float64 reference that applies the same terms; each case also checks that the
terms moved the answer past the tolerance (a kernel that ignored them would fail); and the errors.
"""
import numpy as np
import pytest

import variants
from common.hardware.elements import UNIT_ROUNDOFF
from common.host import arrays
from common.tile import masks
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU
from tests.test_backward import SMALL
from tests.test_varlen import SMALL_BACKWARD, VARIANT_OPTIONS, packed

FORWARD = {"fa2": {} if ON_GPU else dict(block_m=64, block_n=32, warps=2),
           "fa3": {} if ON_GPU else dict(block_n=64)}

# (variant, N_q, N_k, mask, slopes per batch, sinks, heads, heads_kv): in the simulator each case
# exercises something the others do not; on the GPU the default tiles at awkward lengths.
CASES = [
    # bottom-right causal over fewer keys (rows that see no key: O = 0, LSE = the sink), GQA,
    # slopes per (batch, head), sinks
    ("fa2", 70, 50, dict(causal=True), True, True, 2, 1),
    # torch's top-left diagonal with a window on a rectangle: ALiBi's distance from that diagonal
    ("fa2", 50, 90, dict(window_size=(30, 8), align=masks.TOP_LEFT), False, False, 2, 2),
    # sinks alone, no mask; and ALiBi beside a softcap (the bias after the cap)
    ("fa2", 40, 40, dict(), False, True, 2, 1),
    ("fa2", 40, 60, dict(causal=True, softcap=2.0), False, False, 1, 1),
    # fa3: its forward and its own (wgmma) backward
    ("fa3", 70, 150, dict(causal=True), True, True, 2, 1),
]
if ON_GPU:
    CASES += [(v, n_q, n_k, mask, per_batch, True, 4, 2) for v in ("fa2", "fa3")
              for n_q, n_k, mask, per_batch in ((1000, 2048, dict(causal=True), True),
                                                (2048, 2048, dict(), False),
                                                (777, 1500, dict(window_size=(256, 0)), True),
                                                (512, 512, dict(causal=True, softcap=30.0), False))]


def score_terms(rng, batch, heads, per_batch, sinks):
    """Host slopes ((B, H) or (H,), ALiBi's geometric ones jittered) and sinks (H,), fp32."""
    slopes = (inputs.alibi_slopes(heads) * rng.uniform(0.5, 1.5, (batch, heads) if per_batch else heads))
    sink = rng.uniform(-1.0, 3.0, heads) if sinks else None
    return slopes.astype(np.float32), None if sink is None else sink.astype(np.float32)


@pytest.mark.parametrize("variant, n_q, n_k, mask, per_batch, sinks, heads, heads_kv", CASES,
                         ids=lambda x: str(x).replace(" ", ""))
def test_score_terms_forward_backward(rng, variant, n_q, n_k, mask, per_batch, sinks, heads,
                                      heads_kv):
    head_dim = 128 if ON_GPU else 64
    batch, dtype = 2, "bfloat16"
    q, k, v = inputs.random_qkv(rng, batch, n_q, heads, head_dim, dtype, seqlen_k=n_k,
                                heads_kv=heads_kv)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    slopes, sink = score_terms(rng, batch, heads, per_batch, sinks)
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v, do, slopes)]
    terms = dict(alibi_slopes=dev[4])
    ref_terms = dict(alibi_slopes=slopes)
    if sink is not None:
        terms["sinks"], ref_terms["sinks"] = inputs.to_device(sink, library), sink
    o = inputs.poison(arrays.empty(library, q.shape, dtype, like=dev[0]))
    lse = inputs.poison(arrays.empty(library, (batch, heads, n_q), "float32", like=dev[0]))
    variants.forward(*dev[:3], variant=variant, out=(o, lse), **mask, **terms,
                     **FORWARD[variant])
    ref_o, ref_lse = reference.attention(q, k, v, **mask, **ref_terms)
    where = f"{variant} N_q={n_q} N_k={n_k} {mask} sinks={sinks}"
    got = checks.compare(inputs.to_host(o), inputs.to_host(lse), ref_o, ref_lse, dtype)
    assert got["ok"], f"forward {where}: " + checks.describe_failure(got)
    plain = checks.compare(inputs.to_host(o), inputs.to_host(lse), *reference.attention(
        q, k, v, **mask), dtype)
    assert not plain["ok"], f"{where}: the terms did not move the output past the tolerance"

    grads = variants.backward(dev[3], *dev[:3], o, lse, variant=variant, **mask, **terms,
                              **SMALL[variant])
    ref = reference.attention_backward(q, k, v, do, **mask, **ref_terms)
    errors = checks.compare_gradients([inputs.to_host(x) for x in grads[:3]], ref[:3], dtype)
    assert errors["ok"], f"backward {where}: " + ", ".join(f"{g} {errors[g]:.2e}"
                                                           for g in ("dq", "dk", "dv"))
    assert len(grads) == (4 if sinks else 3)
    if sinks:
        check_sink_grad(inputs.to_host(grads[3]), ref[3], dtype, where)


def check_sink_grad(got, ref, dtype, where):
    """d sinks against float64: D = rowsum(dO o O) is taken from the rounded O, so the error is
    some units of roundoff of its largest entry."""
    got = np.asarray(got, np.float64)
    assert got.shape == ref.shape and np.isfinite(got).all(), where
    bound = 4 * UNIT_ROUNDOFF[dtype] * max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() <= bound, f"d sinks {where}: {got} vs {ref}"


@pytest.mark.parametrize("variant", ["fa2"] + (["fa3"] if ON_GPU else []))
def test_score_terms_packed(rng, variant):
    """A packed batch: each sequence's slopes row, its own diagonal (bottom-right of each
    sequence), the sinks; forward and backward against each sequence alone."""
    lengths = [(17, 40), (0, 5), (33, 12), (9, 0), (30, 30)]
    heads, heads_kv, head_dim, dtype = 2, 1, 64, "bfloat16"
    q, k, v, cu_q, cu_k = packed(rng, lengths, heads, heads_kv, head_dim, dtype)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    slopes, sink = score_terms(rng, len(lengths), heads, True, True)
    library = inputs.default_library()
    dq_, dk_, dv_, ddo, dcq, dck, ds, dsk = (inputs.to_device(x, library)
                                             for x in (q, k, v, do, cu_q, cu_k, slopes, sink))
    mask = dict(causal=True)
    max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    o, lse = variants.forward_varlen(dq_, dk_, dv_, dcq, dck, max_q, max_k, variant=variant,
                                     alibi_slopes=ds, sinks=dsk, **mask,
                                     **VARIANT_OPTIONS[variant])
    small = SMALL_BACKWARD if variant == "fa2" else {}
    grads = variants.backward_varlen(ddo, dq_, dk_, dv_, o, lse, dcq, dck, max_q, max_k,
                                     variant=variant, alibi_slopes=ds, sinks=dsk, **mask, **small)
    o_h, lse_h = inputs.to_host(o), inputs.to_host(lse)
    dq, dk, dv = (inputs.to_host(x).astype(np.float32) for x in grads[:3])
    d_sinks = np.zeros(heads)
    for b, (n_q, n_k) in enumerate(lengths):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        where = f"{variant} sequence {b} (N_q={n_q}, N_k={n_k})"
        if n_q == 0 or n_k == 0:
            continue
        terms = dict(alibi_slopes=slopes[b], sinks=sink)
        ref_o, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], **mask,
                                             **terms)
        got = checks.compare(o_h[None, rows], lse_h[None, :, rows], ref_o, ref_lse, dtype)
        assert got["ok"], f"{where}: " + checks.describe_failure(got)
        ref = reference.attention_backward(q[None, rows], k[None, keys], v[None, keys],
                                           do[None, rows], **mask, **terms)
        errors = checks.compare_gradients([dq[None, rows], dk[None, keys], dv[None, keys]],
                                          ref[:3], dtype)
        assert errors["ok"], f"{where}: {errors}"
        d_sinks += ref[3]
    # sequences with keys only (a sequence of no key has no row that reaches the kernels' sum
    # with a finite share: its rows' LSE is the sink's own, and D = 0 there)
    check_sink_grad(inputs.to_host(grads[3]), d_sinks, dtype, variant)


def test_score_term_errors(rng):
    """Bad slopes and sinks are refused by name before any launch; the variants without the terms
    refuse them as keywords; FP8 refuses them by name."""
    q, k, v = inputs.random_qkv(rng, 2, 16, 4, 64, "bfloat16")
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v)]

    def call(**terms):
        return variants.forward(*dev, variant="fa2", **terms)

    bad = [(dict(alibi_slopes=np.ones(4, np.float32)), TypeError, "host"),
           (dict(alibi_slopes=inputs.to_device(np.ones(3, np.float32), library)), ValueError,
            r"alibi_slopes must be a contiguous float32 array of shape \(4,\) or \(2, 4\)"),
           (dict(alibi_slopes=inputs.to_device(np.ones(4, np.float64), library)), ValueError,
            "float32"),
           (dict(sinks=inputs.to_device(np.ones((2, 4), np.float32), library)), ValueError,
            r"sinks must be a contiguous float32 array of shape \(4,\)"),
           (dict(sinks=inputs.to_device(np.ones(4, np.float32), library), softmax_scale=0.0),
            ValueError, "softmax_scale != 0")]
    for terms, error, match in bad:
        with pytest.raises(error, match=match):
            call(**terms)
    slopes = inputs.to_device(np.ones(4, np.float32), library)
    for variant in ("fa1", "standard"):   # fa1's options or standard's signature name it
        with pytest.raises((TypeError, ValueError), match="alibi_slopes"):
            variants.forward(*dev, variant=variant, alibi_slopes=slopes)
    from variants import fa3
    with pytest.raises(ValueError, match="FP8 takes no alibi_slopes or sinks"):
        fa3.default_config(128, "bfloat16", False, (("fp8", True), ("alibi", True)))


def test_flash_attn_functions_take_the_terms(rng):
    """flash_attn_func's alibi_slopes and FA4's learnable_sink reach the kernels (the same bits as
    variants.forward's call)."""
    from variants.flash_attn import flash_attn_func
    q, k, v = inputs.random_qkv(rng, 1, 40, 2, 64, "bfloat16", seqlen_k=40)
    slopes, sink = score_terms(rng, 1, 2, False, True)
    library = inputs.default_library()
    dq_, dk_, dv_, ds, dsk = (inputs.to_device(x, library) for x in (q, k, v, slopes, sink))
    o, lse, _ = flash_attn_func(dq_, dk_, dv_, causal=True, alibi_slopes=ds, learnable_sink=dsk,
                                return_attn_probs=True, variant="fa2")
    o2, lse2 = variants.forward(dq_, dk_, dv_, variant="fa2", causal=True, alibi_slopes=ds,
                                sinks=dsk)
    assert np.array_equal(inputs.to_host(o), inputs.to_host(o2))
    assert np.array_equal(inputs.to_host(lse), inputs.to_host(lse2))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_autograd_learns_the_sinks(rng, variant):
    """variants.attention with sinks (a leaf tensor): the gradients of q, k, v and the sinks are the
    float64 ones, and the sinks' arrives in their own dtype."""
    import torch
    q, k, v = inputs.random_qkv(rng, 2, 300, 4, 128, "bfloat16", seqlen_k=500, heads_kv=2)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    slopes, sink = score_terms(rng, 2, 4, True, True)
    tq, tk, tv = (inputs.to_device(x, "torch").requires_grad_() for x in (q, k, v))
    ts = torch.tensor(sink, device="cuda", requires_grad=True)
    o = variants.attention(tq, tk, tv, variant=variant, causal=True, sinks=ts,
                           alibi_slopes=torch.tensor(slopes, device="cuda"))
    o.backward(inputs.to_device(do, "torch"))
    ref = reference.attention_backward(q, k, v, do, causal=True, alibi_slopes=slopes, sinks=sink)
    errors = checks.compare_gradients([x.grad.float().cpu().numpy() for x in (tq, tk, tv)],
                                      ref[:3], "bfloat16")
    assert errors["ok"], errors
    assert ts.grad.dtype == torch.float32
    check_sink_grad(ts.grad.cpu().numpy(), ref[3], "bfloat16", variant)


def test_empty_problems_with_sinks(rng):
    """A problem with no key (dense N_k = 0, or a packed batch whose key sequences are all empty)
    launches nothing: O = 0, each row's LSE the sink of its head (the one logit it sees), zero
    gradients and a zero d sinks."""
    library = inputs.default_library()
    sink = np.array([0.5, -1.25], np.float32)
    dsink = inputs.to_device(sink, library)
    q = inputs.to_device(rng.standard_normal((2, 5, 2, 64)).astype(inputs.DTYPES["bfloat16"]),
                         library)
    kv = inputs.to_device(np.zeros((2, 0, 1, 64), inputs.DTYPES["bfloat16"]), library)
    o, lse = variants.forward(q, kv, kv, variant="fa2", sinks=dsink)
    assert not inputs.to_host(o).astype(np.float32).any()
    assert np.array_equal(inputs.to_host(lse), np.broadcast_to(sink[None, :, None], (2, 2, 5)))
    grads = variants.backward(q, q, kv, kv, o, lse, variant="fa2", sinks=dsink)
    assert len(grads) == 4 and not inputs.to_host(grads[3]).any()
    cu_q = inputs.to_device(np.array([0, 3, 5], np.int32), library)
    cu_k = inputs.to_device(np.array([0, 0, 0], np.int32), library)
    o, lse = variants.forward_varlen(q[0], kv[0], kv[0], cu_q, cu_k, 3, 0, variant="fa2",
                                     sinks=dsink)
    assert np.array_equal(inputs.to_host(lse), np.broadcast_to(sink[:, None], (2, 5)))


def test_score_terms_refused_where_they_would_be_wrong(rng):
    """The context-parallel ring refuses the terms by name (each step sees a part of the keys);
    an empty problem checks its sinks as a launch would."""
    from variants import context_parallel
    for options in (dict(forward_options={"sinks": 1}), dict(backward_options={"alibi_slopes": 1})):
        with pytest.raises(NotImplementedError, match="context-parallel ring"):
            context_parallel.kernels("fa2", **options)
    library = inputs.default_library()
    q = inputs.to_device(np.zeros((1, 4, 2, 64), inputs.DTYPES["bfloat16"]), library)
    kv = inputs.to_device(np.zeros((1, 0, 2, 64), inputs.DTYPES["bfloat16"]), library)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous float32 array of shape \(2,\)"):
        variants.forward(q, kv, kv, variant="fa2",
                         sinks=inputs.to_device(np.zeros(3, np.float32), library))
