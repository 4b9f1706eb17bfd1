"""Split-K warp partitioning (FlashAttention-1's kernels): the warps of a thread block share the
query rows of a block and split its keys, so every row's softmax statistics and its P~ V are spread
over all warps and must be combined through shared memory. FA2 (Sec. 3.3) replaces this with split-Q;
these helpers exist so that the difference can be measured (variants/fa1.py).

Two layouts meet here:
- the mma layout: warp w holds S_w = Q_i K_w^T and O_w = P~_w V_w for all B_r rows (see common/tile/tiles.py),
  lane (g, t) rows g and g + 8 of every m16 tile, indexed r = 2m + h as in common/tile/softmax.py;
- the owner layout: after the exchange, thread `tid` owns row tid // (threads / B_r) of the block and
  a contiguous chunk of head_dim columns of it (`owner_of`), where the row's statistics and O live.
Per-row partials are exchanged in a float32 array red[warp * B_r + row]; partial outputs in a
float32 tile o_part[warp][row][col] of row stride D + 8, D = tiles.tile_columns(d) (see
tiles.stage_accumulator_f32).
"""
import math

from numba import float32

from common.hardware import ptx
from common.hardware.target import device_function
from common.tile import tiles


@device_function
def block_row(r, lane):
    """Row of the block held in slot r = 2m + h by `lane` (all warps hold all rows)."""
    return 16 * (r >> 1) + (lane >> 2) + 8 * (r & 1)


@device_function
def publish(red, r, value, warp, lane, block_rows):
    """red[warp, row] <- a quad-reduced per-row value (one lane of each quad writes)."""
    if lane & 3 == 0:
        red[warp * block_rows + block_row(r, lane)] = value


@device_function
def gather_max(red, row, warps, block_rows):
    """max over warps of red[w, row] (after a barrier)."""
    x = float32(-math.inf)
    for w in range(warps):
        x = max(x, red[w * block_rows + row])
    return x


@device_function
def gather_sum(red, row, warps, block_rows):
    """sum over warps of red[w, row] (after a barrier)."""
    x = float32(0)
    for w in range(warps):
        x += red[w * block_rows + row]
    return x


@device_function
def owner_of(tid, threads, block_rows, head_dim):
    """(row, first column) of the chunk of O that thread `tid` owns: threads / B_r threads a row,
    head_dim * B_r / threads contiguous columns each."""
    per_row = threads // block_rows
    row = tid // per_row
    return row, (tid - row * per_row) * (head_dim // per_row)


@device_function
def merge_partial_o(o, o_part, row, col0, alpha, beta, warps, block_rows, row_stride):
    """o[c] <- alpha * o[c] + beta * sum over warps of o_part[w][row][col0 + c] (after a barrier):
    the owner's chunk of O merged with the block's P~ V, summed over the warps' keys."""
    for c in range(o.shape[0]):
        x = float32(0)
        for w in range(warps):
            x += o_part[(w * block_rows + row) * row_stride + col0 + c]
        o[c] = alpha * o[c] + beta * x


@device_function
def store_row_chunk(o32, row, col0, values, elem, valid_cols=0):
    """o32[row, col0/2 ...] <- values (fp32) as 16-bit pairs: 16 bytes a store when the chunk is
    whole 8-column groups of real columns, else 4 bytes (a pair) a store, leaving out the columns
    at or past valid_cols (compile-time; 0: none; a padded head_dim's zero columns)."""
    if values.shape[0] % 8 == 0 and valid_cols == 0:
        for c in range(0, values.shape[0], 8):
            ptx.st_global_v4_u32(o32, row, (col0 + c) >> 1,
                                 tiles.pack_pair(values[c], values[c + 1], elem),
                                 tiles.pack_pair(values[c + 2], values[c + 3], elem),
                                 tiles.pack_pair(values[c + 4], values[c + 5], elem),
                                 tiles.pack_pair(values[c + 6], values[c + 7], elem))
        return
    for c in range(0, values.shape[0], 2):
        if valid_cols == 0 or col0 + c < valid_cols:
            o32[row, (col0 + c) >> 1] = tiles.pack_pair(values[c], values[c + 1], elem)
