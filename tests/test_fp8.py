"""FP8 (e4m3) for fa3: the conversion instruction, the quantiser (per tensor, per block, with
incoherent processing), V made K-major, and fa3's FP8 forward against float64, with tolerances
derived from the format (variants/fp8.py: UNIT_ROUNDOFF). Simulator and GPU."""
import math

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, int32

import variants
from common.hardware import lanes as sem
from common.hardware import ptx
from experiments.measure import inputs
from tests.conftest import ON_GPU, compiled_in_a_subprocess
from variants import fp8

U = fp8.UNIT_ROUNDOFF
SUBNORMAL_HALF_STEP = 2.0 ** -10     # the largest rounding error below e4m3's smallest normal


# --------------------------------------------------------------------------- the conversion

@cuda.jit
def pack_kernel(x, out):
    i = int32(cuda.grid(1))
    if i < out.shape[0]:
        out[i] = ptx.pack_e4m3x4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3])


def test_pack_e4m3x4_rounds_and_saturates_like_ml_dtypes(rng):
    """cvt.rn.satfinite: nearest-even, +-448 past the range, NaN kept, byte order x0 lowest; the
    stand-in (ml_dtypes) and, on a GPU, the instruction, bit for bit."""
    edge = [0.0, -0.0, 1.0625, 1.1875, 448.0, 464.0, 1e6, -1e6, 2.0 ** -9, 2.0 ** -10,
            3 * 2.0 ** -11, 2.0 ** -6, np.nan, -3.3, 0.1, 240.5]
    x = np.concatenate([edge, rng.standard_normal(240) * 10.0 ** rng.uniform(-4, 3, 240)])
    x = x.astype(np.float32)
    want = np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert want[5] == want[4] and want[6] == want[4]                 # 464 and 1e6 saturate to 448
    assert sem.bytes_to_float(want[2]) == 1.0                        # tie to even
    dx, dout = cuda.to_device(x), cuda.to_device(np.zeros(len(x) // 4, np.uint32))
    pack_kernel[1, 64](dx, dout)
    got = dout.copy_to_host().view(np.uint8)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert np.isnan(sem.bytes_to_float(got[nan])).all()


# --------------------------------------------------------------------------- the quantiser

def _dequantized(x8, descale, rows):
    """float64 x8 * descale, descale (B, H, nb) a scale per `rows` rows."""
    x = arrays_to_host(x8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    s = arrays_to_host(descale).astype(np.float64)
    scale = np.repeat(s.transpose(0, 2, 1), rows, axis=1)[:, :x.shape[1]]
    return x * scale[..., None]


def arrays_to_host(x):
    return inputs.to_host(x)


def dev(x):
    """A Numba device array of host array x (ml_dtypes types too)."""
    return inputs.to_device(x, "numba")


# the quick loop (-m "not slow") keeps one cheap case of each; the simulator's shuffles make the
# Hadamard transform and the kernel runs slow there
QUANT_CASES = [(128, None, False), pytest.param(128, 64, False, marks=pytest.mark.slow),
               pytest.param(128, 128, True, marks=pytest.mark.slow)]
if ON_GPU:
    QUANT_CASES += [(256, 128, True), (256, None, True), (128, 256, False)]


@pytest.mark.parametrize("head_dim, block, incoherent", QUANT_CASES)
def test_quantize_fp8_error_within_the_format(rng, head_dim, block, incoherent):
    """descale = amax / 448 of each block (or the tensor), and every element of descale * x8
    within half an e4m3 step of x (transformed by diag(signs) H / sqrt(d) when incoherent)."""
    # simulator: one batch (the launches' cost grows with the thread blocks), 70 rows (a ragged
    # block of 128, two blocks of 64), two heads (the outlier sits in head 1, not in head 0)
    b, n, h = (2, 200, 2) if ON_GPU else (1, 70, 2)
    x = rng.standard_normal((b, n, h, head_dim)).astype(np.float32)
    x[0, 3, 1, 5] = 60.0                                      # an outlier
    x = x.astype(ml_dtypes.bfloat16)
    signs = fp8.random_signs(head_dim, 7) if incoherent else None
    x8, descale = fp8.quantize_fp8(dev(x), block=block, signs=signs)
    xf = x.astype(np.float64)
    if incoherent:
        xf = xf @ fp8.incoherent_matrix(signs)
    rows = block or n
    nb = -(-n // rows)
    assert arrays_to_host(descale).shape == (b, h, nb)
    amax = np.stack([np.abs(xf[:, i * rows:(i + 1) * rows]).max(axis=(1, 3)) for i in range(nb)], -1)
    if block is None:
        amax = np.broadcast_to(amax.max(), amax.shape)
    np.testing.assert_allclose(arrays_to_host(descale), amax / 448, rtol=1e-5)
    got = _dequantized(x8, descale, rows)
    scale = np.repeat((amax / 448).transpose(0, 2, 1), rows, axis=1)[:, :n, :, None]
    bound = U * np.abs(xf) * (1 + 1e-5) + SUBNORMAL_HALF_STEP * scale + 1e-6 * np.abs(xf).max()
    assert (np.abs(got - xf) <= bound).all(), np.abs(got - xf).max()


ONE_PASS_CASES = [(128, 32, 40)]
if ON_GPU:
    ONE_PASS_CASES += [(128, 256, 1000), (128, 32, 300), (256, 128, 700), (256, 64, 130)]


@pytest.mark.parametrize("head_dim, block, n", ONE_PASS_CASES)
def test_quantize_fp8_one_pass_is_the_two_pass(rng, monkeypatch, head_dim, block, n):
    """The one-pass block quantiser (a block's transformed rows held in registers) gives the bits
    of the two-pass kernel (rows read and transformed again to quantise), ragged last block and
    incoherent processing included."""
    assert fp8.one_pass_rows(head_dim, block) > 0
    x = dev(rng.standard_normal((1, n, 2, head_dim)).astype(ml_dtypes.bfloat16))
    signs = fp8.random_signs(head_dim, 3)
    one = [arrays_to_host(a) for a in fp8.quantize_fp8(x, block=block, signs=signs)]
    monkeypatch.setattr(fp8, "one_pass_rows", lambda d, b: 0)
    two = [arrays_to_host(a) for a in fp8.quantize_fp8(x, block=block, signs=signs)]
    np.testing.assert_array_equal(one[0].view(np.uint8), two[0].view(np.uint8))
    np.testing.assert_array_equal(one[1], two[1])


def test_one_pass_rows_fit_the_registers():
    assert fp8.one_pass_rows(128, 256) == 16 and fp8.one_pass_rows(256, 128) == 8
    assert fp8.one_pass_rows(256, 256) == 0 and fp8.one_pass_rows(128, None) == 0
    assert fp8.one_pass_rows(128, 100) == 0     # not whole rows a warp


def test_incoherent_processing_leaves_qk_unchanged(rng):
    """M = diag(signs) H / sqrt(d) is orthogonal, so (Q M)(K M)^T = Q K^T (float64)."""
    for d in fp8.HEAD_DIMS:
        m = fp8.incoherent_matrix(fp8.random_signs(d, 3))
        np.testing.assert_allclose(m @ m.T, np.eye(d), atol=1e-12)
        q, k = rng.standard_normal((2, 50, d))
        np.testing.assert_allclose((q @ m) @ (k @ m).T, q @ k.T, atol=1e-10)
        assert abs(m[0, 0]) == pytest.approx(1 / math.sqrt(d))       # it spreads every coordinate


@pytest.mark.parametrize("n, d", [(100, 128), (300, 256)])
def test_v_k_major_orders_keys_for_the_p_operand(rng, n, d):
    """V^T (B, H, d, N_pad): position p of each 16 keys holds key KEY_ORDER[p], zeros past N."""
    v = rng.integers(0, 255, (2, n, 2, d), dtype=np.uint8)
    made = fp8.v_k_major(dev(v))
    assert isinstance(made, fp8.KMajorV) and made.seqlen == n
    vt = arrays_to_host(made.data)
    n_pad = -(-n // fp8.V_KEYS) * fp8.V_KEYS
    assert vt.shape == (2, 2, d, n_pad)
    keys = np.concatenate([16 * g + fp8.KEY_ORDER for g in range(n_pad // 16)])
    want = np.zeros_like(vt)
    ok = keys < n
    want[..., ok] = v.transpose(0, 2, 3, 1)[..., keys[ok]]
    np.testing.assert_array_equal(vt, want)
    assert sorted(fp8.KEY_ORDER) == list(range(16))


K_MAJOR_QUANT_CASES = [(100, 128, None), (100, 128, 256),
                       pytest.param(300, 256, 512, marks=pytest.mark.slow)]
if ON_GPU:
    K_MAJOR_QUANT_CASES += [(1000, 128, None), (4096, 128, 4096), (700, 256, None), (256, 128, 256)]


@pytest.mark.parametrize("n, d, block", K_MAJOR_QUANT_CASES)
def test_quantize_fp8_k_major_is_v_k_major_of_the_quantised_v(rng, n, d, block):
    """quantize_fp8(v, k_major=True) writes, in its own pass, what v_k_major makes of the row-major
    quantiser's output: the same scales and e4m3 values, as V^T with each 16 keys in KEY_ORDER and
    zeros past N. One scale a tensor (block=None: 256-row blocks, two 128-key chunks each) and one
    a head (block >= N: a block of the whole sequence; at N <= 256, d=128 the row-major quantiser
    is the one-pass kernel, the K-major one the two-pass: the same bits)."""
    v = dev(rng.standard_normal((2, n, 2, d)).astype(ml_dtypes.bfloat16))
    v8, vd = fp8.quantize_fp8(v, block=block)
    vt, vtd = fp8.quantize_fp8(v, block=block, k_major=True)
    assert isinstance(vt, fp8.KMajorV) and vt.seqlen == n
    np.testing.assert_array_equal(arrays_to_host(vtd), arrays_to_host(vd))
    np.testing.assert_array_equal(arrays_to_host(vt.data), arrays_to_host(fp8.v_k_major(v8).data))


# --------------------------------------------------------------------------- fa3 in FP8

FA3_CASES = [pytest.param(150, False, 128, 1, 128, marks=pytest.mark.slow),
             (130, True, None, 1, 128), pytest.param(130, True, 128, 1, 256, marks=pytest.mark.slow)]
if ON_GPU:
    FA3_CASES += [(700, False, 128, 2, 128), (700, True, 128, 1, 128), (1000, True, None, 4, 128),
                  (64, False, None, 1, 128), (2048, False, 256, 1, 128), (2048, True, 128, 2, 128),
                  (2048, False, 128, 1, 256), (1000, True, None, 2, 256)]


@pytest.mark.parametrize("seqlen, causal, block, kv_group, d", FA3_CASES)
def test_fa3_fp8_matches_float64(rng, seqlen, causal, block, kv_group, d):
    """O against float64 attention over the dequantised inputs: what the kernel adds is P~'s
    rounding to e4m3 (relative U a probability, at most U sum_j p_j |v_j| an element of O;
    below the normals 2^-10 absolute) and O's to bf16 (2^-8 relative). The inputs' scores are
    spread (q x 3) so that P is peaked and a wrong key order in V^T is far outside that bound.
    K's scales per 128 keys at d=128 take key blocks of 128 (block_n: one K factor a block)."""
    options = dict(block_n=128) if block == 128 and d == 128 else {}
    check_fa3_fp8(rng, seqlen, causal, block, kv_group, d, **options)


def test_fa3_fp8_k_scales_cover_whole_key_blocks(rng):
    """K's descales per block of scale_block keys: one factor a key block, so a scale_block that
    splits fa3's FP8 key blocks (B_c = 256 at d=128) is refused, naming the remedy; block_n=128
    takes it."""
    _, x8, s = _fp8_inputs(rng, n=256)
    x = dev(rng.standard_normal((1, 256, 2, 128)).astype(ml_dtypes.bfloat16))
    k8, kd = fp8.quantize_fp8(x, block=128)
    call = dict(variant="fa3", q_descale=s, k_descale=kd, v_descale=s, scale_block=128)
    with pytest.raises(ValueError, match=r"scale_block=128: K's descales must cover whole key "
                                         r"blocks .* \(block_n = B_c = 256"):
        variants.forward(x8, k8, x8, **call)
    o, _ = variants.forward(x8, k8, x8, block_n=128, **call)
    assert np.isfinite(arrays_to_host(o).astype(np.float32)).all()


K_STEP_CASES = [pytest.param(300, False, 256, 1, 128, marks=pytest.mark.slow)]
if ON_GPU:
    K_STEP_CASES += [(1000, True, 256, 2, 128), (2048, False, 512, 1, 128),
                     (1000, True, 256, 1, 256)]


@pytest.mark.parametrize("seqlen, causal, block, kv_group, d", K_STEP_CASES)
def test_fa3_fp8_k_scales_span_several_key_blocks(rng, seqlen, causal, block, kv_group, d):
    """A K scale block of 2 or 4 key blocks (scale_block 256 or 512, B_c = 128: the kernel's block
    index j // (scale_block / B_c)), with K's blocks at gains 1, 8, 1/8 and 4, so that a key block
    given its neighbour's factor is far outside the float64 check's bound."""
    check_fa3_fp8(rng, seqlen, causal, block, kv_group, d, k_gains=(1.0, 8.0, 0.125, 4.0),
                  block_n=128)


POLY_CASES = [(130, True, 4)]
if ON_GPU:
    POLY_CASES += [(1000, False, 2), (2048, True, 4), (700, True, 1)]


@pytest.mark.parametrize("seqlen, causal, poly_exp2", POLY_CASES)
def test_fa3_fp8_with_exponentials_on_the_fma_units(rng, seqlen, causal, poly_exp2):
    """poly_exp2: some of P~'s exponentials by ptx.ex2_poly (FA4's polynomial) instead of the MUFU
    unit; the bound above widened by the polynomial's relative error on P~ and on l (1 in 1:
    every exponential of S)."""
    check_fa3_fp8(rng, seqlen, causal, None, 1, 128, poly_exp2=poly_exp2)


BULK_CASES = [(130, True, 1)]
if ON_GPU:
    BULK_CASES += [(700, False, 2), (2048, True, 1), (1000, False, 1)]


@pytest.mark.parametrize("o_store", ["bulk", "tma"])
@pytest.mark.parametrize("seqlen, causal, kv_group", BULK_CASES)
def test_fa3_fp8_with_o_stored_by_the_copy_engine(rng, seqlen, causal, kv_group, o_store):
    """O stored by the copy engine: o_store="bulk" (staged unswizzled, a row a copy) or "tma"
    (staged as the tensor map's swizzled boxes, a 64-column panel a store); partial last tiles
    (130, 700, 1000 rows: the tensor store clips the rows past N)."""
    check_fa3_fp8(rng, seqlen, causal, None, kv_group, 128, o_store=o_store)


# 300 keys: two blocks, so stage 1's K and V tiles (V past K's B_c rows) are read too
BLOCK_N_CASES = [(300, True, 1, dict(block_n=192, intra_overlap=True))]
if ON_GPU:
    BLOCK_N_CASES += [(2048, False, 2, dict(block_n=192, intra_overlap=True)),
                      (1000, True, 1, dict(block_n=224, intra_overlap=True)),
                      (700, False, 1, dict(block_n=160)),
                      (2048, True, 1, dict(block_n=192)),
                      (1000, False, 1, dict(block_n=192, block_m=64, stages=3)),
                      # three stages: O staged in Q's room (192), in a room of its own (160)
                      (2048, True, 2, dict(block_n=192, stages=3)),
                      (1500, False, 1, dict(block_n=160, stages=3))]


@pytest.mark.parametrize("seqlen, causal, kv_group, options", BLOCK_N_CASES)
def test_fa3_fp8_at_a_block_n_between_panels(rng, seqlen, causal, kv_group, options):
    """FP8 B_c not a multiple of 128 (160, 192, 224: FA3's own FP8 tiles are 224 keys with the
    intra-warpgroup overlap): V_j^T's room is whole 128-key panels, its last one landing keys of
    the next block (or zeros past the end) that no wgmma reads; K_j's room and copy are B_c rows."""
    check_fa3_fp8(rng, seqlen, causal, None, kv_group, 128, **options)


def test_fa3_fp8_block_n_is_whole_k32_steps(rng):
    x8, s = fp8.quantize_fp8(dev(rng.standard_normal((1, 64, 2, 128)).astype(ml_dtypes.bfloat16)),
                             block=None)
    for bn in (144, 96):
        with pytest.raises(ValueError, match=f"block_n={bn} must be a multiple of 32 from 128"):
            variants.forward(x8, x8, x8, variant="fa3", q_descale=s, k_descale=s, v_descale=s,
                             block_n=bn)


def check_fa3_fp8(rng, seqlen, causal, block, kv_group, d, k_gains=None, **options):
    """test_fa3_fp8_matches_float64's check, with fa3 `options`; k_gains: K's rows of scale block
    i (of `block`) multiplied by k_gains[i % len(k_gains)], so that its scales differ block to
    block."""
    b, h = 1, 2 * kv_group
    q = (3 * rng.standard_normal((b, seqlen, h, d))).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((b, seqlen, h // kv_group, d)) for _ in range(2))
    if k_gains is not None:
        k *= np.array(k_gains)[(np.arange(seqlen) // block) % len(k_gains)][None, :, None, None]
    k, v = (x.astype(ml_dtypes.bfloat16) for x in (k, v))
    dq, dk, dv = (dev(x) for x in (q, k, v))
    q8, qd = fp8.quantize_fp8(dq, block=block)
    k8, kd = fp8.quantize_fp8(dk, block=block)
    v8, vd = fp8.quantize_fp8(dv, block=None)
    o, lse = variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd,
                              k_descale=kd, v_descale=vd, scale_block=block or 128, **options)
    qf, kf = (_dequantized(x8, s, block or seqlen) for x8, s in ((q8, qd), (k8, kd)))
    vf = _dequantized(v8, vd, seqlen)
    kf, vf = (np.repeat(x, kv_group, axis=2) for x in (kf, vf))
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) / math.sqrt(d)
    if causal:
        s = np.where(np.tril(np.ones((seqlen, seqlen), bool)), s, -np.inf)
    lse_ref = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = np.exp(s - lse_ref[..., None])
    o_ref = np.einsum("bhqk,bkhd->bqhd", p, vf)
    got = arrays_to_host(o).astype(np.float64)
    bound = (U * np.einsum("bhqk,bkhd->bqhd", p, np.abs(vf)) + 2.0 ** -8 * np.abs(o_ref)
             + SUBNORMAL_HALF_STEP / 256 * np.abs(vf).sum(1)[:, None] + 1e-6)
    if options.get("poly_exp2"):   # P~ and l each off by at most the polynomial's relative error
        bound += 2 * sem.EX2_POLY_REL_ERROR * np.einsum("bhqk,bkhd->bqhd", p, np.abs(vf))
    assert (np.abs(got - o_ref) <= bound).all(), np.abs(got - o_ref).max()
    # L: S = Q K^T comes from FP8 wgmmas, whose sums keep fewer than fp32's bits (~14 measured by
    # DeepSeek-V3): held to 2^-10 of the row's sum of |q_i . k_j| terms
    terms = np.einsum("bqhd,bkhd->bhqk", np.abs(qf), np.abs(kf)).max(-1) / math.sqrt(d)
    lse_err = np.abs(arrays_to_host(lse) - lse_ref)
    assert (lse_err <= 2.0 ** -10 * terms + 1e-5).all(), lse_err.max()


TRANSPOSE_CASES = [(130, True, 1, {})]
if ON_GPU:
    TRANSPOSE_CASES += [(64, False, 1, {}), (700, False, 2, {}), (4096, True, 2, {}),
                        (3000, False, 1, {}), (1000, True, 1, dict(v_staging=3)),
                        (700, False, 1, dict(stages=1, v_staging=1)),
                        (900, True, 1, dict(persistent=False)),
                        (600, True, 1, dict(block_n=128, intra_overlap=True, v_staging=4)),
                        (1000, True, 2, dict(block_n=256)), (700, False, 1, dict(block_n=160)),
                        (1000, True, 1, dict(block_n=192)), (700, False, 2, dict(block_n=224)),
                        (1500, True, 1, dict(block_n=160, stages=3))]


@pytest.mark.parametrize("seqlen, causal, kv_group, options", TRANSPOSE_CASES)
def test_fa3_fp8_v_transposed_by_the_producer_is_the_prepass(rng, seqlen, causal, kv_group,
                                                              options):
    """transpose_v="producer" (V^T made in shared memory by the producer warpgroup) gives the bits
    of the pre-pass path (V^T made in HBM by fp8.v_k_major, checked against float64 above): the
    same V^T tile in the same order, the same wgmmas. Lengths past one 128-key unit, not a multiple
    of one (TMA's zero rows past the end), many tiles a persistent block (4096, causal pairs), GQA,
    1 to 4 staging buffers, one ring stage, a block a tile, B_c = 128 with the intra-warpgroup
    overlap, B_c between whole 128-key units (160, 192, 224: the last unit's extra keys transposed
    and never read), three stages."""
    d = 128
    b, h = 2 if seqlen >= 1000 else 1, 2 * kv_group
    q = (3 * rng.standard_normal((b, seqlen, h, d))).astype(ml_dtypes.bfloat16)
    k, v = (rng.standard_normal((b, seqlen, h // kv_group, d)).astype(ml_dtypes.bfloat16)
            for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_fp8(dev(x), block=None) for x in (q, k, v))
    outs = [variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd, k_descale=kd,
                             v_descale=vd, transpose_v=mode, **options)
            for mode in ("prepass", "producer")]
    (o_pre, lse_pre), (o_in, lse_in) = ((arrays_to_host(o), arrays_to_host(lse)) for o, lse in outs)
    assert np.isfinite(o_pre.astype(np.float32)).all()
    np.testing.assert_array_equal(o_in.view(np.uint16), o_pre.view(np.uint16))
    np.testing.assert_array_equal(lse_in, lse_pre)


K_MAJOR_V_CASES = [(130, True, 1)]
if ON_GPU:
    K_MAJOR_V_CASES += [(64, False, 1), (700, False, 2), (4096, True, 2), (1000, True, 4),
                        (3000, False, 1)]


@pytest.mark.parametrize("seqlen, causal, kv_group", K_MAJOR_V_CASES)
def test_fa3_fp8_with_v_given_k_major_is_the_prepass(rng, seqlen, causal, kv_group):
    """V handed over K-major (fp8.KMajorV from the quantiser's own pass: no pre-pass in the call)
    gives the bits of the pre-pass path, which is checked against float64 above."""
    d = 128
    b, h = 2 if seqlen >= 1000 else 1, 2 * kv_group
    q = (3 * rng.standard_normal((b, seqlen, h, d))).astype(ml_dtypes.bfloat16)
    k, v = (dev(rng.standard_normal((b, seqlen, h // kv_group, d)).astype(ml_dtypes.bfloat16))
            for _ in range(2))
    (q8, qd), (k8, kd), (v8, vd) = (fp8.quantize_fp8(x, block=None) for x in (dev(q), k, v))
    vt, vtd = fp8.quantize_fp8(v, block=None, k_major=True)
    outs = [variants.forward(q8, k8, x, variant="fa3", causal=causal, q_descale=qd, k_descale=kd,
                             v_descale=s) for x, s in ((v8, vd), (vt, vtd))]
    (o_pre, lse_pre), (o_vt, lse_vt) = ((arrays_to_host(o), arrays_to_host(lse)) for o, lse in outs)
    assert np.isfinite(o_pre.astype(np.float32)).all()
    np.testing.assert_array_equal(o_vt.view(np.uint16), o_pre.view(np.uint16))
    np.testing.assert_array_equal(lse_vt, lse_pre)


PDL_CASES = [(1, 130, 2, True)]
if ON_GPU:   # V^T of 16 MB: the pre-pass runs ~15 us, long enough for its dependent to start early
    PDL_CASES += [(4, 4096, 8, True), (2, 4096, 16, False), (1, 8192, 4, True)]


@pytest.mark.parametrize("b, seqlen, h, causal", PDL_CASES)
def test_fa3_fp8_launched_as_the_prepass_dependent_reads_its_v(rng, b, seqlen, h, causal):
    """pdl: the kernel launched as a programmatic dependent of V's pre-pass, its producer waiting
    for the pre-pass's end before the first V^T copy, gives the bits of an ordinary launch. V^T is
    a new allocation each call: a dependent that read it too early would read what the memory
    held before (another V's V^T, where an allocator hands the block back). Whether such a read
    happens depends on timing; what makes it impossible is checked without a GPU: the wait's
    place in the kernel (test_compile.py) and the launch order (below)."""
    from variants import fa3
    d = 128
    q, k, v, v_other = ((3 if i == 0 else 1) * rng.standard_normal((b, seqlen, h, d))
                        .astype(ml_dtypes.bfloat16) for i in range(4))
    (q8, qd), (k8, kd), (v8, vd), (w8, wd) = (fp8.quantize_fp8(dev(x), block=None)
                                              for x in (q, k, v, v_other))

    def run(v8, vd, pdl):
        o, lse = variants.forward(q8, k8, v8, variant="fa3", causal=causal, q_descale=qd,
                                  k_descale=kd, v_descale=vd, pdl=pdl)
        return arrays_to_host(o), arrays_to_host(lse)
    o_ref, lse_ref = run(v8, vd, False)
    run(w8, wd, True)               # memory a later V^T may reuse now holds the other V's
    o, lse = run(v8, vd, True)
    assert np.isfinite(o_ref.astype(np.float32)).all()
    np.testing.assert_array_equal(o.view(np.uint16), o_ref.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_ref)
    # only the pre-pass path is a dependent launch
    assert fa3.default_config(128, "bfloat16", causal, (("fp8", True),)).after_prepass
    assert not fa3.default_config(128, "bfloat16", causal, (("fp8", True),),
                                  transpose_v="producer").after_prepass
    assert not fa3.default_config(128, "bfloat16", causal).after_prepass


@pytest.mark.parametrize("options, order", [
    ({}, [("maps", False), ("prepass", False), ("fa3", True)]),
    (dict(pdl=False), [("maps", False), ("prepass", False), ("fa3", False)]),
    (dict(transpose_v="producer"), [("maps", False), ("fa3", False)]),
    (dict(k_major_v=True), [("maps", False), ("fa3", False)])])
def test_fa3_fp8_launches_right_after_its_prepass(rng, monkeypatch, options, order):
    """With V^T from the pre-pass, fa3's tensor maps (whose first upload is a synchronous copy) are
    made before the pre-pass is launched, and the kernel is launched right after it, a programmatic
    dependent with pdl (the default) and an ordinary launch without; with the producer's transpose,
    or V given K-major, there is no pre-pass and no dependent launch."""
    from common.host import tensormaps
    from variants import fa3
    _, x8, s = _fp8_inputs(rng)   # (the quantiser launches through fp8.launch too)
    options = dict(options)        # (the parametrisation's own dict is left as it is)
    v = fp8.v_k_major(x8) if options.pop("k_major_v", False) else x8
    calls = []

    def recorded(name, real):
        def call(*args, programmatic=False, **kwargs):
            calls.append((name, programmatic))
            return real(*args, programmatic=programmatic, **kwargs) if name != "maps" else \
                real(*args, **kwargs)
        return call
    monkeypatch.setattr(tensormaps, "tensor_maps", recorded("maps", tensormaps.tensor_maps))
    monkeypatch.setattr(fp8, "launch", recorded("prepass", fp8.launch))
    monkeypatch.setattr(fa3, "launch", recorded("fa3", fa3.launch))
    variants.forward(x8, x8, v, variant="fa3", q_descale=s, k_descale=s, v_descale=s, **options)
    assert calls == order


def test_v_prepass_lets_its_dependent_start_first_thing():
    """V's pre-pass built to trigger (sm_90 on) runs griddepcontrol.launch_dependents before its
    first load; built not to (before sm_90, where griddepcontrol does not assemble) it has no
    griddepcontrol at all (PTX for sm_90, compiled without a GPU)."""
    code = (
        "from numba import cuda, types\n"
        "from variants import fp8\n"
        "sig = (types.Array(types.uint32, 4, 'A'), types.Array(types.uint32, 2, 'C'), types.int32)\n"
        "for trigger in (True, False):\n"
        "    ptx, _ = cuda.compile_ptx(fp8._v_k_major_kernel(128, trigger).py_func, sig, cc=(9, 0))\n"
        "    body = ptx[ptx.index('.entry'):]\n"
        "    print(trigger, body.find('griddepcontrol'), body.find('ld.global.v4'))\n")
    rows = {r.split()[0]: [int(x) for x in r.split()[1:]] for r in compiled_in_a_subprocess(code)}
    (trigger, load), (none, load_) = rows["True"], rows["False"]
    assert 0 <= trigger < load and none == -1 and load_ >= 0


def test_transpose_v_is_for_fp8_with_a_producer_warpgroup(rng):
    dx = dev(rng.standard_normal((1, 64, 2, 128)).astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="transpose_v='producer' is for FP8"):
        variants.forward(dx, dx, dx, variant="fa3", transpose_v="producer")
    with pytest.raises(ValueError, match="transpose_v must be one of"):
        variants.forward(dx, dx, dx, variant="fa3", transpose_v="kernel")
    x8, s = fp8.quantize_fp8(dx, block=None)
    with pytest.raises(ValueError, match="needs the producer warpgroup"):
        variants.forward(x8, x8, x8, variant="fa3", q_descale=s, k_descale=s, v_descale=s,
                         transpose_v="producer", setmaxnreg=False)
    d256 = dev(rng.standard_normal((1, 64, 2, 256)).astype(ml_dtypes.bfloat16))
    y8, t = fp8.quantize_fp8(d256, block=None)
    with pytest.raises(ValueError, match="transpose_v='producer' is for head_dim 128, got 256"):
        variants.forward(y8, y8, y8, variant="fa3", q_descale=t, k_descale=t, v_descale=t,
                         transpose_v="producer")
    with pytest.raises(ValueError, match="v_staging must be 1 to 4"):
        variants.forward(x8, x8, x8, variant="fa3", q_descale=s, k_descale=s, v_descale=s,
                         v_staging=0)
    with pytest.raises(ValueError, match="v_staging=4 at head_dim 128 needs .* shared memory"):
        variants.forward(x8, x8, x8, variant="fa3", q_descale=s, k_descale=s, v_descale=s,
                         transpose_v="producer", v_staging=4, stages=3)


def _fp8_inputs(rng, n=64, d=128):
    x = rng.standard_normal((1, n, 2, d)).astype(ml_dtypes.bfloat16)
    dx = dev(x)
    x8, s = fp8.quantize_fp8(dx, block=None)
    return dx, x8, s


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(q_descale=None), ValueError, "need their descale factors"),
    (dict(q_descale="wrong shape"), ValueError, r"q_descale must be float32 of shape \(1, 2, 1\)"),
    (dict(v_descale="per block"), ValueError, "v_descale must have one scale a head"),
    (dict(variant="fa2"), TypeError, "fa2 takes float16 or bfloat16"),
    (dict(bf16=True), ValueError, "are for e4m3"),
    (dict(out_dtype="float32"), TypeError, "the output is float16 or bfloat16"),
    (dict(softcap=30.0), ValueError, "fa3 in FP8 takes no softcap"),
    (dict(producer="cp_async"), ValueError, r"fa3 in FP8 copies with TMA only \(producer='tma'\)"),
])
def test_fp8_bad_input_is_named(rng, kwargs, error, message):
    dx, x8, s = _fp8_inputs(rng)
    call = dict(q_descale=s, k_descale=s, v_descale=s)
    variant = kwargs.pop("variant", "fa3")
    if kwargs.pop("bf16", False):
        args = (dx, dx, dx)
    else:
        args = (x8, x8, x8)
    for name, value in kwargs.items():
        if value == "wrong shape":
            value = cuda.to_device(np.ones((1, 2, 5), np.float32))
        elif value == "per block":
            value = dev(np.ones((1, 64, 2, 128), ml_dtypes.bfloat16))
            value = fp8.quantize_fp8(value, block=32)[1]
            call["scale_block"] = 32
        call[name] = value
    if variant != "fa3":
        call = {}
    with pytest.raises(error, match=message):
        variants.forward(*args, variant=variant, **call)


def test_quantize_fp8_refuses_what_it_cannot_do(rng):
    x = dev(rng.standard_normal((1, 8, 1, 64)).astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="head_dim in"):
        fp8.quantize_fp8(x)
    y = dev(rng.standard_normal((1, 8, 1, 128)).astype(np.float32))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        fp8.quantize_fp8(y)
    z = dev(rng.standard_normal((1, 8, 1, 128)).astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="signs must be"):
        fp8.quantize_fp8(z, signs=np.full(128, 0.5, np.float32))


def test_k_major_v_bad_input_is_named(rng):
    """A K-major V (fp8.KMajorV) that does not fit K, beside 16-bit inputs, or with the producer's
    transpose, and a K-major quantisation with more than one scale a head: each refused, named."""
    dx, x8, s = _fp8_inputs(rng, n=128)
    call = dict(variant="fa3", q_descale=s, k_descale=s, v_descale=s)
    short = fp8.v_k_major(_fp8_inputs(rng, n=64)[1])
    with pytest.raises(ValueError, match=r"must hold uint8 \(1, 2, 128, 128\) for seqlen 128"):
        variants.forward(x8, x8, short, **call)
    with pytest.raises(ValueError, match="must hold uint8"):
        variants.forward(x8, x8, fp8.KMajorV(short.data[:, :1], 128), **call)   # one head of two
    wide = dev(np.zeros((1, 2, 128, 256), np.uint8))
    with pytest.raises(ValueError, match="must be contiguous and 16-byte aligned"):
        variants.forward(x8, x8, fp8.KMajorV(wide[:, :, :, :128], 128), **call)   # rows 256 apart
    vt = fp8.v_k_major(x8)
    with pytest.raises(ValueError, match="is for e4m3"):
        variants.forward(dx, dx, vt, variant="fa3")
    with pytest.raises(ValueError, match="transposes V in the kernel, but V came K-major"):
        variants.forward(x8, x8, vt, transpose_v="producer", **call)
    with pytest.raises(ValueError, match="one V scale a head"):
        fp8.quantize_fp8(dx, block=32, k_major=True)
    with pytest.raises(ValueError, match="takes no incoherent processing"):
        fp8.quantize_fp8(dx, block=None, k_major=True, signs=fp8.random_signs(128))


def test_v_k_major_refuses_v_it_cannot_read_in_16_byte_pieces():
    """The pre-pass reads V's rows in 16-byte loads: a V whose rows start off a 16-byte boundary
    (here a view one byte into a wider buffer) is refused, naming why."""
    wide = dev(np.zeros((1, 64, 2, 144), np.uint8))
    with pytest.raises(ValueError, match="16-byte aligned with contiguous rows"):
        fp8.v_k_major(wide[:, :, :, 1:129])
    with pytest.raises(ValueError, match="16-byte aligned with contiguous rows"):
        fp8.v_k_major(dev(np.zeros((1, 64, 2, 136), np.uint8))[:, :, :, :128])   # rows 136 bytes apart
