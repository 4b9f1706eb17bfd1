"""Shared-memory tiles, tensor-core fragments and warp-level GEMMs: the tiling layer of every variant.

Vocabulary (used in all variants):
- tile: a ROWS x COLS block of 16-bit elements (uint16 bit patterns) in shared memory, row-major
  with either a swizzled layout (each 16-byte chunk XOR-ed with row % 8, no padding) or padded rows
  (8 extra elements a row). Both make the 8 row addresses of one `ldmatrix` hit distinct banks.
- fragment: the registers one lane holds of an mma.m16n8k16 operand (see `common/hardware/lanes.py` for
  the exact lane layout). Register arrays are `cuda.local.array`s indexed only by loop counters that
  NVVM unrolls, so they live in registers:
    A operand  a[m, kk, 0:4]   uint32  rows 16m.., columns 16kk..    (two 16-bit values a register)
    B operand  loaded on the fly from a tile, two n8 tiles per ldmatrix.x4
    accumulator acc[m, n, 0:4] float32 rows 16m.., columns 8n..
- a warp owns 16*M rows of the block; every helper here is called by all 32 lanes of the warp.
- elem: the element type's code (common/hardware/elements.py), a compile-time constant of the kernel; only
  `mma`, `pack_pair`, `unpack_pair` and `accumulator_to_a` branch on it, the GEMMs and epilogues pass it along.

All helpers take their sizes from the shapes of the fragment arrays or from arguments that are
compile-time constants in the calling kernel, so they unroll completely.
"""
import numpy as np
from numba import float32, int32

from common.hardware import ptx
from common.hardware.elements import BF16, E4M3
from common.hardware.target import device_function

NEG_INF = np.float32(-np.inf)


# --------------------------------------------------------------------------- layouts

# The head dims the tile layer takes: multiples of 8 (whole 16-byte rows in HBM), 32 to 256. A tile
# holds `tile_columns(d)` columns, d rounded up to a whole k16 step of the mma: the columns past d
# are zero-filled by the copies that load the tile (cp.async's zero fill: no HBM traffic) and left
# out by the copies that store it (`valid_cols` of load_tile_async / store_tile), so a padded
# column adds 0 to every dot product and is never written. 64, 128 and 256 columns get the
# swizzled layout; any other takes padded rows: a row of c + 8 elements is an odd number of
# 16-byte chunks when c is a multiple of 16, so the 8 rows of one ldmatrix still fall in 8
# distinct bank groups.
HEAD_DIMS = tuple(range(32, 257, 8))


def tile_columns(head_dim):
    """Columns of a tile that holds rows of head_dim elements: head_dim rounded up to a multiple of
    16 (a whole k-step of mma.m16n8k16); the rest are zeros."""
    return (head_dim + 15) // 16 * 16


def swizzle_fits(cols):
    """Whether a tile of `cols` 16-bit columns can take the swizzled layout: whole 128-byte groups
    of 8 chunks (XOR-ed with row % 8), and a power-of-two row, so that the column steps of
    `column_step` are XORs that leave the row's bits alone (192 is not). Otherwise its rows are
    padded (tile_row_stride(cols, False))."""
    return cols >= 64 and cols & (cols - 1) == 0


def check_head_dim(head_dim, variant, head_dims=HEAD_DIMS):
    """Refuse a head_dim the kernels cannot take, naming what they can."""
    if head_dim not in head_dims:
        raise ValueError(f"{variant} supports head_dim in {describe_head_dims(head_dims)}, got "
                         f"{head_dim}")


def describe_head_dims(head_dims):
    """(64, 128), or "multiples of 8 from 32 to 256" for the tile layer's whole range."""
    if tuple(head_dims) == HEAD_DIMS:
        return "multiples of 8 from 32 to 256"
    return str(tuple(head_dims))


def tile_row_stride(cols, swizzle):
    """Elements between consecutive rows of a tile (host side: sizes shared memory)."""
    if swizzle and not swizzle_fits(cols):
        raise ValueError(f"a swizzled tile needs a power-of-two multiple of 64 columns, got {cols}")
    return cols if swizzle else cols + 8


def check_tile_copy(rows, cols, nthreads):
    """Host-side check of `load_tile_async`/`store_tile`'s work split: whole 16-byte chunks."""
    if cols % 8 or rows < 1:
        raise ValueError(f"a {rows}x{cols} tile does not split into 16-byte copies over "
                         f"{nthreads} threads")


@device_function
def smem_offset(row, col, row_stride, swizzle):
    """Element offset of (row, col) in a tile. Swizzle: 16-byte chunk index XOR (row % 8)."""
    if swizzle:
        return int32(row * row_stride + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7))
    return int32(row * row_stride + col)


@device_function
def column_step(base, i, swizzle):
    """Offset of a lane's ldmatrix row address moved i 16-column steps right of `base`.

    A lane's ldmatrix rows are always congruent to the lane modulo 8 (fragments start at multiples
    of 8 rows), so the swizzle pattern XOR (row % 8) is fixed per lane and a 16-column step is an
    XOR of the offset with i * 16 (the step touches only chunk bits that the row part leaves clear).
    Written this way the compiler keeps one base register and folds the steps into immediates."""
    if swizzle:
        return int32(base ^ (i << 4))
    return int32(base + (i << 4))


@device_function
def chunk_step(base, n, swizzle):
    """Offset `base` (a column of some row's first 8-column chunk) moved n chunks right, n a
    compile-time constant. Swizzled, chunk n of row r sits at chunk n ^ (r % 8): an XOR of the
    chunk bits with n % 8, plus 64 columns a whole 8 chunks; the compiler keeps one base register
    per row and folds the steps into immediates (row strides are multiples of 64 columns)."""
    if swizzle:
        return int32((base ^ ((n & 7) << 3)) + ((n >> 3) << 6))
    return int32(base + (n << 3))


# --------------------------------------------------------------------------- global -> shared

@device_function
def copy_split(tid, cols, nthreads):
    """How a tile of `cols` 16-bit columns is split into 16-byte copies over `nthreads` threads
    when `split_by_columns`: thread `tid` copies the chunk at column `col` of rows r, r + row_step,
    r + 2 row_step, ... Returns (r, col, row_step)."""
    chunks_per_row = cols >> 3
    r = tid // chunks_per_row
    return r, (tid - r * chunks_per_row) << 3, nthreads // chunks_per_row


@device_function
def split_by_columns(rows, cols, nthreads):
    """Whether every thread of a tile copy keeps one column of chunks (copy_split): the chunks a
    row divide the threads, and the row step the rows. Otherwise (head dims such as 96 or 192: 12
    or 24 chunks a row) the tile's chunks are dealt out in row-major order, `chunk_position`. The
    arguments are compile-time constants, so one of the two paths is compiled."""
    return nthreads % (cols >> 3) == 0 and rows % (nthreads // (cols >> 3)) == 0


@device_function
def chunk_position(c, cols):
    """(row, column) of the c-th 16-byte chunk of a row-major tile of `cols` 16-bit columns."""
    r = int32(c // (cols >> 3))
    return r, int32((c - r * (cols >> 3)) << 3)


@device_function
def load_tile_async(dst, src, row0, n_rows, col0, rows, cols, row_stride, swizzle, tid, nthreads,
                    address_once=True, valid_cols=0):
    """Start copying src[row0:row0+rows, col0:col0+cols] into tile `dst` with 16-byte cp.async
    copies spread over `nthreads` threads; rows at or past n_rows are zero-filled, and so are the
    tile's columns at or past valid_cols (a compile-time constant; 0: every column is src's: the
    zero columns of a head_dim that is not a multiple of 16, `tile_columns`). Each thread copies
    one 16-byte column chunk of every (nthreads / (cols/8))-th row (split_by_columns; else the
    chunks are dealt out in row-major order); when that
    row step is a multiple of 8 the swizzle repeats and the offsets fold into immediates.
    Commit and wait with ptx.cp_async_commit / cp_async_wait.

    address_once (a compile-time constant): the 64-bit global address is computed once, from src's
    runtime strides, and moved a row step at a time, instead of per 16-byte chunk (~30 integer
    instructions each). Rows past n_rows copy nothing and are given the first row's address,
    clamped to the last row, so that every address handed to cp.async lies inside src (a zero
    column, its row's first). The saved
    instructions cost live registers: a kernel already at 255 (the forward at d=128) spills in its
    loop with it, so it is a switch (compile report: loop_local)."""
    padded = 0 < valid_cols < cols
    if not split_by_columns(rows, cols, nthreads):   # chunks dealt out in row-major order
        for i in range((rows * (cols >> 3) + nthreads - 1) // nthreads):
            c = int32(tid + i * nthreads)
            if c < rows * (cols >> 3):
                r, col = chunk_position(c, cols)
                row = int32(row0 + r)
                real = True          # a column of src's (else one of the tile's zero columns)
                if padded:
                    real = col < valid_cols
                inside = row < n_rows and real
                ptx.cp_async_16(dst, smem_offset(r, col, row_stride, swizzle), src,
                                row if inside else 0, col0 + col if real else col0,
                                16 if inside else 0)
        return
    r, col, row_step = copy_split(tid, cols, nthreads)
    real = True                      # this thread's column is one of src's
    if padded:
        real = col < valid_cols
    if address_once:
        # Row arithmetic in 32 bits: Numba types int32 + int32 as int64, so every sum is cast
        # back, or each row test costs a 64-bit add and a two-instruction compare.
        first = int32(row0 + r)
        address = ptx.global_address(src, min(first, int32(n_rows - 1)),
                                     int32(col0 + col) if real else int32(col0))
        pitch = src.strides[0] * row_step
        for i in range(rows // row_step):
            inside = int32(first + i * row_step) < n_rows and real
            ptx.cp_async_16_from(dst, smem_offset(r + i * row_step, col, row_stride, swizzle),
                                 address + i * pitch if inside else address, 16 if inside else 0)
    else:
        for i in range(rows // row_step):
            row = row0 + r + i * row_step
            inside = row < n_rows and real
            ptx.cp_async_16(dst, smem_offset(r + i * row_step, col, row_stride, swizzle), src,
                            row if inside else 0, col0 + col if real else col0,
                            16 if inside else 0)


# --------------------------------------------------------------------------- shared -> fragments

@device_function
def a_fragment_base(row0, lane, row_stride, swizzle):
    """Offset of this lane's ldmatrix row address for the A operand of rows row0..row0+15
    (row0 % 8 == 0) at k-step 0. ldmatrix.x4 matrices: (rows 0-7, cols 0-7), (8-15, 0-7),
    (0-7, 8-15), (8-15, 8-15). Rows 16 further down are 16 * row_stride further on."""
    return smem_offset(row0 + (lane & 15), (lane >> 4) << 3, row_stride, swizzle)


@device_function
def load_a_step(a, m, slot, tile, base, kk, swizzle):
    """a[m, slot] <- the A operand at k-step kk (columns 16kk..16kk+15) from `base`
    (see a_fragment_base)."""
    x = ptx.ldmatrix_x4(tile, column_step(base, kk, swizzle))
    for j in range(4):
        a[m, slot, j] = x[j]


@device_function
def load_a_fragments(a, m, tile, row0, lane, row_stride, swizzle):
    """a[m, kk] <- the A operand for rows row0..row0+15, columns 16kk..16kk+15 of a row-major tile,
    for every k-step kk of `a`."""
    base = a_fragment_base(row0, lane, row_stride, swizzle)
    for kk in range(a.shape[1]):
        load_a_step(a, m, kk, tile, base, kk, swizzle)


@device_function
def load_a_fragments_transposed(a, m, tile, row0, lane, row_stride, swizzle):
    """a[m, kk] <- the A operand for rows row0..row0+15 of A = T^T, where T is a row-major [k][m]
    tile (dS read from a staged dS^T), for every k-step kk of `a`. ldmatrix.x4.trans reads the four
    8x8 matrices (A rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) from T's rows k and
    columns row0.. and hands each lane the transposed elements, i.e. exactly an A fragment."""
    base = smem_offset(((lane >> 4) << 3) + (lane & 7), row0 + (((lane >> 3) & 1) << 3),
                       row_stride, swizzle)
    for kk in range(a.shape[1]):
        x = ptx.ldmatrix_x4_trans(tile, base + kk * 16 * row_stride)
        for j in range(4):
            a[m, kk, j] = x[j]


@device_function
def mma(acc, m, n, a, kk, b0, b1, elem):
    """acc[m, n] += a[m, kk] @ (b0, b1): one mma.m16n8k16 with fp32 accumulation; elem (an
    elements code, compile-time) picks the opcode."""
    if elem == BF16:
        d = ptx.mma_bf16_16816(a[m, kk, 0], a[m, kk, 1], a[m, kk, 2], a[m, kk, 3], b0, b1,
                               acc[m, n, 0], acc[m, n, 1], acc[m, n, 2], acc[m, n, 3])
    else:
        d = ptx.mma_f16_16816(a[m, kk, 0], a[m, kk, 1], a[m, kk, 2], a[m, kk, 3], b0, b1,
                              acc[m, n, 0], acc[m, n, 1], acc[m, n, 2], acc[m, n, 3])
    for j in range(4):
        acc[m, n, j] = d[j]


@device_function
def abt_base(lane, row_stride, swizzle):
    """Offset of this lane's ldmatrix row address in an [n][k] tile (B of A B^T) at n = k = 0."""
    return smem_offset(((lane >> 4) << 3) + (lane & 7), ((lane >> 3) & 1) << 3, row_stride, swizzle)


@device_function
def abt_step(acc, a, slot, tile_b, k_base, row_stride, elem):
    """acc += a[:, slot] B_kk^T for one k-step, B_kk's ldmatrix addresses at k_base.
    One ldmatrix.x4 gives b0, b1 of n-tiles 2*n2 and 2*n2+1: matrices (n0, k0), (n0, k0+8),
    (n0+8, k0), (n0+8, k0+8); it is reused by all m-tiles of the warp."""
    for n2 in range(acc.shape[1] >> 1):
        b = ptx.ldmatrix_x4(tile_b, k_base + n2 * 16 * row_stride)
        for m in range(acc.shape[0]):
            mma(acc, m, 2 * n2, a, slot, b[0], b[1], elem)
            mma(acc, m, 2 * n2 + 1, a, slot, b[2], b[3], elem)


@device_function
def gemm_abt(acc, a, tile_b, lane, row_stride, swizzle, elem, b_row0=0):
    """acc += A B^T with A held in registers (every k-step in a[m, kk]) and B the rows b_row0..
    (a multiple of 8) of an [n][k] row-major tile (K in S = Q K^T)."""
    base = abt_base(lane, row_stride, swizzle) + b_row0 * row_stride
    for kk in range(a.shape[1]):
        abt_step(acc, a, kk, tile_b, column_step(base, kk, swizzle), row_stride, elem)


@device_function
def gemm_abt_streamed(acc, a, tile_a, a_row0, k_steps, tile_b, lane, row_stride, swizzle, elem,
                      b_row0=0):
    """acc += A B^T with A streamed from the row-major tile `tile_a` (rows a_row0.., m-tiles of 16)
    one k-step at a time into a[:, 0], instead of held whole in registers: k_steps more ldmatrix
    per m-tile and call, for a[M, 1, 4] instead of a[M, k_steps, 4] registers (FA2's Q reload).
    B: rows b_row0.. of tile_b, as in gemm_abt."""
    a_base = a_fragment_base(a_row0, lane, row_stride, swizzle)
    base = abt_base(lane, row_stride, swizzle) + b_row0 * row_stride
    for kk in range(k_steps):
        for m in range(a.shape[0]):
            load_a_step(a, m, 0, tile_a, a_base + m * 16 * row_stride, kk, swizzle)
        abt_step(acc, a, 0, tile_b, column_step(base, kk, swizzle), row_stride, elem)


@device_function
def gemm_abt_held_or_streamed(acc, a, held, tile_a, a_row0, k_steps, tile_b, lane, row_stride,
                              swizzle, elem, b_row0=0):
    """acc += A B^T, A either held whole in registers (`held`: a[M, k_steps, 4], filled before)
    or streamed one k-step at a time from rows a_row0.. of tile_a (a[M, 1, 4]); see gemm_abt and
    gemm_abt_streamed. `held` is a compile-time constant: one of the two is compiled in."""
    if held:
        gemm_abt(acc, a, tile_b, lane, row_stride, swizzle, elem, b_row0)
    else:
        gemm_abt_streamed(acc, a, tile_a, a_row0, k_steps, tile_b, lane, row_stride, swizzle,
                          elem, b_row0)


@device_function
def gemm_ab(acc, a, tile_b, lane, row_stride, swizzle, elem, b_col0=0):
    """acc += A B with A in registers and B the columns b_col0.. of a [k][n] row-major tile (V in
    O += P V); b_col0 a multiple of 8 * 2^k >= 8 * acc.shape[1] (so that the steps right of it are
    XORs: `column_step`). ldmatrix.x4.trans matrices: (k0, n0), (k0+8, n0), (k0, n0+8),
    (k0+8, n0+8). An odd number of n8 tiles (a warp's d/2 columns at d = 144: padded rows only)
    takes its last one from an ldmatrix.x4 whose upper two matrices repeat the lower two."""
    base = smem_offset((((lane >> 3) & 1) << 3) + (lane & 7), b_col0 + ((lane >> 4) << 3),
                       row_stride, swizzle)
    last = acc.shape[1] - 1
    tail = smem_offset((((lane >> 3) & 1) << 3) + (lane & 7), b_col0 + 8 * last, row_stride,
                       swizzle)
    for kk in range(a.shape[1]):
        for n2 in range(acc.shape[1] >> 1):
            b = ptx.ldmatrix_x4_trans(tile_b, column_step(base, n2, swizzle) + kk * 16 * row_stride)
            for m in range(acc.shape[0]):
                mma(acc, m, 2 * n2, a, kk, b[0], b[1], elem)
                mma(acc, m, 2 * n2 + 1, a, kk, b[2], b[3], elem)
        if acc.shape[1] & 1:
            b = ptx.ldmatrix_x4_trans(tile_b, tail + kk * 16 * row_stride)
            for m in range(acc.shape[0]):
                mma(acc, m, last, a, kk, b[0], b[1], elem)


@device_function
def pack_pair(lo, hi, elem):
    """Two fp32 values -> one register of two 16-bit values of type `elem` (lo in the low half)."""
    if elem == BF16:
        return ptx.pack_bf16x2(lo, hi)
    return ptx.pack_f16x2(lo, hi)


@device_function
def unpack_pair(word, elem):
    """One register of two 16-bit values of type `elem` -> two fp32 values (lo first)."""
    if elem == BF16:
        return ptx.unpack_bf16x2(word)
    return ptx.unpack_f16x2(word)


@device_function
def accumulator_to_a(a, acc, elem):
    """Re-pack an fp32 accumulator as the A operand (of type elem) of the next mma, in registers.
    16-bit: the C fragments of n-tiles 2j and 2j+1 hold exactly the elements of the A fragment of
    k-step j: a0 = (g, 2t) = c[2j][0:2], a1 = (g+8, 2t) = c[2j][2:4], a2 = c[2j+1][0:2],
    a3 = c[2j+1][2:4]. e4m3 (a k32 wgmma's A): accumulator_to_a_e4m3."""
    if elem == E4M3:
        accumulator_to_a_e4m3(a, acc)
        return
    for m in range(acc.shape[0]):
        for j in range(acc.shape[1] >> 1):
            a[m, j, 0] = pack_pair(acc[m, 2 * j, 0], acc[m, 2 * j, 1], elem)
            a[m, j, 1] = pack_pair(acc[m, 2 * j, 2], acc[m, 2 * j, 3], elem)
            a[m, j, 2] = pack_pair(acc[m, 2 * j + 1, 0], acc[m, 2 * j + 1, 1], elem)
            a[m, j, 3] = pack_pair(acc[m, 2 * j + 1, 2], acc[m, 2 * j + 1, 3], elem)


@device_function
def accumulator_to_a_e4m3(a, acc):
    """Re-pack an fp32 accumulator (one warp's rows of a 64 x n wgmma tile, acc (1, n/8, 4)) as the
    e4m3 A operand of k32 wgmmas (a (1, n/32, 4)), in registers, no byte crossing lanes.
    The k32 A fragment holds in register i of lane (g, t) columns 4t..4t+3 (+16 for i >= 2) of
    row g + 8 (i % 2); the accumulator holds columns 2t, 2t+1 of each 8-column n-tile. Register i
    of k-step kk packs  acc[4kk + 2(i//2)][2(i%2) : +2]  and  acc[4kk + 2(i//2) + 1][2(i%2) : +2],
    so A's column 4t + b (+16) holds P~'s column 8 (b // 2) + 2t + b % 2 (+16): a permutation of
    each 16 keys, which V's rows are stored in too (variants/fp8.py: KEY_ORDER), making P~ V exact."""
    for m in range(acc.shape[0]):
        for kk in range(acc.shape[1] >> 2):
            for i in range(4):
                n0 = 4 * kk + 2 * (i >> 1)
                h = 2 * (i & 1)
                a[m, kk, i] = ptx.pack_e4m3x4(acc[m, n0, h], acc[m, n0, h + 1],
                                              acc[m, n0 + 1, h], acc[m, n0 + 1, h + 1])


@device_function
def scale_all(acc, factor):
    """acc *= factor, every element."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            for j in range(acc.shape[2]):
                acc[m, n, j] *= factor


@device_function
def multiply(acc, factor):
    """acc *= factor, element by element (two arrays of one shape)."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            for j in range(acc.shape[2]):
                acc[m, n, j] *= factor[m, n, j]


@device_function
def fill(frag, value):
    """Set every element of a 3-D register array."""
    for i in range(frag.shape[0]):
        for j in range(frag.shape[1]):
            for k in range(frag.shape[2]):
                frag[i, j, k] = value


@device_function
def accumulator_position(m, n, j, lane):
    """(row, col), within the warp's rows and the tile's columns, of accumulator element acc[m, n, j]
    of `lane`: registers 0, 1 hold (g, 2t), (g, 2t+1) and registers 2, 3 hold (g+8, 2t), (g+8, 2t+1)
    of the m16n8 tile (m, n), with g = lane // 4, t = lane % 4."""
    return m * 16 + (lane >> 2) + (j >> 1) * 8, n * 8 + 2 * (lane & 3) + (j & 1)


@device_function
def mask_scores(s, row0, col0, n_cols, banded, lo, hi, lane, windowed=True):
    """Set s to -inf where column >= n_cols, or (banded) outside the band lo <= column - row <= hi
    (common/tile/masks.py: causal, sliding window; windowed=False: the band has no left edge, lo is
    not read, as for causal). row0: global row of the warp's first row; col0: global column of
    the tile's first column.

    Per held row, the masked columns are turned into bounds relative to the lane's column offset
    2t, so that every element's test compares one register with an immediate (its n-tile and pair
    position) and no per-element index stays live across the K/V loop."""
    t2 = 2 * (lane & 3)
    for m in range(s.shape[0]):
        for h in range(2):
            end = n_cols
            start = int32(-(1 << 30))
            if banded:
                row = row0 + m * 16 + (lane >> 2) + 8 * h
                end = min(end, int32(row + hi + 1))
                if windowed:
                    start = int32(row + lo - col0 - t2)
            bound = int32(end - col0 - t2)   # element (n, jj) is masked when 8n + jj >= bound ...
            for n in range(s.shape[1]):
                for jj in range(2):
                    c = int32(n * 8 + jj)      # 32-bit: one compare, not two
                    if c >= bound or c < start:   # ... or 8n + jj < start
                        s[m, n, 2 * h + jj] = NEG_INF


@device_function
def mask_scores_transposed(s, row0, n_rows, col0, n_cols, banded, lo, hi, lane, windowed=True):
    """mask_scores for S^T (rows are keys, columns queries, as in the backward pass): set s to -inf
    where row >= n_rows, column >= n_cols, or (banded) outside lo <= row - column <= hi. row0:
    global key of the warp's first row; col0: global query of the tile's first column."""
    t2 = 2 * (lane & 3)
    for m in range(s.shape[0]):
        for h in range(2):
            row = row0 + m * 16 + (lane >> 2) + 8 * h
            end = n_cols
            lo_c = int32(-(1 << 30))
            if banded:   # queries row - hi <= column <= row - lo see this key
                if windowed:
                    end = min(end, int32(row - lo + 1))
                lo_c = int32(row - hi - col0 - t2)
            hi_c = int32(end - col0 - t2)   # element (n, jj) is masked when 8n + jj >= hi_c ...
            if row >= n_rows:
                hi_c = int32(-(1 << 30))
            for n in range(s.shape[1]):
                for jj in range(2):
                    c = int32(n * 8 + jj)           # 32-bit compares, as in mask_scores
                    if c >= hi_c or c < lo_c:       # ... or 8n + jj < lo_c
                        s[m, n, 2 * h + jj] = NEG_INF


@device_function
def add_alibi(s, row0, col0, slope, lane):
    """ALiBi (flash_attn's alibi_slopes) on raw scores, in place: S[r, c] -= slope |r - c| for
    the lane's elements, row0 the warp's first row plus the diagonal's shift (so that r - c is
    the query's distance from its diagonal key), col0 the tile's first column, slope the head's
    slope over softmax_scale. Per held row the distance of its first element is one float; each
    score then takes one FADD and one FFMA (|x| is an operand modifier)."""
    t2 = 2 * (lane & 3)
    neg = -slope
    for m in range(s.shape[0]):
        for h in range(2):
            base = float32(int32(row0 + m * 16 + (lane >> 2) + 8 * h - col0 - t2))
            for n in range(s.shape[1]):
                for jj in range(2):
                    s[m, n, 2 * h + jj] += neg * abs(base - float32(n * 8 + jj))


@device_function
def add_alibi_transposed(s, row0, col0, slope, lane):
    """add_alibi for S^T (rows keys, columns queries, the backward's layout): S^T[r, c] -=
    slope |c - r|, row0 the warp's first key minus the diagonal's shift, col0 its first query."""
    t2 = 2 * (lane & 3)
    neg = -slope
    for m in range(s.shape[0]):
        for h in range(2):
            base = float32(int32(col0 + t2 - row0 - m * 16 - (lane >> 2) - 8 * h))
            for n in range(s.shape[1]):
                for jj in range(2):
                    s[m, n, 2 * h + jj] += neg * abs(base + float32(n * 8 + jj))


# --------------------------------------------------------------------------- fragments -> global

@device_function
def scale_rows(acc, row_scale):
    """acc <- diag(row_scale) acc for the rows a lane holds: row_scale[2m + h] scales row g + 8h
    of m-tile m."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            for j in range(4):
                acc[m, n, j] *= row_scale[2 * m + (j >> 1)]


@device_function
def scale_accumulator(acc, factor):
    """acc <- factor * acc."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            for j in range(4):
                acc[m, n, j] *= factor


@device_function
def stage_accumulator(tile32, acc, row0, lane, row_stride, swizzle, elem, col0=0):
    """Write acc (as 16-bit pairs) into a row-major tile seen as uint32 words; row0, col0: the
    warp's first row and column in the tile. col0 is a multiple of 8 * 2^k >= 8 * acc.shape[1]
    (so that moving n chunks right of it is an XOR: `chunk_step`). Readers in other lanes need a
    barrier (syncwarp, bar_sync or syncthreads) first."""
    g, t2 = lane >> 2, 2 * (lane & 3)
    for m in range(acc.shape[0]):
        for h in range(2):
            base = smem_offset(row0 + m * 16 + g + 8 * h, col0 + t2, row_stride, swizzle)
            for n in range(acc.shape[1]):
                w = pack_pair(acc[m, n, 2 * h], acc[m, n, 2 * h + 1], elem)
                ptx.st_shared_u32(tile32, chunk_step(base, n, swizzle) >> 1, w)


@device_function
def stage_accumulator_panels(tile32, acc, row0, lane, panel_rows, elem):
    """Write acc (as 16-bit pairs) into a tile laid out as wgmma reads its operands (common/hardware/sm90.py):
    panels of 64 columns, each panel_rows rows of 128 bytes with the 128-byte swizzle (chunk ^
    row % 8; the tile 1024-byte aligned), one after another; row0: the warp's first row. Readers
    need a barrier first, and wgmma (the async proxy) a fence.proxy.async before it."""
    g, t2 = lane >> 2, 2 * (lane & 3)
    for m in range(acc.shape[0]):
        for h in range(2):
            base = smem_offset(row0 + m * 16 + g + 8 * h, t2, 64, True)   # in the first panel
            for n in range(acc.shape[1]):
                w = pack_pair(acc[m, n, 2 * h], acc[m, n, 2 * h + 1], elem)
                ptx.st_shared_u32(tile32, (chunk_step(base, n & 7, True)
                                           + (n >> 3) * panel_rows * 64) >> 1, w)


@device_function
def stage_accumulator_f32(tile, acc, row0, lane, row_stride):
    """Write acc as fp32 into a row-major float32 shared tile (rows row0.., row_stride floats a
    row; a stride of 8 mod 32 keeps the float2 stores of the 8 row groups in distinct banks)."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            for j in range(4):
                r, c = accumulator_position(m, n, j, lane)
                tile[(row0 + r) * row_stride + c] = acc[m, n, j]


@device_function
def stage_accumulator_fragments_f32(tile, acc, lane):
    """Write the warp's acc as fp32 into its own shared region `tile` in fragment order: the
    registers acc[m, n, 0:4] of `lane` go to floats 4 * (32 k + lane) + (0..3), k = m *
    acc.shape[1] + n. Each 16-byte store of the warp covers 512 contiguous bytes (no bank
    conflicts), and the warp's region is one contiguous block that a bulk copy moves as is."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            k = m * acc.shape[1] + n
            ptx.st_shared_v4_f32(tile, int32(((k << 5) + lane) << 2), acc[m, n, 0], acc[m, n, 1],
                                 acc[m, n, 2], acc[m, n, 3])


@device_function
def store_tile(dst32, tile32, row0, n_rows, rows, cols, row_stride, swizzle, tid, nthreads,
               valid_cols=0):
    """dst32[row0:row0+rows, :cols/2] <- a staged tile of 16-bit values (both seen as uint32
    words), 16 bytes a thread per step, rows at or past n_rows skipped (split as load_tile_async),
    and columns at or past valid_cols (compile-time; 0: none; a padded head_dim's zero columns)."""
    padded = 0 < valid_cols < cols
    if not split_by_columns(rows, cols, nthreads):
        for i in range((rows * (cols >> 3) + nthreads - 1) // nthreads):
            c = int32(tid + i * nthreads)
            if c < rows * (cols >> 3):
                r, col = chunk_position(c, cols)
                if int32(row0 + r) < n_rows and (not padded or col < valid_cols):
                    x = ptx.ld_shared_v4_u32(tile32, smem_offset(r, col, row_stride, swizzle) >> 1)
                    ptx.st_global_v4_u32(dst32, row0 + r, col >> 1, x[0], x[1], x[2], x[3])
        return
    r, col, row_step = copy_split(tid, cols, nthreads)
    if padded and col >= valid_cols:
        return
    for i in range(rows // row_step):
        row = row0 + r + i * row_step
        if row < n_rows:
            x = ptx.ld_shared_v4_u32(tile32, smem_offset(r + i * row_step, col, row_stride, swizzle) >> 1)
            ptx.st_global_v4_u32(dst32, row, col >> 1, x[0], x[1], x[2], x[3])


@device_function
def store_accumulator_f32(dst, acc, row0, col0, n_rows, n_cols, scale, lane):
    """dst[row, col] <- scale * acc for the elements inside (n_rows, n_cols); fp32 output."""
    for m in range(acc.shape[0]):
        for n in range(acc.shape[1]):
            for j in range(4):
                r, c = accumulator_position(m, n, j, lane)
                row, col = row0 + r, col0 + c
                if row < n_rows and col < n_cols:
                    dst[row, col] = acc[m, n, j] * scale


@device_function
def atomic_add_accumulator_f32(dst, acc, row0, col0, n_rows, lane):
    """dst[row, col] += acc for the elements in rows < n_rows, by fp32 atomic adds (thread blocks
    adding into the same rows: FA2's dQ accumulation). A lane's registers (j, j+1) hold two
    neighbouring columns, so each pair is one red.global.add.v2.f32: half the reductions of one add
    an element, and the address is computed without the bounds and wrap-around arithmetic of
    `cuda.atomic.add` (which cost ~20 instructions an element; docs/performance/fa2_backward.md, "dQ: atomics or a separate kernel"). The lane's
    first address is computed once (global_address) and every other one is that plus whole row
    pitches and a constant column offset: indexing dst per row cost ~17 integer instructions a
    row (the 4-D accumulator's index rebuilt from its shape each time)."""
    r0, c0 = accumulator_position(0, 0, 0, lane)
    first = int32(row0 + r0)
    base = ptx.global_address(dst, first, int32(col0 + c0))   # arithmetic only: never read
    pitch = dst.strides[0]
    for m in range(acc.shape[0]):
        for j in range(0, 4, 2):            # the lane's row g (j = 0), then g + 8 (j = 2)
            dr = m * 16 + (j >> 1) * 8      # accumulator_position's row, less the lane's r0
            if int32(first + dr) < n_rows:  # one test a row
                at = base + dr * pitch
                for n in range(acc.shape[1]):
                    ptx.red_add_v2_f32_at(at, n * 8, acc[m, n, j], acc[m, n, j + 1])
