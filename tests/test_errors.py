"""Bad input gets an error that names the problem, before any kernel runs."""
import numpy as np
import pytest

import variants
from common.host import arrays
from experiments.measure import inputs


def device(rng, shape=(1, 16, 2, 64), dtype="bfloat16", library=None):
    x = inputs.random_qkv(rng, *shape, dtype)[0]
    return inputs.to_device(x, library or inputs.default_library())


@pytest.fixture
def qkv(rng):
    return [device(rng) for _ in range(3)]


@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2"])
def test_host_arrays_are_refused(rng, variant):
    q = inputs.random_qkv(rng, 1, 16, 2, 64, "bfloat16")[0]
    with pytest.raises(TypeError, match="q is a host .NumPy. array"):
        variants.forward(q, q, q, variant=variant)


@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2"])
@pytest.mark.parametrize("make, error, message", [
    (lambda rng: [device(rng, (1, 16, 2, 36))] * 3, ValueError, "head_dim in .*, got 36"),
    (lambda rng: [device(rng, dtype="float32")] * 3, TypeError, "dtype float32"),
    (lambda rng: [device(rng), device(rng, dtype="float16"), device(rng, dtype="float16")],
     TypeError, "share one dtype"),
    (lambda rng: [device(rng), device(rng, (1, 16, 2, 64)), device(rng, (1, 17, 2, 64))],
     ValueError, "same shape"),
    (lambda rng: [device(rng), device(rng, (2, 16, 2, 64)), device(rng, (2, 16, 2, 64))],
     ValueError, "batch 1 but k, v have batch 2"),
    (lambda rng: [device(rng, (1, 16, 3, 64)), device(rng), device(rng)],
     ValueError, "3 heads, not a multiple"),
    (lambda rng: [device(rng, (1, 16, 2, 128)), device(rng), device(rng)],
     ValueError, "head_dim 128 but k, v have head_dim 64"),
])
def test_bad_shapes_and_dtypes(rng, variant, make, error, message):
    with pytest.raises(error, match=message):
        variants.forward(*make(rng), variant=variant)


@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2"])
def test_three_dimensional_input(rng, variant):
    q = device(rng)
    with pytest.raises(ValueError, match="must be 4-D"):
        variants.forward(q[0], q[0], q[0], variant=variant)


def test_head_dim_must_be_contiguous(rng):
    q = device(rng, (1, 16, 2, 128))
    strided = q[:, :, :, ::2]
    with pytest.raises(ValueError, match="contiguous along head_dim"):
        variants.forward(strided, strided, strided, variant="fa2")


def test_wrong_out_arrays(qkv):
    like = qkv[0]
    lib = arrays.describe(like).library
    lse = arrays.empty(lib, (1, 2, 16), "float32", like=like)
    bad_o = arrays.empty(lib, (1, 16, 2, 64), "float16", like=like)
    with pytest.raises(ValueError, match="out\\[0\\] must be bfloat16"):
        variants.forward(*qkv, variant="fa2", out=(bad_o, lse))


def test_unknown_variant_and_option(qkv):
    with pytest.raises(ValueError, match="unknown variant 'fa9'; registered: standard, fa1, fa2"):
        variants.get("fa9")
    with pytest.raises(ValueError, match="fa2 has no option blok_m"):
        variants.forward(*qkv, variant="fa2", blok_m=64)
    with pytest.raises(ValueError, match="block_m=48 must be a multiple of 16 \\* warps=64"):
        variants.forward(*qkv, variant="fa2", block_m=48)
    with pytest.raises(ValueError, match="min_blocks_per_sm must be 0 .no launch bounds."):
        variants.forward(*qkv, variant="fa2", min_blocks_per_sm=-1)


@pytest.mark.parametrize("options, message", [
    (dict(outer_loop="j"), "outer_loop must be 'kv' .Algorithm 1. or 'q'"),
    (dict(outer_loop="q", q_splits=2), "q_splits=2: .* only with outer_loop='kv'"),
    (dict(q_splits=-1), "q_splits=-1: a count"),
    (dict(block_n=96), "block_n=96 must be a multiple of 16 \\* warps=64"),
    (dict(block_m=24), "block_m=24 must be a multiple of 16"),
    (dict(warps=32), "64 threads of a row whole pairs of O's 64 columns"),
    (dict(block_n=1024), "need \\d+ bytes of shared memory, more than 232448"),
])
def test_fa1_bad_options(qkv, options, message):
    with pytest.raises(ValueError, match=message):
        variants.forward(*qkv, variant="fa1", **options)


def test_non_finite_scale(qkv):
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        variants.forward(*qkv, variant="fa2", softmax_scale=float("nan"))


@pytest.mark.parametrize("q_shape, k_shape", [((1, 0, 2, 64), (1, 16, 2, 64)),   # no query
                                              ((1, 16, 2, 64), (1, 0, 2, 64)),   # no key
                                              ((0, 16, 2, 64), (0, 16, 2, 64))],  # no sequence
                         ids=["no_query", "no_key", "no_batch"])
@pytest.mark.parametrize("variant", ["standard", "fa2"])
def test_an_empty_problem_returns_what_flash_attn_does(monkeypatch, variant, q_shape, k_shape):
    """Nothing to compute launches nothing (flash_attn's empty cases): O = 0 and LSE = -inf (rows
    that see no key), zero gradients; the packed form too (every key sequence empty)."""
    from variants import registry
    monkeypatch.setattr(registry, "get", lambda name: pytest.fail(f"{name} was called"))
    lib = inputs.default_library()
    dt = inputs.DTYPES["bfloat16"]
    q = inputs.to_device(np.ones(q_shape, dtype=dt), lib)
    k = inputs.to_device(np.ones(k_shape, dtype=dt), lib)
    o, lse = variants.forward(q, k, k, variant=variant, causal=True)
    assert inputs.to_host(o).shape == q_shape and (inputs.to_host(o).astype(np.float32) == 0).all()
    assert inputs.to_host(lse).shape == (q_shape[0], q_shape[2], q_shape[1])
    assert np.isneginf(inputs.to_host(lse)).all()
    grads = variants.backward(o, q, k, k, o, lse, variant=variant)
    for g, x in zip(grads, (q, k, k)):
        g = inputs.to_host(g)
        assert g.shape == tuple(x.shape) and (g.astype(np.float32) == 0).all()
    if q_shape[0]:   # the packed form: q (total_q, H, d), no key in any sequence
        cu_q = inputs.to_device(np.array([0, q_shape[1]], np.int32), lib)
        cu_k = inputs.to_device(np.array([0, k_shape[1]], np.int32), lib)
        o, lse = variants.forward_varlen(q[0], k[0], k[0], cu_q, cu_k, q_shape[1], k_shape[1],
                                         variant=variant)
        assert inputs.to_host(lse).shape == (q_shape[2], q_shape[1])
        assert (inputs.to_host(o).astype(np.float32) == 0).all()


@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2"])
def test_backward_bad_arguments(rng, qkv, variant):
    """The backward checks dO, o, lse and the gradients' arrays like the forward checks q, k, v."""
    q, k, v = qkv
    o = device(rng)
    lse = arrays.empty(inputs.default_library(), (1, 2, 16), "float32", like=q)
    with pytest.raises(ValueError, match="do must be bfloat16 of shape \\(1, 16, 2, 64\\)"):
        variants.backward(device(rng, (1, 17, 2, 64)), q, k, v, o, lse, variant=variant)
    with pytest.raises(ValueError, match="do must be bfloat16"):
        variants.backward(device(rng, dtype="float16"), q, k, v, o, lse, variant=variant)
    with pytest.raises(ValueError, match="out\\[1\\] must be float32 of shape \\(1, 2, 16\\)"):
        variants.backward(o, q, k, v, o, arrays.empty(inputs.default_library(), (1, 2, 15),
                                                      "float32", like=q), variant=variant)
    with pytest.raises(ValueError, match="dk must be bfloat16 of shape"):
        variants.backward(o, q, k, v, o, lse, variant=variant,
                          grads=(device(rng), device(rng, (1, 8, 2, 64)), device(rng)))


@pytest.mark.parametrize("variant, options, message", [
    ("fa2", dict(dq="sometimes"), "dq must be 'atomic' or 'separate'"),
    ("fa2", dict(dq_reduce="tma"), "dq_reduce must be 'bulk' or 'red'"),
    ("fa2", dict(block_m=128, block_n=256, warps=8), "bytes of shared memory, over the"),
    ("fa2", dict(kv_blocks="sequential", dq="separate"), "needs dq='atomic'"),
    ("fa2", dict(block_n=96), "multiple of 16 \\* \\(warps / query_warps\\)=64"),
    ("fa2", dict(query_warps=3), "query_warps must be 1, 2 or 4"),
    ("fa2", dict(block_m=192), "powers of two >= 16, got \\(96, 32\\)"),
    ("fa2", dict(q_in_registers=True), "fa2 backward has no option q_in_registers"),
    ("fa1", dict(dq="separate"), "fa1 backward has no option dq"),
    ("fa1", dict(swizzle=False), "dq_reduce='red' needs less"),   # an option fa1 takes
    ("standard", dict(block_n=64), "unexpected keyword"),
])
def test_backward_bad_options(rng, qkv, variant, options, message):
    q, k, v = qkv
    lse = arrays.empty(inputs.default_library(), (1, 2, 16), "float32", like=q)
    with pytest.raises((ValueError, TypeError), match=message):
        variants.backward(device(rng), q, k, v, device(rng), lse, variant=variant, **options)


@pytest.mark.parametrize("options, message", [
    (dict(block_m=96), "block_m=96 must be 64, 128 or 192"),
    (dict(block_n=88), "block_n=88 must be a multiple of 16"),
    (dict(block_n=48), "block_n=48 must be a multiple of 16 from 64 to 256"),
    (dict(stages=5), "stages must be 1 to 4"),
    (dict(block_m=192), "does not fit head_dim 128"),
    (dict(block_n=256, stages=2), "bytes of shared memory; the limit is"),
    (dict(pipeline=False), "fa3 has no option pipeline"),
    (dict(producer="bulk"), "producer must be one of \\('tma', 'cp_async'\\), got 'bulk'"),
    (dict(poly_exp2=17), "poly_exp2 must be 0 \\(off\\) to block_n / 8 = 16 .*got 17"),
    (dict(poly_exp2=-1), "poly_exp2 must be 0 \\(off\\) to block_n / 8 = 16 .*got -1"),
    (dict(o_store="dma"), "o_store must be one of \\('threads', 'bulk', 'tma'\\), got 'dma'"),
])
def test_fa3_bad_options(rng, options, message):
    q = device(rng, (1, 16, 2, 128))
    with pytest.raises(ValueError, match=message):
        variants.forward(q, q, q, variant="fa3", **options)


@pytest.mark.parametrize("o_store", ["bulk", "tma"])
def test_fa3_copy_engine_store_needs_its_room(rng, o_store):
    """At head_dim 256 O has no room of its own beside the ring (o_apart), which the copy engine's
    stores (o_store="bulk", "tma") stage into."""
    q = device(rng, (1, 16, 2, 256))
    with pytest.raises(ValueError, match=f"o_store='{o_store}' needs O's own staging room"):
        variants.forward(q, q, q, variant="fa3", o_store=o_store)


def test_fa3_tensor_store_refuses_a_packed_batch(rng):
    """o_store="tma" clips its boxes at the packed tensor's end only: in a packed batch (varlen)
    it would write over the next sequence's rows, so it is refused, by name."""
    q = device(rng, (1, 40, 2, 64))[0]   # (total rows, heads, d)
    cu = inputs.to_device(np.array([0, 17, 40], np.int32), inputs.default_library())
    with pytest.raises(ValueError, match="o_store='tma' .* packed batch"):
        variants.forward_varlen(q, q, q, cu, cu, 23, 23, variant="fa3", o_store="tma")
