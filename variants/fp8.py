"""FP8 (float8_e4m3fn) for fa3: the format, the quantiser, incoherent processing, V made K-major.

The format: 1 sign, 4 exponent (bias 7) and 3 mantissa bits; largest finite 448, no infinities,
smallest normal 2^-6, subnormals down to 2^-9. Rounding to nearest leaves a relative error of at
most u = 2^-4 for normal values (UNIT_ROUNDOFF), 16x bf16's 2^-8: the error budget FP8 trades for
twice the tensor-core rate (FA3 paper, section 3.3).

What the FA3 paper does to win accuracy back, each a switch of `quantize_fp8`:
- block quantisation (`block=R`): one scale per (batch, head, block of R rows) instead of one per
  tensor, so a block's values use e4m3's range for themselves (an outlier inflates only its own
  block's scale);
- incoherent processing (`signs=`): Q and K multiplied by the same random orthogonal matrix
  M = diag(signs) H / sqrt(d) (H the d x d Walsh-Hadamard matrix, so M M^T = I and
  (Q M)(K M)^T = Q K^T exactly) before quantisation: an outlier coordinate is spread over all d,
  its magnitude divided by ~sqrt(d). H costs O(d log d) a row (the fast Walsh-Hadamard transform:
  log2(d) butterfly stages, here inside a lane and then across lanes by shuffles).

Scales: x ~= descale * e4m3(x / descale), descale = amax / 448 of the block (or tensor). The
kernel takes the descales and applies them to S and O (variants/fa3.py); the quantised tensors
keep flash_attn's layout (B, N, H, d).

V for the P V product: FP8 wgmma reads both operands K-major (no transpose for 8-bit types), and
for P V the contraction runs over keys, so V is needed as V^T: (B, H_kv, d, N) with keys
contiguous. `v_k_major` makes it in a pre-pass, and orders each 16 keys as the e4m3 A operand of
the P V wgmma holds P~'s columns (`KEY_ORDER`, see `tiles.accumulator_to_a_e4m3`): P~ goes from the
S accumulator into A registers without moving a byte between lanes, and the product is exact.
"""
import dataclasses
import math
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, uint32

from common.hardware import elements, ptx, sm90
from common.hardware.elements import UNIT_ROUNDOFF as _UNIT_ROUNDOFF
from common.hardware.target import SIMULATOR, device_function, kernel
from common.host import arrays
from common.host.launching import launch
from common.host.problem import _BSHD_TO_BHSD
from common.tile import tiles

E4M3_MAX = 448.0
UNIT_ROUNDOFF = _UNIT_ROUNDOFF["float8_e4m3fn"]   # relative rounding error of a normal e4m3 value
DEFAULT_BLOCK = 256              # rows a scale in block quantisation: a multiple of fa3's FP8
                                 # B_r and B_c (256 at d=128, 128 at d=256), as fa3 requires of
                                 # K's scales (one factor a key block)
HEAD_DIMS = (128, 256)           # d / 32 values a lane, packed 4 to a 32-bit store
THREADS = 128
V_KEYS = 128                     # keys of V a block of the K-major pre-pass moves (8 groups of 16)
V_UNIT_KEYS = 128                # keys of V fa3's producer transposes at a time (a V^T panel)
V_THREADS = 256                  # ... with this many threads


def key_at(position):
    """The key (of 16) held at `position` (of 16) of the P V wgmma's K dimension: A's column
    4 t + b holds P~ column 8 (b // 2) + 2 t + b % 2 (tiles.accumulator_to_a_e4m3)."""
    t, b = position >> 2, position & 3
    return 8 * (b >> 1) + 2 * t + (b & 1)


KEY_ORDER = np.array([key_at(p) for p in range(16)])
_key_at = device_function(key_at)


# --------------------------------------------------------------------------- host side

def hadamard_matrix(d):
    """The d x d Walsh-Hadamard matrix (Sylvester's construction; entries +-1, H H^T = d I)."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    if h.shape[0] != d:
        raise ValueError(f"the Hadamard transform needs a power-of-two head_dim, got {d}")
    return h


def random_signs(head_dim, seed=0):
    """The random +-1 diagonal of incoherent processing, float32 (the same for Q and K)."""
    return np.where(np.random.default_rng(seed).random(head_dim) < 0.5, -1.0, 1.0).astype(np.float32)


def incoherent_matrix(signs):
    """M = diag(signs) H / sqrt(d): orthogonal, what `quantize_fp8(x, signs=...)` applies to rows."""
    d = len(signs)
    return np.asarray(signs, np.float64)[:, None] * hadamard_matrix(d) / math.sqrt(d)


# --------------------------------------------------------------------------- the quantiser

@device_function
def _warp_max(x):
    for k in range(5):
        x = max(x, ptx.shfl_xor_f32(x, 1 << k))
    return x


@device_function
def block_rows(n, rows):
    """A quantiser thread block's place: (blk, h, b) its (block of rows, head, batch), tid, warp,
    lane, and its rows row0 .. row1 - 1 (`rows` a block, n in all)."""
    blk, h, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = int32(cuda.threadIdx.x)
    warp, lane = tid >> 5, tid & 31
    row0 = blk * rows
    return blk, h, b, tid, warp, lane, row0, min(row0 + rows, n)


@lru_cache(maxsize=None)
def _block_max(warps):
    """top(x, peak, warp, lane): the largest x of the thread block's `warps` warps (peak: a shared
    array of `warps` floats; a block-wide barrier inside)."""
    @device_function
    def top(x, peak, warp, lane):
        x = _warp_max(x)
        if lane == 0:
            peak[warp] = x
        cuda.syncthreads()
        for w in range(warps):
            x = max(x, peak[w])
        return x

    return top


@lru_cache(maxsize=None)
def _row_storer(head_dim):
    """store(out32, b, h, row, lane, vals, first, scale): the lane's E = d / 32 values vals[first:]
    times scale, as e4m3, into its words of row `row`."""
    OUT_WORDS = head_dim // 128

    @device_function
    def store(out32, b, h, row, lane, vals, first, scale):
        for w in range(OUT_WORDS):
            out32[b, h, row, lane * OUT_WORDS + w] = ptx.pack_e4m3x4(
                vals[first + 4 * w] * scale, vals[first + 4 * w + 1] * scale,
                vals[first + 4 * w + 2] * scale, vals[first + 4 * w + 3] * scale)

    return store


@lru_cache(maxsize=None)
def _row_loader(head_dim, element, hadamard):
    """load_row(x32, signs, b, h, row, lane, vals): the lane's E = d / 32 values of a row, as the
    quantisers read them (transformed when `hadamard`)."""
    E = head_dim // 32
    IN_WORDS = E // 2
    LOG_E = E.bit_length() - 1
    HADAMARD, ELEM = hadamard, element.code
    INV_SQRT_D = float32(1 / math.sqrt(head_dim))

    @device_function
    def load_row(x32, signs, b, h, row, lane, vals):
        """vals <- the lane's E values of row `row`, transformed by diag(signs) H / sqrt(d)."""
        for w in range(IN_WORDS):
            word = x32[b, h, row, lane * IN_WORDS + w]
            lo, hi = tiles.unpack_pair(word, ELEM)
            vals[2 * w] = lo
            vals[2 * w + 1] = hi
        if HADAMARD:
            for e in range(E):
                vals[e] *= signs[lane * E + e]
            for k in range(LOG_E):             # butterflies on the column bits inside the lane
                s = 1 << k
                for e in range(E):
                    if e & s == 0:
                        a = vals[e]
                        c = vals[e + s]
                        vals[e] = a + c
                        vals[e + s] = a - c
            for k in range(5):                 # ... and on the lane bits, across lanes
                upper = (lane >> k) & 1
                for e in range(E):
                    other = ptx.shfl_xor_f32(vals[e], 1 << k)
                    vals[e] = other - vals[e] if upper else vals[e] + other
            for e in range(E):
                vals[e] *= INV_SQRT_D

    return load_row


@lru_cache(maxsize=None)
def _quantizer(head_dim, element, hadamard, scope):
    """The quantiser kernel: one thread block a (block of rows, head, batch), a warp a row at a
    time, lane l holding columns l E .. l E + E - 1 (E = d / 32). scope:
      "block"     amax over the block's rows, then quantise with it (one pass over the input each),
      "amax"      only the block's amax, folded into amax[0] by an atomic max (per-tensor, step 1),
      "head_amax" the same into amax[b H + h] (a scale a head: the K-major quantiser's step 1),
      "tensor"    quantise with amax[0] (per-tensor, step 2)."""
    E = head_dim // 32
    WARPS = THREADS // 32
    FIND_AMAX = scope in ("block", "amax", "head_amax")
    QUANTISE = scope in ("block", "tensor")
    BLOCK_SCOPE, ATOMIC, PER_HEAD = scope == "block", scope in ("amax", "head_amax"), \
        scope == "head_amax"
    load_row, store_row = _row_loader(head_dim, element, hadamard), _row_storer(head_dim)
    block_max = _block_max(WARPS)

    @kernel
    def quantize(x32, signs, out32, descale, amax, n, rows):
        blk, h, b, tid, warp, lane, row0, row1 = block_rows(n, rows)
        vals = cuda.local.array(E, float32)
        peak = cuda.shared.array(WARPS, float32)
        top = float32(0)
        # Every warp makes the same number of passes (rows past the block's end re-read its last
        # row and are not used): the transform's shuffles are warp-collective.
        passes = (row1 - row0 + WARPS - 1) // WARPS
        if FIND_AMAX:
            for i in range(passes):
                row = row0 + i * WARPS + warp
                load_row(x32, signs, b, h, min(row, row1 - 1), lane, vals)
                for e in range(E):
                    top = max(top, abs(vals[e]))
            top = block_max(top, peak, warp, lane)
            if ATOMIC:
                if tid == 0:
                    cuda.atomic.max(amax, b * cuda.gridDim.y + h if PER_HEAD else 0, top)
                return
        if not BLOCK_SCOPE:
            top = amax[0]
        scale = float32(E4M3_MAX) / top if top > float32(0) else float32(1)
        if tid == 0:
            descale[b, h, 0 if not BLOCK_SCOPE else blk] = float32(1) / scale
        if QUANTISE:
            for i in range(passes):
                row = row0 + i * WARPS + warp
                load_row(x32, signs, b, h, min(row, row1 - 1), lane, vals)
                if row < row1:
                    store_row(out32, b, h, row, lane, vals, 0, scale)

    return quantize


ONE_PASS_WARPS = 16             # the one-pass block quantiser's warps (512 threads)
ONE_PASS_VALUES = 64            # ... and the values of its rows a lane may hold in registers


def one_pass_rows(head_dim, block):
    """Rows a warp of the one-pass block quantiser holds, or 0 where the block's transformed rows do
    not fit its registers (then the two-pass kernel runs)."""
    if block is None or block % ONE_PASS_WARPS:
        return 0
    rows = block // ONE_PASS_WARPS
    return rows if rows * (head_dim // 32) <= ONE_PASS_VALUES else 0


@lru_cache(maxsize=None)
def _one_pass_quantizer(head_dim, element, hadamard, rows_a_warp):
    """Block quantisation in one pass: ONE_PASS_WARPS warps a (block of rows, head, batch), warp w
    holding the rows w, w + 16, ... (`rows_a_warp` of them, E = d / 32 values each a lane, in
    registers: the loops over them are unrolled), so that each row is read and transformed once
    (the two-pass kernel reads and transforms it again to quantise). The same arithmetic in the
    same order per value: the same bits as `_quantizer(..., "block")`."""
    E = head_dim // 32
    R, WARPS = rows_a_warp, ONE_PASS_WARPS
    VALUES = R * E                   # a lane's values of its rows (a compile-time array size)
    load_row, store_row = _row_loader(head_dim, element, hadamard), _row_storer(head_dim)
    block_max = _block_max(WARPS)

    @kernel
    def quantize(x32, signs, out32, descale, amax, n, rows):
        blk, h, b, tid, warp, lane, row0, row1 = block_rows(n, rows)
        vals = cuda.local.array(VALUES, float32)
        row_vals = cuda.local.array(E, float32)
        peak = cuda.shared.array(WARPS, float32)
        top = float32(0)
        for i in range(R):   # rows past the block's end re-read its last row, not stored
            load_row(x32, signs, b, h, min(row0 + i * WARPS + warp, row1 - 1), lane, row_vals)
            for e in range(E):
                vals[i * E + e] = row_vals[e]
                top = max(top, abs(row_vals[e]))
        top = block_max(top, peak, warp, lane)
        scale = float32(E4M3_MAX) / top if top > float32(0) else float32(1)
        if tid == 0:
            descale[b, h, blk] = float32(1) / scale
        for i in range(R):
            row = row0 + i * WARPS + warp
            if row < row1:
                store_row(out32, b, h, row, lane, vals, i * E, scale)

    return quantize


def _fp8_empty(library, shape, like):
    return arrays.empty(library, shape, "float8_e4m3fn" if library == "torch" else "uint8",
                        like=like)


def quantize_fp8(x, *, block=DEFAULT_BLOCK, signs=None, k_major=False):
    """x (B, N, H, d) fp16/bf16 on the GPU -> (x8, descale): x8 e4m3 of the same shape (torch
    float8_e4m3fn for torch input, uint8 bits for CuPy/Numba) and descale float32 (B, H, nb) with
    x ~= descale[b, h, row // block] * x8 (block quantisation; block=None: one scale for the
    whole tensor, descale (B, H, 1) all equal). signs (d,) +-1 (`random_signs`, on the device or
    host): quantise x diag(signs) H / sqrt(d) instead (incoherent processing; give Q and K the
    same signs, V none). Two launches per-tensor (amax, then quantise), one per block: in one
    pass where the block's rows fit the registers of 16 warps (`one_pass_rows`: d=128 up to 256
    rows, d=256 up to 128), else reading each row twice (amax, then quantise).

    k_major=True (for V): x8 is a KMajorV, the same e4m3 values written as V^T in fa3's layout
    by the quantising pass itself (`_k_major_quantizer`), so that fa3 runs no pre-pass on it.
    fa3 takes one V scale a head: block=None (one a tensor) or block >= N (one a head); two
    launches either way (amax, then quantise)."""
    dx = arrays.describe(x, "x")
    if len(dx.shape) != 4 or dx.dtype not in ("float16", "bfloat16"):
        raise TypeError(f"quantize_fp8 takes a (batch, seqlen, heads, head_dim) float16 or "
                        f"bfloat16 array, got {dx.dtype} of shape {dx.shape}")
    b, n, h, d = dx.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"quantize_fp8 supports head_dim in {HEAD_DIMS}, got {d}")
    if dx.strides[3] != dx.itemsize or any(s % 16 for s in dx.strides[:3]) or dx.ptr % 16:
        raise ValueError("quantize_fp8: x must be contiguous along head_dim with 16-byte aligned rows")
    if block is not None and (int(block) != block or block < 1):
        raise ValueError(f"block must be a positive number of rows or None, got {block!r}")
    stream = arrays.stream_of(dx)
    x32 = arrays.bits_view(dx, np.uint32, _BSHD_TO_BHSD, last_dim_divisor=2)
    element = elements.element(dx.dtype)
    if k_major:
        if block is not None and block < n:
            raise ValueError(f"k_major: fa3 takes one V scale a head, so V is quantised with "
                             f"block=None (one scale a tensor) or block >= seqlen ({n}), got {block}")
        if signs is not None:
            raise ValueError("k_major is for V, which takes no incoherent processing (signs: Q "
                             "and K only)")
        return _quantize_k_major(dx, x, x32, element, block is not None, stream)
    nb = 1 if block is None else -(-n // block)
    descale = arrays.empty(dx.library, (b, h, nb), "float32", like=x)
    x8 = _fp8_empty(dx.library, (b, n, h, d), x)
    out32 = arrays.bits_view(arrays.describe(x8), np.uint32, _BSHD_TO_BHSD, last_dim_divisor=4)
    dd = arrays.bits_view(arrays.describe(descale), np.float32)
    if signs is None:
        sign_view, hadamard = arrays.placeholder(dx.library, 1, x), False
    else:
        sign_view, hadamard = _signs_view(signs, d, dx.library, x), True
    if block is not None:
        rows_a_warp = one_pass_rows(d, block)
        if rows_a_warp:
            kern, threads = _one_pass_quantizer(d, element, hadamard, rows_a_warp), \
                32 * ONE_PASS_WARPS
        else:
            kern, threads = _quantizer(d, element, hadamard, "block"), THREADS
        launch(kern, (nb, h, b), threads, 0, stream, x32, sign_view, out32, dd,
               arrays.placeholder(dx.library, 1, x), np.int32(n), np.int32(block))
        return x8, descale
    amax = arrays.zeros(dx.library, (1,), "float32", like=x)
    av = arrays.bits_view(arrays.describe(amax), np.float32)
    rows = DEFAULT_BLOCK
    grid = (-(-n // rows), h, b)
    launch(_quantizer(d, element, hadamard, "amax"), grid, THREADS, 0, stream,
           x32, sign_view, out32, dd, av, np.int32(n), np.int32(rows))
    launch(_quantizer(d, element, hadamard, "tensor"), grid, THREADS, 0, stream,
           x32, sign_view, out32, dd, av, np.int32(n), np.int32(rows))
    return x8, descale


def _quantize_k_major(dx, x, x32, element, per_head, stream):
    """quantize_fp8(x, k_major=True): the amax (of the tensor, or of each head: per_head), then
    `_k_major_quantizer`. Returns (KMajorV, descale (B, H, 1))."""
    b, n, h, d = dx.shape
    n_pad = -(-n // V_KEYS) * V_KEYS
    vt = KMajorV(arrays.empty(dx.library, (b, h, d, n_pad), "uint8", like=x), n)
    descale = arrays.empty(dx.library, (b, h, 1), "float32", like=x)
    amax = arrays.zeros(dx.library, (b * h if per_head else 1,), "float32", like=x)
    av, dd = (arrays.bits_view(arrays.describe(a), np.float32) for a in (amax, descale))
    rows = DEFAULT_BLOCK
    launch(_quantizer(d, element, False, "head_amax" if per_head else "amax"), (-(-n // rows), h, b),
           THREADS, 0, stream, x32, arrays.placeholder(dx.library, 1, x), x32, dd, av, np.int32(n),
           np.int32(rows))   # (out32: unwritten by the amax scopes)
    launch(_k_major_quantizer(d, element, per_head), (n_pad // V_KEYS, h, b), V_THREADS, 0, stream,
           x32, _k_major_words(vt.data), dd, av, np.int32(n))
    return vt, descale


@lru_cache(maxsize=None)
def _k_major_quantizer(head_dim, element, per_head):
    """16-bit V (B, H, N, d / 2 words) -> e4m3 V^T (B H d, N_pad / 4 words) in fa3's layout, in
    the pass that quantises it: `_v_k_major_kernel`'s blocks of V_KEYS keys and V_THREADS threads,
    each thread's 16-byte loads issued first, then each 8 values times the scale made two e4m3 words
    of the tile, which `_k_major_writer` moves to V^T. The scale is 448 / amax, amax[0] or (per_head)
    amax[b H + h] as the amax kernel left it: the same arithmetic per value as the row-major
    quantiser, so V^T holds the bytes `v_k_major` makes of its output."""
    WORDS_IN = head_dim // 2                        # 32-bit words (16-bit pairs) a key's row
    CHUNKS = WORDS_IN // 4                          # 16-byte chunks a key's row
    KEY_STEP = V_THREADS // CHUNKS                  # keys between a thread's loads
    LOADS = V_KEYS // KEY_STEP
    STRIDE = head_dim // 4 + 1                      # the tile's rows of e4m3 words, padded
    TILE_WORDS = V_KEYS * STRIDE
    VALS = 4 * LOADS                                # the words a thread's loads bring
    ELEM, PER_HEAD = element.code, per_head
    load, write_k_major = _key_chunk_loader(WORDS_IN), _k_major_writer(head_dim, V_THREADS)

    @kernel
    def quantize(x32, vt32, descale, amax, n):
        chunk, h, b, heads, tid, k0 = key_chunk()
        tile = cuda.shared.array(TILE_WORDS, uint32)
        vals = cuda.local.array(VALS, uint32)
        load(x32, b, h, k0, tid, n, vals)
        top = amax[b * heads + h if PER_HEAD else 0]
        scale = float32(E4M3_MAX) / top if top > float32(0) else float32(1)
        if chunk == 0 and tid == 0:
            descale[b, h, 0] = float32(1) / scale
        for i in range(LOADS):
            key = i * KEY_STEP + tid // CHUNKS
            for w in range(2):      # columns 8 c + 4 w .. 8 c + 4 w + 3 of chunk c: a word
                lo0, hi0 = tiles.unpack_pair(vals[4 * i + 2 * w], ELEM)
                lo1, hi1 = tiles.unpack_pair(vals[4 * i + 2 * w + 1], ELEM)
                word = ptx.pack_e4m3x4(lo0 * scale, hi0 * scale, lo1 * scale, hi1 * scale)
                tile[key * STRIDE + 2 * (tid % CHUNKS) + w] = word if k0 + key < n else uint32(0)
        cuda.syncthreads()
        write_k_major(tile, vt32, b, h, heads, chunk, tid)

    return quantize


def _k_major_words(vt):
    """V^T (B, H, d, N_pad) uint8 as the K-major writers store it: (B H d, N_pad / 4) words."""
    b, h, d, n_pad = arrays.describe(vt).shape
    rows = dataclasses.replace(arrays.describe(vt), shape=(b * h * d, n_pad), strides=(n_pad, 1))
    return arrays.bits_view(rows, np.uint32, None, last_dim_divisor=4)


def _signs_view(signs, d, library, like):
    if isinstance(signs, np.ndarray):
        if signs.shape != (d,) or not np.all(np.abs(signs) == 1):
            raise ValueError(f"signs must be {d} values of +1 or -1, got shape {signs.shape}")
        from common.host.arrays import to_device
        signs = to_device(signs.astype(np.float32), library)
    ds = arrays.describe(signs, "signs")
    if ds.shape != (d,) or ds.dtype != "float32":
        raise ValueError(f"signs must be float32 of shape ({d},), got {ds.dtype} {ds.shape}")
    return arrays.bits_view(ds, np.float32)


# --------------------------------------------------------------------------- V, K-major

@lru_cache(maxsize=None)
def _v_k_major_kernel(head_dim, trigger):
    """V (B, H, N, d/4 words of 4 e4m3) -> V^T (B H d, N_pad/4 words): a block moves V_KEYS keys
    through shared memory; output position p of each 16 keys takes key KEY_ORDER[p].

    A copy kernel, so what counts is bytes in flight and instructions a byte: each thread first
    issues all its LOADS 16-byte loads (a constant count, unrolled: 4 at d=128, 8 at d=256; a warp
    reads 4 whole rows of V, 2 at d=256), then stores their words to the tile (at d=128 a
    warp's 32 stores of one word hit 32 banks: rows 33 words apart, chunks 4 words; at d=256 two
    ways). Then `_k_major_writer` moves the tile to V^T (one column pass a thread at d=128, two
    at d=256).

    trigger: let a programmatic dependent launch start at once (`griddep_launch_dependents`, sm_90
    on: fa3's kernel, Config.pdl), its blocks taking the SMs as these leave; it waits for this
    grid's end before it reads V^T."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"V's K-major pre-pass takes head_dim in {HEAD_DIMS}, got {head_dim}")
    WORDS = head_dim // 4       # 32-bit words a key's row
    STRIDE = WORDS + 1          # ... in shared memory, padded
    TILE_WORDS = V_KEYS * STRIDE
    CHUNKS = WORDS // 4                             # 16-byte chunks a key's row
    KEY_STEP = V_THREADS // CHUNKS                  # keys between a thread's loads
    LOADS = V_KEYS // KEY_STEP
    VALS = 4 * LOADS                                # the words they bring
    load, write_k_major = _key_chunk_loader(WORDS), _k_major_writer(head_dim, V_THREADS)

    @kernel
    def v_k_major(v32, vt32, n):
        if trigger:
            sm90.griddep_launch_dependents()
        chunk, h, b, heads, tid, k0 = key_chunk()
        tile = cuda.shared.array(TILE_WORDS, uint32)
        vals = cuda.local.array(VALS, uint32)
        load(v32, b, h, k0, tid, n, vals)
        for i in range(LOADS):
            key = i * KEY_STEP + tid // CHUNKS
            for w in range(4):
                tile[key * STRIDE + 4 * (tid % CHUNKS) + w] = \
                    vals[4 * i + w] if k0 + key < n else uint32(0)
        cuda.syncthreads()
        write_k_major(tile, vt32, b, h, heads, chunk, tid)

    return v_k_major


@device_function
def key_chunk():
    """A K-major kernel's block: (chunk, h, b, heads, tid, k0), its V_KEYS keys k0 .. of head
    (b, h), as the grid (N_pad / V_KEYS, H, B) places it."""
    chunk = cuda.blockIdx.x
    return chunk, cuda.blockIdx.y, cuda.blockIdx.z, cuda.gridDim.y, int32(cuda.threadIdx.x), \
        chunk * V_KEYS


@lru_cache(maxsize=None)
def _key_chunk_loader(words):
    """load(src32, b, h, k0, tid, n, vals): V_KEYS keys from k0 of head (b, h) of src32 (B, H, N,
    `words` 32-bit words a key) by V_THREADS threads, each thread's 16-byte loads issued first
    (a constant count, unrolled), into vals[4 i .. 4 i + 3]: thread tid reads 16-byte chunk
    tid % CHUNKS of keys k0 + tid // CHUNKS + i KEY_STEP. Keys past N re-read the last one (the
    caller zeroes them)."""
    CHUNKS = words // 4
    KEY_STEP = V_THREADS // CHUNKS
    LOADS = V_KEYS // KEY_STEP

    @device_function
    def load(src32, b, h, k0, tid, n, vals):
        first, column = uint32(k0 + tid // CHUNKS), uint32(4 * (tid % CHUNKS))
        last = uint32(n - 1)
        for i in range(LOADS):      # unsigned indices: no negative-index wrap-around to compute
            x = ptx.ld_global_v4_u32(src32, uint32(b), uint32(h),
                                     min(first + uint32(i * KEY_STEP), last), column)
            for w in range(4):
                vals[4 * i + w] = x[w]

    return load


@lru_cache(maxsize=None)
def _k_major_writer(head_dim, threads):
    """write(tile, vt32, b, h, heads, chunk, tid): V_KEYS keys of V in shared memory (`tile`: a
    key's row of head_dim / 4 words, rows head_dim / 4 + 1 words apart) to V^T's keys
    chunk V_KEYS .. (chunk + 1) V_KEYS - 1 of head (b, h) (vt32: (B H d, N_pad / 4) words), in
    KEY_ORDER within each 16, by `threads` threads. A thread owns a 4 x 16 block of the output in
    each of its column passes (head_dim rows 4 c .. 4 c + 3, key group g): it reads the group's 16
    words of column c (conflict-free: half a warp spans 16 columns, the other half the next group,
    and the padded row stride puts group g + 1's word 16 banks on), transposes the 4 x 4 bytes of
    each 4 keys that one output word holds, and writes four 16-byte rows. `v_k_major` (V^T from e4m3
    V) and the K-major quantiser (V^T from 16-bit V) share it."""
    WORDS = head_dim // 4
    STRIDE = WORDS + 1
    GROUPS = V_KEYS // 16
    WARPS = threads // 32
    COLUMN_PASSES = WORDS * GROUPS // threads       # (group, column) blocks a thread
    assert COLUMN_PASSES * threads == WORDS * GROUPS

    @device_function
    def write(tile, vt32, b, h, heads, chunk, tid):
        warp, lane = tid >> 5, tid & 31
        words = cuda.local.array(16, uint32)
        for cp in range(COLUMN_PASSES):
            unit = cp * WARPS + warp                    # (two groups, 16 columns) a warp
            g = 2 * (unit % (GROUPS // 2)) + (lane >> 4)
            c = 16 * (unit // (GROUPS // 2)) + (lane & 15)
            for k in range(16):
                words[k] = tile[(16 * g + k) * STRIDE + c]
            row = (b * heads + h) * head_dim + 4 * c
            col = chunk * (V_KEYS // 4) + 4 * g
            for i in range(4):                          # head_dim row 4 c + i
                shift = uint32(8 * i)
                out0 = _gather_bytes(words[0], words[1], words[8], words[9], shift)
                out1 = _gather_bytes(words[2], words[3], words[10], words[11], shift)
                out2 = _gather_bytes(words[4], words[5], words[12], words[13], shift)
                out3 = _gather_bytes(words[6], words[7], words[14], words[15], shift)
                ptx.st_global_v4_u32(vt32, row + i, col, out0, out1, out2, out3)

    return write


@device_function
def _gather_bytes(a, b, c, d, shift):
    """Byte `shift / 8` of a, b, c, d, packed low to high: keys KEY_ORDER[4 t .. 4 t + 3] =
    (2 t, 2 t + 1, 2 t + 8, 2 t + 9) of one output word t."""
    m = uint32(0xFF)
    return (((a >> shift) & m) | (((b >> shift) & m) << uint32(8))
            | (((c >> shift) & m) << uint32(16)) | (((d >> shift) & m) << uint32(24)))


@lru_cache(maxsize=None)
def unit_transposer(head_dim, warps):
    """transpose(smem, src, dst, warp, lane): fa3's in-kernel V^T (FA3 section 3.3, "in-kernel
    transpose"), by `warps` warps of the producer: V_UNIT_KEYS keys of V as TMA lands them (rows of
    head_dim e4m3 bytes in 128-byte panels of V_UNIT_KEYS rows, 128-byte swizzled) at 16-bit
    element `src` of shared memory `smem`, into one panel of V^T at element `dst` (head_dim rows of
    V_UNIT_KEYS keys, keys in KEY_ORDER within each 16, swizzled likewise): what `v_k_major` writes
    to HBM, for one 128-key panel, in the layout the P V wgmma's descriptor reads.

    FA3's way, with the 8x8 16-bit matrix instructions: a warp moves 16 keys x 32 columns at a
    time. ldmatrix.x4.trans reads them as four 8x8 matrices of 16-bit pairs (keys 0-7 and 8-15 of
    two 16-byte column chunks), so that lane (c, t) holds bytes (2c, 2c + 1) of keys 2t, 2t + 1 in
    one register and of keys 2t + 8, 2t + 9 in the next; two byte permutes make of them column 2c's
    and column 2c + 1's four keys in KEY_ORDER's positions 4t .. 4t + 3 (EVEN, ODD: a PRMT each), and
    stmatrix.x4 writes the four registers as 16-byte rows of V^T. Every address is a lane's row:
    the swizzle is applied per row, and neither the reads nor the writes have bank conflicts (the
    selectors are chosen per lane so that a matrix holds 8 rows of distinct row mod 8). A warp's
    blocks are compile-time constants (`blocks_of`), so a block costs about ten instructions: two
    addresses of an XOR and an add each, the ldmatrix, four PRMTs, the stmatrix."""
    ROW = 64                                      # a 128-byte row, in 16-bit elements
    PANEL = V_UNIT_KEYS * ROW                     # a staged panel: V_UNIT_KEYS keys x 128 bytes
    GROUPS = V_UNIT_KEYS // 16
    BLOCKS = (head_dim // 32) * GROUPS            # (32-column block, 16-key group) pairs
    ITERS = -(-BLOCKS // warps)                   # blocks a warp, at most

    @device_function
    def blocks_of(smem, ld0, ld_swz, st0, st_swz, sel0, sel1, w):
        """Warp w's blocks w, w + warps, ...: inlined once per w with w a constant, so that each
        block's group g and column block cb are constants and an address is a lane's part, one XOR
        (the swizzle: the lane's row mod 8 against the block's chunk) and one add."""
        for k in range(ITERS):
            x = w + warps * k
            if x < BLOCKS:
                g, cb = x % GROUPS, x // GROUPS
                r0, r1, r2, r3 = ptx.ldmatrix_x4_trans(
                    smem, ld0 + (ld_swz ^ uint32(((2 * cb) & 7) << 3))
                    + uint32((cb >> 2) * PANEL + g * 16 * ROW))
                sm90.stmatrix_x4(smem, st0 + (st_swz ^ uint32(g << 3)) + uint32(32 * cb * ROW),
                                 ptx.prmt(r0, r1, sel0), ptx.prmt(r0, r1, sel1),
                                 ptx.prmt(r2, r3, sel0), ptx.prmt(r2, r3, sel1))

    @device_function
    def transpose(smem, src, dst, warp, lane):
        m, r = uint32(lane) >> uint32(3), uint32(lane) & uint32(7)   # the matrix, the row a lane addresses
        half = m >> uint32(1)
        # ldmatrix: key 8 (m & 1) + r of the group, 16-byte chunk 2 cb + half, which the swizzle
        # puts at chunk (2 cb + half) ^ r = 2 cb ^ (half ^ r) (2 cb even, half 0 or 1)
        ld0 = uint32(src) + (uint32(8) * (m & uint32(1)) + r) * uint32(ROW)
        ld_swz = (half ^ r) << uint32(3)
        # The words: lane (c, t) makes column 2c's (selector EVEN) and column 2c + 1's (ODD) from
        # the ldmatrix registers; lanes c < 4 put column 2c in stmatrix's first register of the
        # chunk, lanes c >= 4 column 2c + 1, so that a matrix's 8 rows are rows 0, 2, 4, 6, 9, 11,
        # 13, 15 (or 1, 3, 5, 7, 8, 10, 12, 14) of the chunk's 16: all 8 rows mod 8, all 8 chunks
        # of the swizzle, no bank conflict
        flip = (uint32(lane) >> uint32(4)) & uint32(1)                # c >= 4
        sel0 = EVEN if flip == 0 else ODD
        sel1 = ODD if flip == 0 else EVEN
        # stmatrix: lane (m, r) addresses row r of matrix m: V^T row 32 cb + vt_row, whose chunk
        # g the swizzle puts at g ^ (vt_row mod 8)
        vt_row = uint32(16) * half + uint32(2) * r + ((m & uint32(1)) ^ (r >> uint32(2)))
        st0 = uint32(dst) + vt_row * uint32(ROW)
        st_swz = (vt_row & uint32(7)) << uint32(3)
        for w in range(warps):
            if warp == w:
                blocks_of(smem, ld0, ld_swz, st0, st_swz, sel0, sel1, w)

    return transpose


# prmt selectors: from lo = bytes (c, c + 1) of keys k, k + 1 and hi = the same of keys k + 8,
# k + 9 (two 16-bit pairs each, as ldmatrix.trans gives them), column c's (EVEN) and column
# c + 1's (ODD) word of keys (k, k + 1, k + 8, k + 9), low byte first
EVEN, ODD = uint32(0x6420), uint32(0x7531)


@dataclasses.dataclass(frozen=True)
class KMajorV:
    """V as fa3's FP8 P V wgmma reads it, made once, taken by `fa3.forward` in place of V (no
    pre-pass in the call: FA3's V_colmajor): `data` (B, H_kv, d, N_pad) uint8 bits, V^T with keys
    contiguous, N_pad = `seqlen` rounded up to V_KEYS, zeros past seqlen, each 16 keys in
    KEY_ORDER. `v_k_major` makes it from e4m3 V; `quantize_fp8(v, k_major=True)` from 16-bit V in
    the quantiser's own pass (what a model quantising V for attention would do)."""
    data: object
    seqlen: int

    def check(self, like, name="v"):
        """The error that names what is wrong with this V^T beside `like` (a KernelView of K:
        (B, N_k, H_kv, d)), or nothing."""
        b, n, h, d = like.shape
        n_pad = -(-n // V_KEYS) * V_KEYS
        dv = arrays.describe(self.data, f"{name} (K-major)")
        want = (b, h, d, n_pad)
        if self.seqlen != n or dv.shape != want or dv.dtype != "uint8":
            raise ValueError(f"a K-major {name} (fp8.KMajorV) beside k of shape {like.shape} must "
                             f"hold uint8 {want} for seqlen {n}, got {dv.dtype} {dv.shape} for "
                             f"seqlen {self.seqlen}")
        if dv.strides != (h * d * n_pad, d * n_pad, n_pad, 1) or dv.ptr % 16:
            raise ValueError(f"a K-major {name} (fp8.KMajorV) must be contiguous and 16-byte "
                             f"aligned, got strides {dv.strides}, address {dv.ptr:#x}")
        if dv.library != like.library:
            raise ValueError(f"a K-major {name} (fp8.KMajorV) must be a {like.library} array like "
                             f"k, got {dv.library}")


def v_k_major(v8, like=None):
    """e4m3 V (B, N, H_kv, d) -> KMajorV: V^T (B, H_kv, d, N_pad) uint8 bits (N_pad = N rounded up
    to V_KEYS, zeros past N), keys in KEY_ORDER within each 16: the B operand of the FP8 P V
    wgmma."""
    vt, run = v_k_major_deferred(v8)
    run()
    return KMajorV(vt, arrays.describe(v8, "v").shape[1])


def v_k_major_deferred(v8, stream=None):
    """(V^T, run): `v_k_major`'s output allocated and `run()` the launch that fills it, on `stream`
    (a raw handle; None: V's library's current stream), so that a caller can do its host work on
    V^T (fa3: its tensor map) before the launch, and launch its kernel right after it (a
    programmatic dependent, Config.pdl: nothing on the stream between)."""
    dv = arrays.describe(v8, "v")
    b, n, h, d = dv.shape
    kern = _v_k_major_kernel(d, _triggers())   # (refuses a head_dim it does not take)
    if dv.strides[-1] != 1 or any(x % 16 for x in (dv.ptr,) + dv.strides[:-1]):
        raise ValueError(f"V's K-major pre-pass reads V's rows in 16-byte pieces: V must be "
                         f"16-byte aligned with contiguous rows and 16-byte strides, got address "
                         f"{dv.ptr:#x}, byte strides {dv.strides}")
    n_pad = -(-n // V_KEYS) * V_KEYS
    vt = arrays.empty(dv.library, (b, h, d, n_pad), "uint8", like=v8)
    v32 = arrays.bits_view(dv, np.uint32, _BSHD_TO_BHSD, last_dim_divisor=4)
    vt32 = _k_major_words(vt)
    stream = arrays.stream_of(dv) if stream is None else stream

    def run():
        launch(kern, (n_pad // V_KEYS, h, b), V_THREADS, 0, stream, v32, vt32, np.int32(n))
    return vt, run


@lru_cache(maxsize=None)
def _triggers():
    """Whether the pre-pass lets a programmatic dependent start early: where PDL exists (sm_90
    on; griddepcontrol does not assemble before), and in the simulator (a no-op there)."""
    return SIMULATOR or tuple(cuda.get_current_device().compute_capability) >= (9, 0)


def compile_targets():
    """(name, kernel, argument types) of the pre-pass kernels, bf16 at head_dim 128."""
    from numba import types
    u32_4 = types.Array(types.uint32, 4, "A")
    f32_1 = types.Array(types.float32, 1, "C")
    f32_3 = types.Array(types.float32, 3, "C")
    for scope in ("block", "amax", "tensor"):
        yield (f"quantize_fp8 {scope}", _quantizer(128, elements.BFLOAT16, True, scope),
               (u32_4, f32_1, u32_4, f32_3, f32_1, types.int32, types.int32))
    yield ("quantize_fp8 block one_pass",
           _one_pass_quantizer(128, elements.BFLOAT16, True, one_pass_rows(128, DEFAULT_BLOCK)),
           (u32_4, f32_1, u32_4, f32_3, f32_1, types.int32, types.int32))
    u32_2 = types.Array(types.uint32, 2, "C")
    yield ("quantize_fp8 k_major", _k_major_quantizer(128, elements.BFLOAT16, False),
           (u32_4, u32_2, f32_3, f32_1, types.int32))
    yield "v_k_major", _v_k_major_kernel(128, True), (u32_4, u32_2, types.int32)
