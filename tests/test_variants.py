"""Every variant against the float64 reference: awkward lengths, causal and not, fp16 and bf16.

Outputs are poisoned with NaN before each launch, so an element a kernel does not write fails.
In the simulator (CI) the shapes are small: the full product of seqlen x causal x dtype at
head_dim 64 in a pairwise-covering set, plus head_dim 128 cases (each warp-collective instruction is a
barrier of Python threads in the simulator). On a GPU the full product runs, at these lengths and at
real ones.
"""
import itertools

import numpy as np
import pytest
from numba import cuda

import variants
from common.host import arrays
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU

VARIANTS = list(variants.REGISTRY)
AWKWARD = [1, 17, 97, 130]
DTYPES = ["bfloat16", "float16"]

if ON_GPU:
    CASES = list(itertools.product(AWKWARD + [1000, 2048], [False, True], DTYPES, [64, 128]))
    BATCH, HEADS = 2, 3
else:
    # A pairwise-covering set: every (seqlen, causal), (seqlen, dtype) and (causal, dtype) pair
    # appears at head_dim 64, and head_dim 128 meets both causal values, both dtypes, a one-block,
    # a ragged two-block and a ragged three-block length. (The full product is the GPU's job: a
    # simulated N=130 case costs 2-12 s.)
    CASES = [(1, False, "bfloat16", 64), (1, True, "float16", 64),
             (17, False, "float16", 64), (17, True, "bfloat16", 64),
             (97, False, "bfloat16", 64), (97, True, "float16", 64),
             (130, False, "float16", 64), (130, True, "bfloat16", 64),
             (1, False, "float16", 128), (97, False, "bfloat16", 128), (130, True, "float16", 128)]
    BATCH, HEADS = 1, 1


def run_and_check(rng, variant, *, batch, seqlen, heads, head_dim, dtype, causal, heads_kv=None,
                  seqlen_k=None, softmax_scale=None, library=None, **options):
    q, k, v = inputs.random_qkv(rng, batch, seqlen, heads, head_dim, dtype, seqlen_k=seqlen_k,
                                heads_kv=heads_kv)
    library = library or inputs.default_library()
    dq, dk, dv = (inputs.to_device(x, library) for x in (q, k, v))
    o = inputs.poison(arrays.empty(library, q.shape, dtype, like=dq))
    lse = inputs.poison(arrays.empty(library, (batch, heads, seqlen), "float32", like=dq))
    result = variants.forward(dq, dk, dv, variant=variant, causal=causal,
                              softmax_scale=softmax_scale, out=(o, lse), **options)
    assert result[0] is o and result[1] is lse
    rows = np.arange(seqlen) if seqlen <= 512 else np.unique(rng.choice(seqlen, 512))
    ref = reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, rows=rows)
    got = checks.compare(inputs.to_host(o)[:, rows], inputs.to_host(lse)[:, :, rows], *ref, dtype)
    assert got["ok"], f"{variant} {dtype} N={seqlen} d={head_dim} causal={causal}: " \
                      + checks.describe_failure(got)
    return o, lse


# Every variant runs every case, in the simulator too (since common/hardware/_sim_block.py and wgmma landing
# at its wait, a simulated case takes 1-12 s; fa1, standard and fa3 used to leave some out), but
# standard's N=130 cases, which take 26-30 s each there (S and P through global memory, tile by
# tile): its ragged multi-tile path is the N=97 cases' too, and the GPU runs them all.
MATRIX = [(v, *case) for v in VARIANTS for case in CASES
          if ON_GPU or not (v == "standard" and case[0] == 130)]


# The quick loop (pytest -m "not slow") keeps one case per variant: N=17 (ragged), causal, bf16, d=64.
QUICK_CASE = (17, True, "bfloat16", 64)


@pytest.mark.parametrize("variant, seqlen, causal, dtype, head_dim",
                         [c if c[1:] == QUICK_CASE else pytest.param(*c, marks=pytest.mark.slow)
                          for c in MATRIX])
def test_matches_reference(rng, variant, seqlen, causal, dtype, head_dim):
    run_and_check(rng, variant, batch=BATCH, seqlen=seqlen, heads=HEADS, head_dim=head_dim,
                  dtype=dtype, causal=causal)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_grouped_query_heads_and_batch(rng, variant):
    run_and_check(rng, variant, batch=2, seqlen=33, heads=2, heads_kv=1, head_dim=64,
                  dtype="bfloat16", causal=True)


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_rectangular_with_custom_scale(rng, variant):
    run_and_check(rng, variant, batch=1, seqlen=17, seqlen_k=130, heads=1, head_dim=64,
                  dtype="float16", causal=False, softmax_scale=0.37)


# Each fa2 option is an ablation switch: every setting must still compute exact attention.
FA2_OPTIONS = [dict(pipeline=False), dict(kv_stages=1), dict(kv_stages=1, pipeline=False, block_n=32),
               dict(block_m=64), dict(block_m=32, warps=2), dict(p_in_registers=False),
               dict(swizzle=False, q_in_registers=False, p_in_registers=False),
               dict(head_dim=128, q_in_registers=True, block_m=64, kv_stages=1),
               dict(causal_skip=False, block_m=64)]   # rows 0-63 then also visit keys 64-127


@pytest.mark.slow
@pytest.mark.parametrize("options", FA2_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_fa2_options(rng, options):
    options = dict(options)
    head_dim = options.pop("head_dim", 64)
    run_and_check(rng, "fa2", batch=1, seqlen=97, heads=1, head_dim=head_dim, dtype="bfloat16",
                  causal=True, **options)


# fa1's switches are the rungs of the FA1 -> FA2 ladder; block_n=64 gives the ragged lengths several
# K/V blocks, so O, l and m make real round trips through HBM (outer_loop="kv").
FA1_OPTIONS = [dict(block_n=64), dict(block_n=64, q_splits=3, causal_skip=True),
               dict(block_n=64, outer_loop="q"), dict(block_n=64, outer_loop="q", causal_skip=True,
                                                      deferred_rescale=True),
               dict(block_n=64, deferred_rescale=True, q_splits=0), dict(block_m=32, block_n=64),
               dict(head_dim=128, block_n=64, outer_loop="q", deferred_rescale=True)]
# Both causal values on a GPU; in the simulator the one that exercises each setting.
FA1_CASES = (list(itertools.product(FA1_OPTIONS, [False, True])) if ON_GPU else
             [(o, c) for o, c in zip(FA1_OPTIONS, [False, True, True, True, False, True, False])])


@pytest.mark.slow
@pytest.mark.parametrize("options, causal", FA1_CASES,
                         ids=[",".join([f"{k}={v}" for k, v in o.items()] + [f"causal={c}"])
                              for o, c in FA1_CASES])
def test_fa1_options(rng, options, causal):
    options = dict(options)
    head_dim = options.pop("head_dim", 64)
    run_and_check(rng, "fa1", batch=1, seqlen=130 if ON_GPU else 97, heads=1, head_dim=head_dim,
                  dtype="float16", causal=causal, **options)


# fa3's switches: the ring's depth and wrap-around (B_c = 64 gives 4-7 K/V steps), one and three
# consumer warpgroups, the producer warp instead of a warpgroup (setmaxnreg=False), the
# intra-warpgroup overlap (off by default: its own loop) with and without ping-pong, ping-pong off,
# cp.async copies instead of TMA (by a producer warpgroup, and by a producer warp).
FA3_CASES = [(dict(block_n=64, stages=2), True),
             (dict(block_n=64, producer="cp_async"), True),
             (dict(block_n=64, producer="cp_async", setmaxnreg=False, intra_overlap=True), False),
             (dict(block_n=64, persistent=False), True),
             (dict(block_n=64, back_to_back=True), False),
             (dict(block_n=64, back_to_back=True, block_m=64), True),
             (dict(block_n=64, stages=1, setmaxnreg=False), False),
             (dict(block_n=64, intra_overlap=True), True),
             (dict(block_n=64, pingpong=False), True),
             (dict(block_n=64, stages=3, block_m=64), True)]
if ON_GPU:
    FA3_CASES += [(dict(block_m=64, block_n=256, stages=1), False),
                  (dict(block_n=64, stages=1, intra_overlap=True), True),
                  (dict(block_m=64, block_n=64, stages=4), True),
                  (dict(block_n=176), True),                 # FA3's own B_c at d=128
                  (dict(block_n=80, stages=3), False),
                  (dict(producer="cp_async"), False),
                  (dict(producer="cp_async", block_m=64, stages=3), True),
                  (dict(poly_exp2=2), True),   # half the exponentials on the FMA units
                  (dict(o_store="bulk"), False),   # O by bulk copies (simulated: test_fp8)
                  (dict(o_store="bulk", intra_overlap=True, block_m=64), True),
                  (dict(o_store="tma"), False),    # O by TMA tensor stores (simulated: test_fp8)
                  (dict(o_store="tma", producer="cp_async", block_m=64), True),
                  (dict(o_store="tma", persistent=False), True)]


@pytest.mark.parametrize("head_dim, o_store", [(40, "tma")] + ([(96, "tma"), (40, "bulk"), (96, "bulk")]
                                                               if ON_GPU else []))
def test_fa3_copy_engine_store_at_a_padded_head_dim(rng, head_dim, o_store):
    """O stored by the copy engine where the tile is wider than head_dim (40 in 64 columns, 96 in
    128): "bulk" copies 2 * head_dim bytes a row, "tma"'s tensor map clips the columns past d;
    the tile's zero columns are left out either way."""
    run_and_check(rng, "fa3", batch=1, seqlen=300, heads=2, head_dim=head_dim,
                  dtype="bfloat16", causal=True, o_store=o_store)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("intra_overlap", [False, True])
def test_fa3_three_consumer_warpgroups(rng, causal, intra_overlap):
    """B_r = 192 (three consumer warpgroups, 416 threads: 160 registers each) at head_dim 64, the
    ping-pong turn passed round the three."""
    run_and_check(rng, "fa3", batch=1, seqlen=450, heads=2, head_dim=64, dtype="bfloat16",
                  causal=causal, block_m=192, intra_overlap=intra_overlap)


@pytest.mark.parametrize("causal", [False, True])
def test_fa3_persistent_blocks_share_the_tiles(rng, monkeypatch, causal):
    """The persistent grid on a 3-SM machine: 3 blocks loop over 3 x 2 x 2 = 12 tiles (4 each, in
    snake order), the K/V ring's stages and phases and Q's room carried from tile to tile. Causal:
    8 work items (3, 3 and 2 a block), each a pair of a head's query blocks 2 and 0 or its middle
    block 1 alone (Config.work_items)."""
    from common.hardware import target
    monkeypatch.setattr(target, "multiprocessor_count", lambda: 3)
    run_and_check(rng, "fa3", batch=2, seqlen=130, heads=2, heads_kv=1,
                  head_dim=64, dtype="bfloat16", causal=causal, block_n=64, block_m=64)


def test_fa3_tile_dividers_match_integer_division(rng):
    """The tile scheduler's divisions by a multiply and a shift (fa3.divider, fa3.divmod_by, made
    once a block) against NumPy's: divisors from 1 to 2^31 - 1, dividends from 0 to 2^31 - 1 with
    those either side of the divisor's multiples (where a rounding error would show)."""
    from variants import fa3
    ds = np.array([1, 2, 3, 5, 7, 16, 31, 64, 100, 127, 255, 256, 257, 1000, 4097, 65537,
                   1_000_003, 2**30, 2**30 + 1, 2**31 - 1], np.int64)
    ns = np.concatenate([np.stack([np.zeros_like(ds), ds - 1, ds, ds + 1, 2 * ds - 1, 3 * ds,
                                   (2**31 - 1) // ds * ds, (2**31 - 1) // ds * ds - 1,
                                   np.full_like(ds, 2**31 - 1)], 1),
                         rng.integers(0, 2**31, (len(ds), 7))], 1)
    ns = np.minimum(ns, 2**31 - 1).astype(np.int32)

    @cuda.jit
    def divide(ds, ns, q, r):
        i, j = cuda.blockIdx.x, cuda.threadIdx.x
        q[i, j], r[i, j] = fa3.divmod_by(ns[i, j], fa3.divider(ds[i]))

    q, r = np.zeros_like(ns), np.zeros_like(ns)
    divide[len(ds), ns.shape[1]](ds.astype(np.int32), ns, q, r)
    np.testing.assert_array_equal(q, ns // ds[:, None])
    np.testing.assert_array_equal(r, ns % ds[:, None])


@pytest.mark.slow
@pytest.mark.parametrize("options, causal", FA3_CASES,
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items())
                         if isinstance(o, dict) else f"causal={o}")
@pytest.mark.parametrize("head_dim", [64, 128] if ON_GPU else [64])
def test_fa3_options(rng, options, causal, head_dim):
    run_and_check(rng, "fa3", batch=1, seqlen=450 if ON_GPU else 200, heads=2 if ON_GPU else 1,
                  heads_kv=1, head_dim=head_dim, dtype="bfloat16", causal=causal, **options)


@pytest.mark.gpu
@pytest.mark.parametrize("library", ["torch", "cupy", "numba"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_array_library(rng, variant, library):
    if library == "torch":
        pytest.importorskip("torch")
    o, lse = run_and_check(rng, variant, batch=2, seqlen=256, heads=2, head_dim=128,
                           dtype="bfloat16", causal=True, library=library)
    assert type(o).__module__.split(".")[0] == ("numba" if library == "numba" else library)


@pytest.mark.gpu
@pytest.mark.parametrize("seqlen, causal, dtype, head_dim",
                         list(itertools.product([4096], [False, True], DTYPES, [64, 128])))
@pytest.mark.parametrize("variant", VARIANTS)
def test_real_size_against_reference_and_sdpa(rng, variant, seqlen, causal, dtype, head_dim):
    """At the FA2 benchmark shape, our error against float64 is at most twice that of torch SDPA's
    FlashAttention-2 kernel on the same inputs (the FlashAttention repository's own criterion)."""
    torch = pytest.importorskip("torch")
    from experiments import peers
    batch, heads = 16384 // seqlen, 2048 // head_dim
    q, k, v = inputs.random_qkv(rng, batch, seqlen, heads, head_dim, dtype)
    tq, tk, tv = (inputs.to_device(x, "torch") for x in (q, k, v))
    o, _ = variants.forward(tq, tk, tv, variant=variant, causal=causal)
    o_sdpa = peers.forward_fn("sdpa_flash", causal, None, gqa=False)(tq, tk, tv)
    torch.cuda.synchronize()
    rows = np.unique(rng.choice(seqlen, 256))
    ref_o, ref_lse = reference.attention(q, k, v, causal=causal, rows=rows)
    ours = checks.compare(inputs.to_host(o)[:, rows], ref_lse, ref_o, ref_lse, dtype)
    theirs = checks.compare(inputs.to_host(o_sdpa)[:, rows], ref_lse, ref_o, ref_lse, dtype)
    assert ours["ok"], checks.describe_failure(ours)
    assert ours["rel_err"] <= 2 * theirs["rel_err"] + 1e-5, (ours, theirs)


@pytest.mark.gpu
def test_fa2_beyond_48kb_of_shared_memory(rng):
    """block_n=128 at head_dim 128 needs 80 KB of dynamic shared memory (the opt-in path)."""
    run_and_check(rng, "fa2", batch=2, seqlen=1000, heads=2, head_dim=128, dtype="bfloat16",
                  causal=False, block_n=128)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_bitwise_repeatable(rng, variant):
    """A race (a missing barrier, a read of a tile still being copied) shows up as run-to-run
    differences: the same inputs must give bitwise the same output every time."""
    q, k, v = (inputs.to_device(x, inputs.default_library())
               for x in inputs.random_qkv(rng, 2, 1000, 4, 128, "bfloat16"))
    first = inputs.to_host(variants.forward(q, k, v, variant=variant, causal=True)[0]).view(np.uint16)
    for _ in range(20):
        again = inputs.to_host(variants.forward(q, k, v, variant=variant, causal=True)[0])
        np.testing.assert_array_equal(again.view(np.uint16), first)
