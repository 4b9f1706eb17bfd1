"""score_mod and mask_mod (common/tile/mods.py, common/host/mods.py): a user's functions compiled
into fa2's forward and backward kernels and fa3's forward (its backward runs fa2's), checked
against the float64 reference that applies the same functions (and differentiates score_mod by
central differences, so a wrong score_mod_grad fails too); each case also checks that the mods
moved the answer past the tolerance. The built-in masks and terms written as mods agree with the
built-ins; a learnable relative-bias table's gradient (atomics into aux) matches the
reference's; bad mods are refused by name."""
import math

import numpy as np
import pytest
from numba import float32

import variants
from common.hardware.elements import UNIT_ROUNDOFF
from common.host import mods
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU
from tests.test_backward import SMALL
from tests.test_varlen import SMALL_BACKWARD, packed
from variants import score_mods

FORWARD = {} if ON_GPU else dict(block_m=64, block_n=32, warps=2)
FA3_FORWARD = {} if ON_GPU else dict(block_n=64)
HEAD_DIM = 128 if ON_GPU else 64
# (N_q, N_k) of the simulated cases: ragged blocks at both ends, so that the functions meet the
# elements past the problem (which they must not be passed)
N = (1000, 1000) if ON_GPU else (70, 70)
DTYPE = "bfloat16"


def aux_of(name, rng, batch, heads, n):
    """Host aux arrays for each example (variants/score_mods.py's factories; three documents
    whose boundaries fall off the blocks' edges)."""
    make = {"alibi": score_mods.alibi_aux, "relative_bias": score_mods.relative_bias_aux,
            "document_mask": score_mods.document_aux, "prefix_lm": score_mods.prefix_aux,
            "sliding_window": score_mods.window_aux}.get(name)
    return () if make is None else make(rng, batch, heads, n, n)


# (score_mod, score_mod_grad, mask_mod, built-in mask keywords beside them)
EXAMPLES = {
    "alibi": (score_mods.alibi, score_mods.unchanged_grad, None, {}),
    "relative_bias": (score_mods.relative_bias, score_mods.relative_bias_grad, None,
                      dict(causal=True)),
    "tanh_softcap": (score_mods.tanh_softcap, score_mods.tanh_softcap_grad, None, {}),
    "document_mask": (None, None, score_mods.document_mask, dict(causal=True)),
    "prefix_lm": (None, None, score_mods.prefix_lm, {}),
    "dilated": (None, None, score_mods.dilated, {}),
    "sliding_window": (None, None, score_mods.sliding_window, {}),
    "alibi_and_documents": (score_mods.alibi, score_mods.unchanged_grad,
                            score_mods.document_mask, {}),
}


def run(rng, name, heads=2, heads_kv=1, batch=2 if ON_GPU else 1, variant="fa2", backward=True):
    score_mod, score_grad, mask_mod, mask = EXAMPLES[name]
    n_q, n_k = N
    q, k, v = inputs.random_qkv(rng, batch, n_q, heads, HEAD_DIM, DTYPE, seqlen_k=n_k,
                                heads_kv=heads_kv)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    aux_name = "document_mask" if name == "alibi_and_documents" else name
    host_aux = aux_of(aux_name, rng, batch, heads, n_k)
    if name == "alibi_and_documents":
        host_aux = aux_of("alibi", rng, batch, heads, n_k)
        docs = aux_of("document_mask", rng, batch, heads, n_k)[0]
        host_aux = host_aux + (docs,)
        mask_mod = score_mods.document_mask_beside_slopes
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v, do)]
    aux = tuple(inputs.to_device(x, library) for x in host_aux)
    fns = dict(score_mod=score_mod, mask_mod=mask_mod)
    o, lse = variants.forward(*dev[:3], variant=variant, **mask, **fns, aux=aux,
                              **(FORWARD if variant == "fa2" else FA3_FORWARD))
    where = f"{variant} {name} {mask}"
    checks.assert_moved_forward(inputs.to_host(o), inputs.to_host(lse),
                                reference.attention(q, k, v, **mask, **fns, aux=host_aux),
                                reference.attention(q, k, v, **mask), DTYPE, where, "the mods")
    if not backward:
        return aux, host_aux, None

    grads = variants.backward(dev[3], *dev[:3], o, lse, variant=variant, **mask, **fns,
                              score_mod_grad=score_grad, aux=aux, **SMALL["fa2"])
    ref = reference.attention_backward(q, k, v, do, **mask, **fns, aux=host_aux,
                                       return_ds=True)
    errors = checks.compare_gradients([inputs.to_host(x) for x in grads[:3]], ref[:3], DTYPE)
    assert errors["ok"], f"backward {where}: " + ", ".join(f"{g} {errors[g]:.2e}"
                                                           for g in ("dq", "dk", "dv"))
    return aux, host_aux, ref[-1]


# In the simulator the masks that the block-mask and packed tests run too are left to the GPU
SIMULATED = [n for n in EXAMPLES if ON_GPU or n not in ("prefix_lm", "dilated", "sliding_window")]


@pytest.mark.parametrize("name", SIMULATED)
def test_example_forward_backward(rng, name):
    aux, host_aux, ds = run(rng, name)
    if name == "relative_bias":   # the table's gradient: each bucket's sum of dS
        table = host_aux[0]
        radius = (table.shape[1] - 1) // 2
        n_q, n_k = N
        rel = np.clip(np.arange(n_k)[None, :] - np.arange(n_q)[:, None], -radius, radius) + radius
        want = np.zeros_like(table, dtype=np.float64)
        size = np.zeros_like(want)   # each bucket's sum of |dS|: the scale of its rounding
        for bucket in range(table.shape[1]):
            want[:, bucket] = ds[:, :, rel == bucket].sum(axis=(0, 2))
            size[:, bucket] = np.abs(ds[:, :, rel == bucket]).sum(axis=(0, 2))
        got = inputs.to_host(aux[1]).astype(np.float64)
        # dS from bf16 inputs: a few units of roundoff of each term, summed
        bound = 8 * UNIT_ROUNDOFF[DTYPE] * size + 1e-6
        assert (np.abs(got - want) <= bound).all(), f"d table {got} vs {want}"
        assert (np.abs(want) > bound).any()   # a table left at zero would fail


# fa3's forward with the mods; its backward (FA2's kernels, fa3.backward_kernel) on the GPU, where
# every example runs; in the simulator two examples that together reach every path (a score_mod
# reading aux by head, a mask_mod by position, a table gathered by relative position)
FA3_EXAMPLES = list(EXAMPLES) if ON_GPU else ["alibi_and_documents", "relative_bias"]


@pytest.mark.parametrize("name", FA3_EXAMPLES)
def test_fa3_takes_the_mods(rng, name):
    run(rng, name, variant="fa3", backward=ON_GPU)


def test_mods_match_the_built_ins(rng):
    """ALiBi, a sliding window and a soft cap written as mods give the built-ins' answers within
    rounding (the mods' scores are scaled and unscaled around the function)."""
    n_q, n_k = N
    heads = 2
    q, k, v = inputs.random_qkv(rng, 1, n_q, heads, HEAD_DIM, DTYPE, seqlen_k=n_k)
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v)]
    slopes = inputs.alibi_slopes(heads).astype(np.float32)
    window = np.array([n_k // 4], np.int32)
    pairs = [(dict(alibi_slopes=inputs.to_device(slopes, library)),
              dict(score_mod=score_mods.alibi, aux=(inputs.to_device(slopes, library),))),
             (dict(causal=True, window_size=(int(window[0]) - 1, 0)),
              dict(mask_mod=score_mods.sliding_window, aux=(inputs.to_device(window, library),))),
             (dict(softcap=30.0), dict(score_mod=score_mods.tanh_softcap))]
    for built_in, as_mod in pairs:
        o1, lse1 = variants.forward(*dev, variant="fa2", **built_in, **FORWARD)
        o2, lse2 = variants.forward(*dev, variant="fa2", **as_mod, **FORWARD)
        o1, o2 = (inputs.to_host(x).astype(np.float32) for x in (o1, o2))
        lse1, lse2 = inputs.to_host(lse1), inputs.to_host(lse2)
        assert np.abs(lse1 - lse2).max() <= 1e-4 * max(1.0, np.abs(lse1).max()), built_in
        assert np.abs(o1 - o2).max() <= 2 * 2.0 ** -8 * np.abs(o1).max(), built_in


@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_packed_batch_positions_are_each_sequences(rng, variant):
    """A packed batch: b is the sequence, q_idx and kv_idx count from its first row (prefix_lm's
    prefix per sequence), forward and backward against each sequence alone (fa3 in the
    simulator: the forward; its backward is fa2's kernels, checked with fa2's)."""
    lengths = [(17, 40), (0, 5), (33, 33), (9, 0), (30, 30)]
    heads, heads_kv, dtype = 2, 1, DTYPE
    q, k, v, cu_q, cu_k = packed(rng, lengths, heads, heads_kv, 64, dtype)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    prefix = np.array([5, 1, 10, 2, 7], np.int32)
    library = inputs.default_library()
    dq_, dk_, dv_, ddo, dcq, dck, dpre = (inputs.to_device(x, library)
                                          for x in (q, k, v, do, cu_q, cu_k, prefix))
    max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    fns = dict(score_mod=score_mods.alibi, mask_mod=_prefix_in_aux1,
               aux=(inputs.to_device(np.array([0.5, 0.25], np.float32), library), dpre))
    o, lse = variants.forward_varlen(dq_, dk_, dv_, dcq, dck, max_q, max_k, variant=variant,
                                     **fns, **(FORWARD if variant == "fa2" else FA3_FORWARD))
    backward = variant == "fa2" or ON_GPU
    if backward:
        grads = variants.backward_varlen(ddo, dq_, dk_, dv_, o, lse, dcq, dck, max_q, max_k,
                                         variant=variant, score_mod_grad=score_mods.unchanged_grad,
                                         **fns, **SMALL_BACKWARD)
        dq, dk, dv = (inputs.to_host(x).astype(np.float32) for x in grads[:3])
    o_h, lse_h = inputs.to_host(o), inputs.to_host(lse)
    host_aux = (np.array([0.5, 0.25], np.float32), prefix)
    for b, (n_q, n_k) in enumerate(lengths):
        if n_q == 0 or n_k == 0:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_fns = dict(score_mod=score_mods.alibi, mask_mod=_prefix_in_aux1, aux=host_aux,
                       batch_offset=b)
        ref_o, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys],
                                             **ref_fns)
        got = checks.compare(o_h[None, rows], lse_h[None, :, rows], ref_o, ref_lse, dtype)
        assert got["ok"], f"forward sequence {b}: " + checks.describe_failure(got)
        if not backward:
            continue
        ref = reference.attention_backward(q[None, rows], k[None, keys], v[None, keys],
                                           do[None, rows], **ref_fns)
        errors = checks.compare_gradients([dq[None, rows], dk[None, keys], dv[None, keys]],
                                          ref[:3], dtype)
        assert errors["ok"], f"backward sequence {b}: {errors}"


def _prefix_in_aux1(b, h, q_idx, kv_idx, aux):
    return kv_idx <= q_idx or kv_idx < aux[1][b]


def test_mods_by_dotted_name_and_one_kernel_per_function(rng):
    """A dotted name resolves to the function (a Hydra config's way); the same Python function
    twice makes one ScoreMods (one kernel), another function another."""
    a = mods.resolve(score_mod="variants.score_mods.alibi")
    b = mods.resolve(score_mod=score_mods.alibi)
    assert a == b and hash(a) == hash(b)
    assert mods.resolve(score_mod=score_mods.tanh_softcap) != a
    assert "variants.score_mods.alibi:" in repr(a)


def test_function_digest_follows_the_code():
    """The kernel cache keys a user's function by its code: an edit changes the key."""
    from common.host.kernel_cache import function_digest

    def one(score, b, h, q_idx, kv_idx, aux):
        return score + float32(1)

    def two(score, b, h, q_idx, kv_idx, aux):
        return score + float32(2)

    assert function_digest(one) != function_digest(two)
    assert function_digest(one) == function_digest(one)


def _bad_arity(score, b, h, q_idx, kv_idx):
    return score


def _returns_tuple(score, b, h, q_idx, kv_idx, aux):
    return score, score


def _mask_returns_number(b, h, q_idx, kv_idx, aux):
    return 1.5


def _fails(score, b, h, q_idx, kv_idx, aux):
    return score + aux[3][0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(score_mod=_bad_arity), "takes 5 arguments"),
    (dict(score_mod=_returns_tuple), "_returns_tuple"),
    (dict(mask_mod=_mask_returns_number), "must return a boolean"),
    (dict(score_mod=_fails), "_fails"),
    (dict(score_mod="variants.score_mods.no_such"), "names no function"),
    (dict(score_mod=42), "must be a function"),
    (dict(score_mod_grad=score_mods.unchanged_grad), "without score_mod"),
    (dict(aux=()), None),
])
def test_bad_mods_are_refused_by_name(rng, kwargs, match):
    q, k, v = (inputs.to_device(x, inputs.default_library()) for x in
               inputs.random_qkv(rng, 1, 16, 1, 64, DTYPE))
    if match is None:   # an empty aux alone is no mod: the plain kernel
        variants.forward(q, k, v, variant="fa2", **kwargs, **FORWARD)
        return
    with pytest.raises((TypeError, ValueError), match=match):
        variants.forward(q, k, v, variant="fa2", **kwargs, **FORWARD)


def test_backward_needs_score_mod_grad_and_other_variants_refuse(rng):
    library = inputs.default_library()
    q, k, v = (inputs.to_device(x, library) for x in inputs.random_qkv(rng, 1, 16, 1, 64, DTYPE))
    o, lse = variants.forward(q, k, v, variant="fa2", score_mod=score_mods.tanh_softcap,
                              **FORWARD)
    with pytest.raises(ValueError, match="needs its derivative"):
        variants.backward(o, q, k, v, o, lse, variant="fa2", score_mod=score_mods.tanh_softcap)
    for variant in ("standard", "fa1"):
        with pytest.raises(ValueError, match="takes no score_mod"):
            variants.forward(q, k, v, variant=variant, score_mod=score_mods.tanh_softcap)
    # fa3: no block masks yet, and its wgmma backward does not take the mods (FA2's kernels do)
    bm = variants.block_mask(score_mods.dilated, 16, 16, like=q)
    with pytest.raises(ValueError, match="block_mask: fa3"):
        variants.forward(q, k, v, variant="fa3", mask_mod=score_mods.dilated, block_mask=bm)
    with pytest.raises(ValueError, match="wgmma backward does not compile them"):
        variants.backward(o, q, k, v, o, lse, variant="fa3", kernel="wgmma",
                          score_mod=score_mods.tanh_softcap,
                          score_mod_grad=score_mods.tanh_softcap_grad)
    from variants import context_parallel, fa3
    assert fa3.backward_kernel(128, 0.0, None, True) == "fa2"      # fa3's backward with mods:
    assert fa3.backward_kernel(128, 0.0, None, False) == "wgmma"   # FA2's kernels
    # FP8 inputs take no mods (fa3's e4m3 path), nor does the context-parallel ring (each step
    # would pass its own part's positions)
    q8 = inputs.to_device(np.zeros((1, 16, 1, 128), np.uint8), library)
    ones = inputs.to_device(np.ones((1, 1, 1), np.float32), library)
    with pytest.raises(ValueError, match="not FP8"):
        variants.forward(q8, q8, q8, variant="fa3", q_descale=ones, k_descale=ones,
                         v_descale=ones, mask_mod=score_mods.dilated)
    with pytest.raises(NotImplementedError, match="mask_mod"):
        context_parallel.kernels("fa3", forward_options=dict(mask_mod=score_mods.dilated))
    with pytest.raises(ValueError, match="aux without"):
        variants.forward(q, k, v, variant="fa2", aux=(o,))
    assert math.isfinite(float(inputs.to_host(lse).max()))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_attention_autograd_takes_the_mods(rng, variant):
    """variants.attention (torch autograd, the door a model comes through) passes score_mod, its
    grad, mask_mod and aux to the variant's forward and backward (fa3's: FA2's kernels): its
    output matches the reference and its gradients are those of the direct calls (the same
    kernels: dK, dV bit for bit)."""
    torch = pytest.importorskip("torch")
    n, heads = 300, 2
    q, k, v = inputs.random_qkv(rng, 1, n, heads, 64, DTYPE)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    host_aux = score_mods.alibi_aux(rng, 1, heads, n, n) + score_mods.document_aux(rng, 1, heads,
                                                                                  n, n)
    dev = [inputs.to_device(x, "torch") for x in (q, k, v, do)]
    aux = tuple(inputs.to_device(x, "torch") for x in host_aux)
    fns = dict(score_mod=score_mods.alibi, mask_mod=score_mods.document_mask_beside_slopes)
    leaves = [x.clone().requires_grad_() for x in dev[:3]]
    o = variants.attention(*leaves, variant=variant, causal=True, **fns,
                           score_mod_grad=score_mods.unchanged_grad, aux=aux)
    o.backward(dev[3])
    ref = reference.attention(q, k, v, causal=True, **fns, aux=host_aux)
    o_direct, lse = variants.forward(*dev[:3], variant=variant, causal=True, **fns, aux=aux)
    got = checks.compare(inputs.to_host(o.detach()), inputs.to_host(lse), *ref, DTYPE)
    assert got["ok"], checks.describe_failure(got)
    assert torch.equal(o.detach(), o_direct)
    grads = variants.backward(dev[3], *dev[:3], o_direct, lse, variant=variant, causal=True, **fns,
                              score_mod_grad=score_mods.unchanged_grad, aux=aux)
    for leaf, g in zip(leaves[1:], grads[1:3]):   # dK, dV; dQ's atomics add in any order
        assert torch.equal(leaf.grad, g)
    dq = leaves[0].grad.float()
    assert (dq - grads[0].float()).abs().max() <= 2 ** -7 * grads[0].float().abs().max()
