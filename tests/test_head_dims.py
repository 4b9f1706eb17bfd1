"""standard, fa1, fa2 and fa3 at every head_dim the tile layer takes (multiples of 8 from 32 to
256), forward and backward, against float64 (issue 19).

The head dims take three layouts (common/tile/tiles.py): 64, 128 and 256 swizzled; the others padded
rows, with tile copies dealt out in row-major order where a row's 16-byte chunks do not divide the
threads (96: 12 chunks, 192: 24), and, in the backward's 2-D warp tiles, an odd number of n8 tiles
a warp at d = 144, 176, 208, 240 (tiles.gemm_ab's tail). A head_dim that is not a multiple of 16
runs in the tile of the next one (tiles.tile_columns: 40 in 48 padded columns, 56 in 64 swizzled)
whose last 8 columns the copies zero-fill and the stores leave out. Past 128 the forward takes 8
warps of one m16 tile each and the backward B_c = B_r = 64. In the simulator a few cases cover each
of those paths at small lengths (5-60 s each); on a GPU every head dim's forward runs (fa2), and
the backward at one head dim of each arrangement, causal and not, with GQA, at ragged and real
lengths.
"""
import itertools

import pytest

import variants
from common.tile import tiles
from tests.conftest import ON_GPU
from tests.test_backward import backward_and_check
from tests.test_variants import run_and_check
from tests.test_varlen import VARIANT_OPTIONS, check_packed_forward
from variants import fa1, fa2, fa2_backward

if ON_GPU:
    # bf16 at every head dim (fp16 changes only the mma and cvt opcodes: at 96 and 256); the
    # backward at one head dim of each of its arrangements (cold backward compiles take minutes)
    FORWARD = list(itertools.product(tiles.HEAD_DIMS, [17, 1000], [False, True], ["bfloat16"])) \
        + [(d, 1000, c, "float16") for d in (96, 256) for c in (False, True)]
    BACKWARD = list(itertools.product([32, 40, 56, 80, 96, 144, 160, 192, 200, 224, 256],
                                      [130, 1000],
                                      [False, True], ["bfloat16"])) + [(96, 1000, True, "float16")]
else:
    # padded rows and row-major copies (96), 32 (the narrowest), 256 (8 warps, swizzled); the quick
    # loop (-m "not slow") keeps the first forward case only
    slow = pytest.mark.slow
    FORWARD = [(32, 17, False, "float16"), pytest.param(96, 70, True, "bfloat16", marks=slow),
               pytest.param(256, 40, True, "bfloat16", marks=slow),
               pytest.param(56, 33, True, "bfloat16", marks=slow)]   # a zero column chunk a row
    # 96: padded 2-D warp tiles; 144: an odd n8 tail in dK_j, dV_j and dQ's slices; 160: four
    # warps across B_r (query_warps=4, d/4 slices); 40: 48 padded columns (copies dealt out, the
    # last chunk of a row zero-filled, dQ's fragments cut at 40)
    BACKWARD = [pytest.param(96, 40, True, "bfloat16", marks=slow),
                pytest.param(144, 40, False, "float16", marks=slow),
                pytest.param(160, 40, True, "bfloat16", marks=slow),
                pytest.param(40, 20, True, "bfloat16", marks=slow)]

# Grouped-query heads: 4 query heads on 2 K/V heads on a GPU; in the simulator 2 on 1, the fewest
# that still share a K/V head between two query heads (the simulator's cost grows with the thread
# blocks, one a head), the backward too (it took one head while the simulator's thread block polled).
HEADS, HEADS_KV = (4, 2) if ON_GPU else (2, 1)
BACKWARD_HEADS, BACKWARD_HEADS_KV = HEADS, HEADS_KV


@pytest.mark.parametrize("head_dim, seqlen, causal, dtype", FORWARD)
def test_forward_every_head_dim(rng, head_dim, seqlen, causal, dtype):
    run_and_check(rng, "fa2", batch=2 if ON_GPU else 1, seqlen=seqlen, heads=HEADS, heads_kv=HEADS_KV,
                  head_dim=head_dim, dtype=dtype, causal=causal)


@pytest.mark.parametrize("head_dim, seqlen, causal, dtype", BACKWARD)
def test_backward_every_head_dim(rng, head_dim, seqlen, causal, dtype):
    backward_and_check(rng, "fa2", batch=2 if ON_GPU else 1, seqlen=seqlen, heads=BACKWARD_HEADS,
                       heads_kv=BACKWARD_HEADS_KV, head_dim=head_dim, dtype=dtype, causal=causal,
                       small=False)


# fa3 at head_dim 256 (four 64-column panels a tile; O's 64 x 256 accumulator, 128 registers a
# thread; B_c = 80 so that two K/V stages fit beside Q, O staged in Q's room) and 192 (three
# panels, B_c = 112): their switches that change the schedule, and (GPU) the backward, which is
# FA2's past 128.
FA3_WIDE = [(256, 170, True, {}),
            (256, 150, False, dict(intra_overlap=True, pingpong=False, block_n=64)),
            (192, 150, True, {})]
if ON_GPU:
    FA3_WIDE += [(256, 1000, False, {}), (256, 2048, True, {}),
                 (256, 1000, True, dict(intra_overlap=True)),
                 (256, 1000, False, dict(block_m=64, block_n=96)),
                 (256, 1000, True, dict(stages=1, block_n=128)),
                 (192, 1000, False, {}), (192, 2048, True, {}),
                 (192, 1000, True, dict(intra_overlap=False, pingpong=True, block_n=96)),
                 (192, 1000, False, dict(stages=1, block_n=128))]


@pytest.mark.parametrize("head_dim, seqlen, causal, options", FA3_WIDE,
                         ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else str(x))
def test_fa3_wide_head_dims(rng, head_dim, seqlen, causal, options):
    run_and_check(rng, "fa3", batch=2 if ON_GPU else 1, seqlen=seqlen, heads=HEADS,
                  heads_kv=HEADS_KV, head_dim=head_dim, dtype="float16" if causal else "bfloat16",
                  causal=causal, **options)


# fa3 between its panel widths (Config.tile_dim): 96 in a 128-column tile, 40 in 64, 72 (S's
# k-steps stop at 80, the last half of one zeros), 160 in 192; the columns past d zero-filled by
# TMA past its tensor map's last column, or by cp.async (valid_cols), and left out of O's store.
FA3_PADDED = [(96, 70, True, {}), (40, 50, False, dict(producer="cp_async")), (72, 40, False, {})]
if ON_GPU:
    FA3_PADDED += [(96, 1000, False, {}), (96, 2048, True, {}),
                   (96, 1000, True, dict(producer="cp_async")), (96, 1000, False, dict(block_n=144)),
                   (40, 1000, True, {}), (80, 1000, False, {}), (120, 1000, True, {}),
                   (160, 1000, False, {}), (200, 1000, True, {})]


@pytest.mark.parametrize("head_dim, seqlen, causal, options", FA3_PADDED,
                         ids=lambda x: ",".join(f"{k}={v}" for k, v in x.items())
                         if isinstance(x, dict) else str(x))
def test_fa3_padded_head_dims(rng, head_dim, seqlen, causal, options):
    run_and_check(rng, "fa3", batch=2 if ON_GPU else 1, seqlen=seqlen, heads=HEADS,
                  heads_kv=HEADS_KV, head_dim=head_dim, dtype="bfloat16", causal=causal,
                  **options)


@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_varlen_at_a_padded_head_dim(rng, variant):
    """A packed batch at a head_dim whose tiles have zero columns (fa2: 40 in 48 columns; fa3: 96
    in 128, TMA's rows past a sequence's end being the next sequence's)."""
    lengths = [(100, 100), (1000, 517), (0, 7), (130, 1000)] if ON_GPU else \
        [(17, 40), (0, 5), (33, 12)]
    check_packed_forward(rng, variant, lengths, dict(causal=True), HEADS, HEADS_KV,
                         40 if variant == "fa2" else 96, VARIANT_OPTIONS[variant])


# fa3's own backward (variants/fa3_backward.py) between its panel widths: 96 in d=128's tile (B_r =
# 64, dQ's 128 accumulator columns split across the two warpgroups, 32 of them zeros), 40 in 64
# (B_r = 128), 72 (S^T's and dP^T's k-steps stop at 80); Q, K, V, dO zero-filled past d by TMA,
# dK, dV stored and dQ converted without the zero columns.
FA3_OWN_BACKWARD = [(96, 70, True), (40, 50, False)]
if ON_GPU:
    FA3_OWN_BACKWARD = [(96, 1000, False), (96, 2048, True), (40, 1000, True), (72, 1000, False),
                        (80, 130, True), (120, 1000, True)]


@pytest.mark.parametrize("head_dim, seqlen, causal", FA3_OWN_BACKWARD)
def test_fa3_own_backward_at_padded_head_dims(rng, head_dim, seqlen, causal):
    # (one head in the simulator: test_backward.py's fa3 shapes cover grouped heads)
    backward_and_check(rng, "fa3", batch=2 if ON_GPU else 1, seqlen=seqlen,
                       heads=HEADS if ON_GPU else 1, heads_kv=HEADS_KV if ON_GPU else 1,
                       head_dim=head_dim, dtype="bfloat16", causal=causal,
                       forward_variant="fa3", small=False, kernel="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [192, 256])
def test_fa3_wide_head_dims_train_through_fa2s_backward(rng, head_dim):
    """fa3's own backward takes d <= 128 (96 in d=128's tile): past 128 its backward is FA2's
    (kernel=None)."""
    backward_and_check(rng, "fa3", batch=2, seqlen=1000, heads=HEADS, heads_kv=HEADS_KV,
                       head_dim=head_dim, dtype="bfloat16", causal=True, forward_variant="fa3",
                       small=False)


@pytest.mark.parametrize("head_dim", tiles.HEAD_DIMS)
def test_every_head_dim_has_configurations_that_fit(head_dim):
    """The defaults of every head dim validate (shared memory within a thread block's, whole
    fragments, copies that split), causal or not, with and without a packed batch's dQ path; fa3's
    forward in the tile of whole panels (and its cp.async producer), fa1's packed backward."""
    from variants import fa3
    packed = (("varlen", True), ("bottom_right", True))
    for causal in (False, True):
        for producer in ("tma", "cp_async"):
            cfg = fa3.default_config(head_dim, "bfloat16", causal, producer=producer)
            assert cfg.tile_dim % 64 == 0 and head_dim <= cfg.tile_dim < head_dim + 64
        fa3.default_config(head_dim, "bfloat16", causal, packed)
        fa2_backward.default_backward_config(head_dim, "bfloat16", causal, packed,
                                             dq_reduce="red")
        fa1.default_backward_config(head_dim, "bfloat16", causal, packed, dq_reduce="red")
        cfg = fa2.default_config(head_dim, "bfloat16", causal)
        assert cfg.swizzle == tiles.swizzle_fits(tiles.tile_columns(head_dim))
        bwd = fa2_backward.default_backward_config(head_dim, "bfloat16", causal)
        fa2_backward.default_backward_config(head_dim, "bfloat16", causal, dq_reduce="red")
        fa2_backward.default_backward_config(head_dim, "bfloat16", causal, dq="separate")
        assert bwd.swizzle == tiles.swizzle_fits(tiles.tile_columns(head_dim))
        for outer_loop in ("kv", "q"):
            fa1.default_config(head_dim, "bfloat16", causal, outer_loop=outer_loop)
        fa1.default_backward_config(head_dim, "bfloat16", causal)


def test_tile_columns():
    assert [tiles.tile_columns(d) for d in (32, 40, 48, 56, 120, 248, 256)] == \
        [32, 48, 48, 64, 128, 256, 256]


@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2", "fa3"])
@pytest.mark.parametrize("head_dim", [8, 24, 44, 264, 512])
def test_other_head_dims_are_refused_by_name(rng, variant, head_dim):
    import numpy as np

    from experiments.measure import inputs
    q = inputs.to_device(rng.standard_normal((1, 16, 2, head_dim)).astype(np.float16),
                         inputs.default_library())
    with pytest.raises(ValueError, match=f"multiples of 8 from 32 to 256, got {head_dim}"):
        variants.forward(q, q, q, variant=variant)


# standard and fa1 (forward and backward; fa1's backward is fa2's kernel in FA1's schedule) on the
# same tile layer: a head_dim that is not a multiple of 16, padded rows of 12 chunks (96), and on a
# GPU 8 warps' worth (160) and the widest (256). In the simulator fa1's forward alone (its backward
# is fa2's kernel, whose padded tiles test_backward_every_head_dim covers at 40).
if ON_GPU:
    OTHERS = [(variant, d, n, c, True) for variant, d, n, c in itertools.product(
        ["standard", "fa1"], [40, 96, 160, 256], [130, 1000], [False, True])]
else:
    OTHERS = [pytest.param("standard", 40, 33, True, True, marks=slow),
              pytest.param("fa1", 72, 17, False, False, marks=slow)]


@pytest.mark.parametrize("variant, head_dim, seqlen, causal, backward", OTHERS)
def test_standard_and_fa1_every_head_dim(rng, variant, head_dim, seqlen, causal, backward):
    batch = 2 if ON_GPU else 1
    run_and_check(rng, variant, batch=batch, seqlen=seqlen, heads=HEADS, heads_kv=HEADS_KV,
                  head_dim=head_dim, dtype="bfloat16", causal=causal)
    if backward:
        backward_and_check(rng, variant, batch=batch, seqlen=seqlen, heads=BACKWARD_HEADS,
                           heads_kv=BACKWARD_HEADS_KV, head_dim=head_dim, dtype="bfloat16",
                           causal=causal, small=False)
