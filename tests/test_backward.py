"""Every variant's backward pass against float64 gradients, and the FlashAttention protocol on a GPU.

Gradients are poisoned with NaN before each launch, so an element a kernel does not write fails.
Bounds, with u the dtype's unit roundoff: relative L2 error of dq, dk, dv <= 2u and max error
<= 8u * max|reference| (a correct kernel measures ~0.6u: P and dS are rounded to the dtype once
before their products). In the simulator the shapes are small and fa2 runs a small tile (2 warps,
B_c = 32) so that the K/V loop, the query-block loop and ragged blocks all occur; on a GPU the
default tiles run at awkward and real lengths.
"""
import itertools

import numpy as np
import pytest

import variants
from common.host import arrays
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU

# The small tiles of the simulator (GPU: each variant's defaults).
SMALL = {"standard": {}, "fa1": {} if ON_GPU else dict(block_n=32, warps=2),
         "fa2": {} if ON_GPU else dict(block_m=64, block_n=32, warps=2, dq_block_m=32, dq_warps=2,
                                       dq_block_n=32)}
SMALL["fa3"] = {}   # fa3's own backward has one tile (B_r = 64, B_c = 128) in both
BACKWARD_VARIANTS = ["standard", "fa1", "fa2"]


def random_problem(rng, batch, seqlen, heads, head_dim, dtype, seqlen_k=None, heads_kv=None,
                   library=None):
    host = inputs.random_qkv(rng, batch, seqlen, heads, head_dim, dtype, seqlen_k=seqlen_k,
                             heads_kv=heads_kv)
    host += (rng.standard_normal(host[0].shape, dtype=np.float32).astype(host[0].dtype),)
    library = library or inputs.default_library()
    return host, tuple(inputs.to_device(x, library) for x in host), library


def backward_and_check(rng, variant, *, batch=1, seqlen, heads=1, head_dim=64, dtype="bfloat16",
                       causal, heads_kv=None, seqlen_k=None, softmax_scale=None,
                       forward_variant="fa2", small=True, **options):
    (q, k, v, do), dev, library = random_problem(rng, batch, seqlen, heads, head_dim, dtype,
                                                 seqlen_k, heads_kv)
    o, lse = variants.forward(*dev[:3], variant=forward_variant, causal=causal,
                              softmax_scale=softmax_scale)
    grads = tuple(inputs.poison(arrays.empty(library, x.shape, dtype, like=dev[0]))
                  for x in (q, k, v))
    options = dict(SMALL[variant] if small else {}, **options)   # small: the simulator's tiles
    got = variants.backward(dev[3], *dev[:3], o, lse, variant=variant, causal=causal,
                            softmax_scale=softmax_scale, grads=grads, **options)
    assert all(a is b for a, b in zip(got, grads))
    ref = reference.attention_backward(q, k, v, do, causal=causal, softmax_scale=softmax_scale)
    errors = checks.compare_gradients([inputs.to_host(x) for x in got], ref, dtype)
    u = checks.UNIT_ROUNDOFF[dtype]
    assert errors["ok"], f"{variant} {dtype} N={seqlen} d={head_dim} causal={causal} {options}: " \
        + ", ".join(f"{g} {errors[g]:.2e} ({errors[g] / u:.2f} u)" for g in ("dq", "dk", "dv"))
    return got


if ON_GPU:
    CASES = list(itertools.product([17, 130, 1000], [False, True], ["bfloat16", "float16"],
                                   [64, 128]))
else:
    # Both causal values and dtypes at d=64 and d=128 once; fa2's small tile makes 70 keys three
    # K/V blocks (the last ragged) and 70 queries two query blocks of each kernel.
    CASES = [(70, False, "bfloat16", 64), (40, True, "float16", 64), (17, True, "bfloat16", 64),
             (33, True, "bfloat16", 128)]


@pytest.mark.parametrize("variant, seqlen, causal, dtype, head_dim",
                         [(v, *c) if (v, *c) == ("fa2", 17, True, "bfloat16", 64)   # the quick loop's
                          else pytest.param(v, *c, marks=pytest.mark.slow)
                          for v in BACKWARD_VARIANTS + ["fa3"] for c in CASES
                          if ON_GPU or v == "fa2" or c[0] < 70])
def test_gradients_match_reference(rng, variant, seqlen, causal, dtype, head_dim):
    backward_and_check(rng, variant, seqlen=seqlen, causal=causal, dtype=dtype, head_dim=head_dim,
                       batch=2 if ON_GPU else 1, heads=3 if ON_GPU else 1)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["wgmma", "fa2"])
def test_fa3_forward_then_its_backward(rng, kernel):
    """fa3's forward, then its backward from its o and lse: its own kernel (wgmma), or FA2's
    (kernel="fa2", which takes fa2's options)."""
    options = dict(SMALL["fa2"], kernel="fa2") if kernel == "fa2" else {}
    backward_and_check(rng, "fa3", seqlen=40, causal=True, forward_variant="fa3", small=False,
                       **options)


# fa3's own backward (variants/fa3_backward.py: wgmma, TMA, a producer warp) on the shapes that
# exercise its schedule: ragged K/V and query blocks (70 keys: one block of 128; 70 queries: one of
# 128 at d=64, two of 64 with block_m=64), causal over two K/V blocks (the first sees every query
# block, the second skips the first and masks the diagonal ones), fp16, d=128 (B_r = 64: two
# 64-column panels a tile, dQ's columns split across the warpgroups; at d=64, B_r = 128: each
# warpgroup the dQ rows of its 64 queries), dQ's product deferred to the next step (dq_deferred),
# dV issued before dS or after (early_dv: d=128's default, not d=64's), K/V heads shared by two
# query heads, N_q != N_k with a custom scale, one stage, one consumer warpgroup (block_n=64).
FA3_SHAPES = [dict(seqlen=130, causal=True, dtype="float16"),
              dict(seqlen=150, causal=True, head_dim=128, early_dv=False),
              dict(seqlen=90, causal=False, heads=4, heads_kv=2, head_dim=128, dq_deferred=True),
              dict(seqlen=17, seqlen_k=150, causal=False, softmax_scale=0.37, stages=1),
              dict(seqlen=70, causal=True, block_n=64, block_m=64),
              dict(seqlen=130, causal=True, early_dv=True)]
if ON_GPU:
    FA3_SHAPES = [dict(shape, batch=2, seqlen=shape["seqlen"] * 7) for shape in FA3_SHAPES] + \
        [dict(seqlen=2048, heads=4, head_dim=d, causal=c, batch=2) for d in (64, 128)
         for c in (False, True)]


@pytest.mark.parametrize("shape", [dict(seqlen=70, causal=False)]
                         + [pytest.param(s, marks=pytest.mark.slow) for s in FA3_SHAPES],
                         ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_fa3_backward_shapes(rng, shape):
    backward_and_check(rng, "fa3", **shape)


# fa1's backward is fa2's kernel in another schedule: in the simulator the matrix above covers it.
SHAPE_VARIANTS = BACKWARD_VARIANTS if ON_GPU else ["standard", "fa2"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", SHAPE_VARIANTS)
def test_gradients_grouped_query_heads(rng, variant):
    """K/V heads shared by two query heads: dK, dV sum both heads' contributions. 70 queries are
    two query blocks of fa2's small tile, so a K/V block's steps wrap from one head's last query
    block to the next head's first (causal: past the skipped blocks)."""
    backward_and_check(rng, variant, batch=2 if ON_GPU else 1, seqlen=70 if variant == "fa2" else 40,
                       heads=2, heads_kv=1, causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", SHAPE_VARIANTS)
def test_gradients_rectangular_with_custom_scale(rng, variant):
    backward_and_check(rng, variant, seqlen=17, seqlen_k=90, dtype="float16", causal=False,
                       softmax_scale=0.37)


# fa2's backward options, each away from its default: tests/test_backward_options.py.


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_real_size(rng, head_dim, causal):
    backward_and_check(rng, "fa2", batch=2, seqlen=2048, heads=4, head_dim=head_dim, causal=causal)
    backward_and_check(rng, "fa2", batch=1, seqlen=2048, heads=2, head_dim=head_dim, causal=causal,
                       dq="separate")   # the other dQ path


@pytest.mark.gpu
def test_separate_dq_is_deterministic(rng):
    """dq="separate" has no atomics: two runs give the same bits."""
    _, dev, _ = random_problem(rng, 2, 1000, 4, 128, "bfloat16")
    o, lse = variants.forward(*dev[:3], causal=True)
    runs = [variants.backward(dev[3], *dev[:3], o, lse, causal=True, dq="separate")
            for _ in range(3)]
    for other in runs[1:]:
        for x, y in zip(runs[0], other):
            np.testing.assert_array_equal(inputs.to_host(x).view(np.uint16),
                                          inputs.to_host(y).view(np.uint16))


@pytest.mark.slow
def test_backward_profile_script_runs_both_dq_paths():
    """experiments/backward_profile.py (what ncu and compute-sanitizer run) launches both dQ paths,
    and they agree: the same gradients, summed in another order."""
    from experiments import backward_profile
    small = {k: v for k, v in SMALL["fa2"].items() if k != "dq"}
    grads = backward_profile.main(64, 40, True, repeats=1, batch=1, heads=1, **small)
    assert set(grads) == {"separate", "atomic"}
    for x, y in zip(grads["separate"], grads["atomic"]):
        x, y = inputs.to_host(x).astype(np.float32), inputs.to_host(y).astype(np.float32)
        assert np.isfinite(x).all()
        np.testing.assert_allclose(x, y, rtol=0, atol=2 ** -6 * np.abs(x).max())


# --------------------------------------------------------------------------- torch

def _plain_attention(torch, q, k, v, causal, upcast):
    """Standard attention in torch, (B, N, H, d) layout; upcast: in fp32 (the FlashAttention
    tests' reference), else every product in the inputs' dtype (the implementation to beat)."""
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(1), -torch.inf)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", BACKWARD_VARIANTS + ["fa3"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_protocol(rng, variant, head_dim, causal):
    """FlashAttention's test: the kernel's error against an fp32 reference is at most 3x that of a
    plain bf16 implementation, for O and for every gradient (through variants.attention)."""
    torch = pytest.importorskip("torch")
    (_, _, _, do_h), dev, _ = random_problem(rng, 2, 1024, 4, head_dim, "bfloat16", library="torch")
    q, k, v, do = dev
    results = {}
    for name in ("ours", "ref", "plain"):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        if name == "ours":
            o = variants.attention(*xs, variant=variant, causal=causal)
        else:
            o = _plain_attention(torch, *xs, causal=causal, upcast=name == "ref")
        o.backward(do.to(o.dtype))
        results[name] = [o.detach().float()] + [x.grad.float() for x in xs]
    for what, ours, ref, plain in zip(("o", "dq", "dk", "dv"), *results.values()):
        err, plain_err = (ours - ref).abs().max().item(), (plain - ref).abs().max().item()
        assert err <= 3 * plain_err + 1e-5, f"{variant} {what}: max error {err:.3e} vs plain " \
                                            f"bf16 {plain_err:.3e}"


@pytest.mark.gpu
def test_autograd_in_a_model(rng):
    """Drop-in use: a projection, attention and a loss; gradients reach the projection's weight."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(int(rng.integers(1 << 31)))
    x = torch.randn(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    proj = torch.nn.Linear(512, 3 * 512, device="cuda", dtype=torch.bfloat16)
    q, k, v = proj(x).view(2, 256, 3, 8, 64).unbind(2)
    o = variants.attention(q, k, v, variant="fa2", causal=True)
    o.float().square().mean().backward()
    assert proj.weight.grad is not None and torch.isfinite(proj.weight.grad).all()
    assert proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs", [dict(softcap=30.0, kernel="wgmma"), dict(kernel="mma")])
def test_fa3_backward_refuses_what_it_does_not_take(rng, kwargs):
    """fa3's own backward takes causal masks and sliding windows: asked for with a softcap, or
    an unknown kernel, it refuses by name."""
    _, dev, _ = random_problem(rng, 1, 40, 1, 64, "bfloat16")
    q, k, v, do = dev
    o, lse = variants.forward(q, k, v, variant="fa2", causal=True)
    message = "kernel must be one of" if "softcap" not in kwargs else "no softcap yet.*kernel='fa2'"
    with pytest.raises(ValueError, match=message):
        variants.backward(do, q, k, v, o, lse, variant="fa3", **dict(dict(causal=False), **kwargs))
