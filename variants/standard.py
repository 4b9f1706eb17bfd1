"""Standard attention: S and P materialised in HBM (FA1 paper, Algorithm 0), the O(N^2) baseline.

    Alg.0 l.1  load Q, K by blocks from HBM, compute S = softmax_scale * Q K^T, write S to HBM
    Alg.0 l.2  read S from HBM, compute P = softmax(S), write P to HBM
    Alg.0 l.3  load P and V by blocks from HBM, compute O = P V, write O to HBM

Three kernels on the same tensor-core tile layer as the fused variants, so the comparison measures
the algorithm (HBM round trips of S and P), not a different code generator. S is kept in fp32 (an
exact softmax input); P in the input dtype, as the A operand of the P V product. Their rows are
padded to a multiple of 64 columns (zeros in P) so that the P V loop runs over whole tiles.
Extra memory: 6 bytes per score, B * H * N_q * ceil(N_k / 64) * 64 * 6 bytes.

The backward pass (FA1 paper, Algorithm 3) materialises the same way, with S recomputed (the forward
keeps nothing N x N once it returns):
    Alg.3 l.1  S = softmax_scale Q K^T (the scores kernel) and dP = dO V^T (the same kernel on dO, V)
    Alg.3 l.2-4  P = exp(S - L) and dS = P o (dP - D), D = rowsum(P o dP), one warp a row
    Alg.3 l.3  dV = P^T dO;  l.5  dQ = dS K, dK = dS^T Q (the output kernel, A or A^T)
Extra memory: 12 bytes per score (S and dP in fp32, P and dS in 16 bits).

Packed batches (`forward_varlen`, `backward_varlen`): the same kernels one sequence at a time, each
launch over that sequence's rows of the packed tensors (`AttentionProblem.sequences`), so S and P
are N_q x N_k of that sequence, carved from one allocation sized for the largest sequence that
each sequence reuses in turn; a launch a kernel and sequence, so the host's time grows with the
number of sequences.
"""
import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import ptx
from common.hardware.elements import BFLOAT16, FLOAT16, Element
from common.hardware.target import device_function, kernel
from common.host import arrays
from common.host.launching import launch
from common.host.problem import LSE_TYPE, MASK_TYPES, OUT_TYPE, QKV_TYPE, prepare, prepare_varlen
from common.host.replay import replayed
from common.tile import masks, softmax, tiles
from variants import backward_shared as bwd

HEAD_DIMS = tiles.HEAD_DIMS
TILE = 64          # rows and columns of every block tile
WARPS = 4          # each warp owns 16 rows of a tile
THREADS = 32 * WARPS
SWIZZLE = True     # the S, P, dS tiles (64 columns); those of q, k, v, o: `head_dim_tile`


def padded_keys(n_k):
    return (n_k + TILE - 1) // TILE * TILE


def workspace_bytes(batch, heads, n_q, n_k):
    """HBM this variant needs beyond inputs and outputs: S (fp32) and P (16-bit)."""
    return batch * heads * n_q * padded_keys(n_k) * (4 + 2)


@dataclass(frozen=True)
class Config:
    head_dim: int
    element: Element     # the 16-bit type of the inputs and the output (common/hardware/elements.py)


def head_dim_tile(head_dim):
    """(D, swizzle, row stride) of a tile of rows of q, k, v, dO or O: head_dim zero-padded to whole
    k16 steps (tiles.tile_columns), swizzled at 64, 128 and 256 columns, padded rows otherwise."""
    d = tiles.tile_columns(head_dim)
    swizzle = tiles.swizzle_fits(d)
    return d, swizzle, tiles.tile_row_stride(d, swizzle)


@lru_cache(maxsize=None)
def build_scores(cfg):
    """Alg.0 l.1: S = softmax_scale * Q K^T, one 64x64 tile of S per thread block."""
    DV, ELEM = cfg.head_dim, cfg.element.code
    D, SWIZZLE_D, STRIDE = head_dim_tile(DV)
    A_FRAG, ACC = (1, D // 16, 4), (1, TILE // 8, 4)

    @kernel
    def scores(q, k, s, n_q, n_k, kv_group, softmax_scale):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        row0, col0 = cuda.blockIdx.x * TILE, cuda.blockIdx.y * TILE
        b, h = cuda.blockIdx.z // q.shape[1], cuda.blockIdx.z % q.shape[1]
        smem = cuda.shared.array(0, uint16)
        q_s = smem[0:TILE * STRIDE]
        k_s = smem[TILE * STRIDE:2 * TILE * STRIDE]
        tiles.load_tile_async(q_s, q[b, h], row0, n_q, 0, TILE, D, STRIDE, SWIZZLE_D, tid, THREADS,
                              True, DV)
        tiles.load_tile_async(k_s, k[b, h // kv_group], col0, n_k, 0, TILE, D, STRIDE, SWIZZLE_D,
                              tid, THREADS, True, DV)
        ptx.cp_async_commit()
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        a = cuda.local.array(A_FRAG, uint32)
        tiles.load_a_fragments(a, 0, q_s, 16 * warp, lane, STRIDE, SWIZZLE_D)
        acc = cuda.local.array(ACC, float32)
        tiles.fill(acc, float32(0))
        tiles.gemm_abt(acc, a, k_s, lane, STRIDE, SWIZZLE_D, ELEM)
        tiles.store_accumulator_f32(s[b, h], acc, row0 + 16 * warp, col0, n_q, s.shape[3],
                                    softmax_scale, lane)

    return scores, 2 * TILE * STRIDE * 2


@device_function
def visible_columns(row, n_k, banded, lo, hi):
    """[start, end): the keys row `row` sees (common/tile/masks.py)."""
    if banded:
        return max(int32(row + lo), int32(0)), min(int32(row + hi + 1), n_k)
    return int32(0), n_k


@device_function
def capped(x, cap, softcap):
    """A score after soft-capping (when the compile-time `softcap` is on): cap * tanh(x / cap)."""
    return cap * softmax.tanh(x / cap) if softcap else x


@lru_cache(maxsize=None)
def build_softmax(banded, softcap, element):
    """Alg.0 l.2: P = softmax(S) row by row (one warp a row), and LSE = log rowsum exp(S); S masked
    outside the band (banded) and soft-capped (softcap), as common/tile/masks.py says."""
    BANDED, SOFTCAP, ELEM = banded, softcap, element.code

    @kernel
    def row_softmax(s, p32, lse, n_q, n_k, lo, hi, cap):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        row = cuda.blockIdx.x * WARPS + warp
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        inside = row < n_q
        start, end = visible_columns(row, n_k, BANDED, lo, hi)
        if not inside:
            end = start   # still takes part in the warp shuffles below
        s_row = s[b, h, row if inside else 0]
        # Each lane: running max and sum of exp over its columns (an online softmax).
        m = float32(-math.inf)
        l = float32(0)
        for c in range(start + lane, end, 32):
            x = capped(s_row[c], cap, SOFTCAP)
            if x > m:
                l = l * ptx.ex2_approx((m - x) * float32(softmax.LOG2E))
                m = x
            l += ptx.ex2_approx((x - m) * float32(softmax.LOG2E))
        # Merge the 32 lanes' (m, l) pairs.
        for offset in (16, 8, 4, 2, 1):
            m_other = ptx.shfl_xor_f32(m, offset)
            l_other = ptx.shfl_xor_f32(l, offset)
            m_new = max(m, m_other)
            base = float32(0) if m_new == float32(-math.inf) else m_new
            l = (l * ptx.ex2_approx((m - base) * float32(softmax.LOG2E))
                 + l_other * ptx.ex2_approx((m_other - base) * float32(softmax.LOG2E)))
            m = m_new
        if inside:
            inv_l = float32(1) / l if l > float32(0) else float32(0)
            for c2 in range(lane, p32.shape[3], 32):
                c = 2 * c2
                x0 = float32(0)
                x1 = float32(0)
                if start <= c < end:
                    x0 = ptx.ex2_approx((capped(s_row[c], cap, SOFTCAP) - m) *
                                        float32(softmax.LOG2E)) * inv_l
                if start <= c + 1 < end:
                    x1 = ptx.ex2_approx((capped(s_row[c + 1], cap, SOFTCAP) - m) *
                                        float32(softmax.LOG2E)) * inv_l
                p32[b, h, row, c2] = tiles.pack_pair(x0, x1, ELEM)
            if lane == 0:   # a row that sees no key: L = -inf
                lse[b, h, row] = m + math.log(l) if l > float32(0) else float32(-math.inf)

    return row_softmax


@lru_cache(maxsize=None)
def build_output(cfg):
    """Alg.0 l.3: O = P V, one 64-row block of O per thread block, looping over 64-key tiles."""
    DV, ELEM = cfg.head_dim, cfg.element.code
    P_STRIDE = tiles.tile_row_stride(TILE, SWIZZLE)
    D, SWIZZLE_D, V_STRIDE = head_dim_tile(DV)
    P_TILE, V_TILE = TILE * P_STRIDE, TILE * V_STRIDE
    ACC, P_FRAG = (1, D // 8, 4), (1, TILE // 16, 4)

    @kernel
    def output(p, v, o32, n_q, n_k, kv_group):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        row0 = cuda.blockIdx.x * TILE
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        smem = cuda.shared.array(0, uint16)
        p_s = smem[0:P_TILE]
        v_s = smem[P_TILE:P_TILE + V_TILE]
        p_bh, v_bh = p[b, h], v[b, h // kv_group]
        acc = cuda.local.array(ACC, float32)
        tiles.fill(acc, float32(0))
        a = cuda.local.array(P_FRAG, uint32)
        for k0 in range(0, p.shape[3], TILE):
            tiles.load_tile_async(p_s, p_bh, row0, n_q, k0, TILE, TILE, P_STRIDE, SWIZZLE, tid, THREADS)
            tiles.load_tile_async(v_s, v_bh, k0, n_k, 0, TILE, D, V_STRIDE, SWIZZLE_D, tid, THREADS,
                                  True, DV)
            ptx.cp_async_commit()
            ptx.cp_async_wait(0)
            cuda.syncthreads()
            tiles.load_a_fragments(a, 0, p_s, 16 * warp, lane, P_STRIDE, SWIZZLE)
            tiles.gemm_ab(acc, a, v_s, lane, V_STRIDE, SWIZZLE_D, ELEM)
            cuda.syncthreads()
        o_s32 = cuda.shared.array(0, uint32)[0:TILE * V_STRIDE // 2]
        tiles.stage_accumulator(o_s32, acc, 16 * warp, lane, V_STRIDE, SWIZZLE_D, ELEM)
        cuda.syncthreads()
        tiles.store_tile(o32[b, h], o_s32, row0, n_q, TILE, D, V_STRIDE, SWIZZLE_D, tid, THREADS,
                         DV)

    return output, 2 * (P_TILE + V_TILE)


@lru_cache(maxsize=None)
def build_softmax_backward(banded, softcap, element):
    """Alg.3 l.2-4: P = exp(S - L), D = rowsum(P o dP), dS = softmax_scale * P o (dP - D), one
    warp a row; P and dS written in the 16-bit dtype (zeros in masked and padded columns). With
    softcap, S is capped first and dS multiplied by the cap's derivative 1 - tanh^2."""
    BANDED, SOFTCAP, ELEM = banded, softcap, element.code

    @kernel
    def softmax_backward(s, dp, lse, p32, ds32, n_q, n_k, lo, hi, cap, softmax_scale):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        row = cuda.blockIdx.x * WARPS + warp
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        inside = row < n_q
        r = row if inside else 0
        start, end = visible_columns(r, n_k, BANDED, lo, hi)
        lse2 = softmax.lse_log2(lse[b, h, r])
        s_row, dp_row = s[b, h, r], dp[b, h, r]
        d_sum = float32(0)
        for c in range(start + lane, end, 32):
            x = capped(s_row[c], cap, SOFTCAP)
            d_sum += ptx.ex2_approx(x * float32(softmax.LOG2E) - lse2) * dp_row[c]
        for offset in (16, 8, 4, 2, 1):
            d_sum += ptx.shfl_xor_f32(d_sum, offset)
        if inside:
            for c2 in range(lane, p32.shape[3], 32):
                p_pair = cuda.local.array(2, float32)
                ds_pair = cuda.local.array(2, float32)
                for e in range(2):
                    c = 2 * c2 + e
                    p_pair[e] = float32(0)
                    ds_pair[e] = float32(0)
                    if start <= c < end:
                        x = capped(s_row[c], cap, SOFTCAP)
                        p_pair[e] = ptx.ex2_approx(x * float32(softmax.LOG2E) - lse2)
                        ds_pair[e] = p_pair[e] * (dp_row[c] - d_sum) * softmax_scale
                        if SOFTCAP:   # through the cap: d(cap tanh(s / cap))/ds = 1 - tanh^2
                            t = x / cap
                            ds_pair[e] *= float32(1) - t * t
                p32[b, h, row, c2] = tiles.pack_pair(p_pair[0], p_pair[1], ELEM)
                ds32[b, h, row, c2] = tiles.pack_pair(ds_pair[0], ds_pair[1], ELEM)

    return softmax_backward


@lru_cache(maxsize=None)
def build_transposed_output(cfg):
    """Alg.3 l.3 and l.5: dV = P^T dO and dK = dS^T Q, one 64-key block of the output per thread
    block, looping over the K/V head's query heads and their 64-query tiles; the A operand (P^T or
    dS^T) is read transposed from row-major P or dS tiles (ldmatrix.trans)."""
    DV, ELEM = cfg.head_dim, cfg.element.code
    X_STRIDE = tiles.tile_row_stride(TILE, SWIZZLE)
    D, SWIZZLE_D, Y_STRIDE = head_dim_tile(DV)
    X_TILE, Y_TILE = TILE * X_STRIDE, TILE * Y_STRIDE
    ACC, A_FRAG = (1, D // 8, 4), (1, TILE // 16, 4)

    @kernel
    def transposed_output(x, y, out32, n_q, n_k, kv_group):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        key0 = cuda.blockIdx.x * TILE
        b, h_kv = cuda.blockIdx.y, cuda.blockIdx.z
        smem = cuda.shared.array(0, uint16)
        x_s = smem[0:X_TILE]
        y_s = smem[X_TILE:X_TILE + Y_TILE]
        acc = cuda.local.array(ACC, float32)
        tiles.fill(acc, float32(0))
        a = cuda.local.array(A_FRAG, uint32)
        for h in range(h_kv * kv_group, (h_kv + 1) * kv_group):
            for q0 in range(0, n_q, TILE):
                tiles.load_tile_async(x_s, x[b, h], q0, n_q, key0, TILE, TILE, X_STRIDE, SWIZZLE,
                                      tid, THREADS)
                tiles.load_tile_async(y_s, y[b, h], q0, n_q, 0, TILE, D, Y_STRIDE, SWIZZLE_D, tid,
                                      THREADS, True, DV)
                ptx.cp_async_commit()
                ptx.cp_async_wait(0)
                cuda.syncthreads()
                tiles.load_a_fragments_transposed(a, 0, x_s, 16 * warp, lane, X_STRIDE, SWIZZLE)
                tiles.gemm_ab(acc, a, y_s, lane, Y_STRIDE, SWIZZLE_D, ELEM)
                cuda.syncthreads()
        o_s32 = cuda.shared.array(0, uint32)[0:TILE * Y_STRIDE // 2]
        tiles.stage_accumulator(o_s32, acc, 16 * warp, lane, Y_STRIDE, SWIZZLE_D, ELEM)
        cuda.syncthreads()
        tiles.store_tile(out32[b, h_kv], o_s32, key0, n_k, TILE, D, Y_STRIDE, SWIZZLE_D, tid,
                         THREADS, DV)

    return transposed_output, 2 * (X_TILE + Y_TILE)


def backward_workspace_bytes(batch, heads, n_q, n_k):
    """HBM the backward needs beyond inputs and outputs: S and dP (fp32), P and dS (16-bit)."""
    return batch * heads * n_q * padded_keys(n_k) * (4 + 4 + 2 + 2)


@replayed(6)
def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
             softcap=0.0, align=masks.BOTTOM_RIGHT, grads=None):
    """Standard attention backward (every N x N matrix in HBM); arguments as fa2.backward."""
    g = bwd.prepare_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                             grads=grads, head_dims=HEAD_DIMS, variant="standard",
                             window_size=window_size, softcap=softcap, align=align)
    return _backward(g)


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    align=masks.BOTTOM_RIGHT, grads=None):
    """The backward of forward_varlen, one sequence at a time as the forward; arguments as
    variants.fa2_backward.backward_varlen. The rows of a sequence with no key (dQ) or no query
    (dK, dV) are zero."""
    g = bwd.prepare_backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
                                    grads=grads, head_dims=HEAD_DIMS, variant="standard",
                                    window_size=window_size, softcap=softcap, align=align)
    scratch = _scratch_for_sequences(g.prob, _BACKWARD_WORK)
    for first_q, n_q, first_k, n_k, sub in g.prob.sequences():
        if sub is not None:
            _backward(dataclasses.replace(
                g, prob=sub, do=arrays.row_range(g.do, first_q, first_q + n_q),
                do32=arrays.row_range(g.do32, first_q, first_q + n_q),
                dq32=arrays.row_range(g.dq32, first_q, first_q + n_q),
                dk32=arrays.row_range(g.dk32, first_k, first_k + n_k),
                dv32=arrays.row_range(g.dv32, first_k, first_k + n_k)), scratch)
        elif n_q:      # no key: dQ = 0
            _fill(g.prob, arrays.row_range(g.dq32, first_q, first_q + n_q), np.int32(0))
        elif n_k:      # no query: dK = dV = 0
            for grad in (g.dk32, g.dv32):
                _fill(g.prob, arrays.row_range(grad, first_k, first_k + n_k), np.int32(0))
    return g.result()


def _backward(g, scratch=None):
    """Algorithm 3's kernels for the checked problem `g` (variants.backward_shared.prepare_backward); the
    work arrays in `scratch` when given (_scratch_for_sequences)."""
    prob = g.prob
    b, h, n_q, n_k = prob.batch, prob.heads, prob.n_q, prob.n_k
    if b * h > 65535:
        raise ValueError(f"standard needs batch * heads <= 65535, got {b * h}")
    kern = kernels_for(prob)
    n_pad = padded_keys(n_k)
    s_view, dp_view, p16, ds16 = _work_arrays(prob, scratch, _BACKWARD_WORK, b, h, n_q, n_k)
    row_tiles = (n_q + TILE - 1) // TILE
    sizes = (np.int32(n_q), np.int32(n_k), np.int32(prob.kv_group))

    scores_grid = (row_tiles, n_pad // TILE, b * h)
    launch(kern.scores, scores_grid, THREADS, kern.scores_smem, prob.stream,            # l.1
           prob.q, prob.k, s_view, *sizes, np.float32(prob.softmax_scale))
    launch(kern.scores, scores_grid, THREADS, kern.scores_smem, prob.stream,
           g.do, prob.v, dp_view, *sizes, np.float32(1))
    launch(kern.softmax_backward, ((n_q + WARPS - 1) // WARPS, b, h), THREADS, 0, prob.stream,
           s_view, dp_view, prob.lse,
           arrays.as_elements(p16, np.uint32, 2), arrays.as_elements(ds16, np.uint32, 2),  # l.2-4
           *sizes[:2], *mask_args(prob), np.float32(prob.softmax_scale))
    launch(kern.output, (row_tiles, b, h), THREADS, kern.output_smem, prob.stream, ds16, prob.k,
           g.dq32, *sizes)
    key_tiles = (n_k + TILE - 1) // TILE
    launch(kern.transposed, (key_tiles, b, prob.heads_kv), THREADS, kern.transposed_smem,  # l.3
           prob.stream, p16, g.do, g.dv32, *sizes)
    launch(kern.transposed, (key_tiles, b, prob.heads_kv), THREADS, kern.transposed_smem,  # l.5
           prob.stream, ds16, prob.q, g.dk32, *sizes)
    return g.result()


def mask_args(prob):
    """The softmax kernels' lo, hi, and the cap on S (which holds softmax_scale * QK^T)."""
    return np.int32(prob.band.lo), np.int32(prob.band.hi), np.float32(prob.band.softcap)


@replayed(3)
def forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            align=masks.BOTTOM_RIGHT, out=None):
    """Standard attention forward; same arguments and results as variants.fa2.forward."""
    prob = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out,
                   head_dims=HEAD_DIMS, variant="standard", window_size=window_size,
                   softcap=softcap, align=align)
    return _forward(prob)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   align=masks.BOTTOM_RIGHT, out=None):
    """Standard attention over a packed batch of sequences; arguments and results as
    variants.fa2.forward_varlen. The baseline runs its three kernels one sequence at a time, each
    over that sequence's rows of the packed tensors, with its own S and P (N_q x N_k of that
    sequence, no padding to the longest, in one allocation that the sequences reuse in turn):
    three launches a sequence, so a batch of many short sequences costs the host more than its
    kernels. A sequence with no key gets O = 0 and
    LSE = -inf."""
    prob = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal=causal, softmax_scale=softmax_scale, out=out,
                          head_dims=HEAD_DIMS, variant="standard", window_size=window_size,
                          softcap=softcap, align=align)
    scratch = _scratch_for_sequences(prob, _FORWARD_WORK)
    for first_q, n_q, _, _, sub in prob.sequences():
        if sub is not None:
            _forward(sub, scratch)
        elif n_q:   # no key
            _fill(prob, arrays.row_range(prob.o32, first_q, first_q + n_q), np.int32(0))
            _fill(prob, arrays.row_range(prob.lse, first_q, first_q + n_q, unit_axis=True),
                  np.float32(-math.inf))
    return prob.result()


@lru_cache(maxsize=None)
def build_fill():
    """fill(x, value): every element of a (1, H, n, w) view <- value (the rows of a packed batch
    that no kernel writes: a sequence with no key or no query)."""

    @kernel
    def fill(x, value):
        h = cuda.blockIdx.y
        step = cuda.gridDim.x * cuda.blockDim.x
        for r in range(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x, x.shape[2], step):
            for c in range(x.shape[3]):
                x[0, h, r, c] = value

    return fill


def _fill(prob, view, value):
    """fill(view, value) on the problem's stream; value np.int32 (stored as the view's uint32
    words: `launch` passes int32 and float32 scalars) or np.float32."""
    launch(build_fill(), ((view.shape[2] + THREADS - 1) // THREADS, view.shape[1]), THREADS, 0,
           prob.stream, view, value)


_FORWARD_WORK = (np.float32, np.uint16)                           # S, P
_BACKWARD_WORK = (np.float32, np.float32, np.uint16, np.uint16)   # S, dP, P, dS


def _work_specs(work, b, h, n_q, n_k):
    """(shape, element) of each N_q x N_k matrix the kernels write (rows padded to whole tiles)."""
    return tuple(((b, h, n_q, padded_keys(n_k)), element) for element in work)


def _work_arrays(prob, scratch, work, b, h, n_q, n_k):
    """The views of the N x N work arrays: in `scratch` (a packed batch's one allocation, big
    enough for its largest sequence) or in a new allocation."""
    specs = _work_specs(work, b, h, n_q, n_k)
    return arrays.views_over(scratch, specs) if scratch is not None else prob.scratch_views(*specs)


def _scratch_for_sequences(prob, work):
    """One allocation for a packed batch's work arrays, sized for its largest sequence (by the
    lengths read back, not max_seqlen: a loose bound, or the longest N_q and the longest N_k from
    two sequences, would ask for more), that every sequence's launches reuse in turn (one
    allocator call a call, not one a sequence)."""
    sq, sk = prob.varlen.starts_q, prob.varlen.starts_k
    size = max(arrays.views_bytes(_work_specs(work, 1, prob.heads, sq[b + 1] - sq[b],
                                              sk[b + 1] - sk[b])) for b in range(prob.batch))
    return arrays.empty(prob.library, (size,), "uint8", like=prob.like)


class Kernels(NamedTuple):
    """A problem kind's kernels (each tiled one with its shared-memory bytes)."""
    scores: object
    scores_smem: int
    softmax: object
    softmax_backward: object
    output: object
    output_smem: int
    transposed: object
    transposed_smem: int


_KERNELS = {}   # (head_dim, element, banded, softcapped) -> Kernels


def kernels_for(prob):
    """The kernels of the problem's head dim, element type and mask kind, looked up once per
    kind: a call hashes one tuple, not a Config and each builder's arguments (the builders make
    kernel objects; each compiles at its first launch)."""
    key = (prob.head_dim, prob.element, prob.banded, prob.softcapped)
    hit = _KERNELS.get(key)
    if hit is None:
        cfg = Config(prob.head_dim, prob.element)
        hit = _KERNELS[key] = Kernels(
            *build_scores(cfg), build_softmax(prob.banded, prob.softcapped, prob.element),
            build_softmax_backward(prob.banded, prob.softcapped, prob.element),
            *build_output(cfg), *build_transposed_output(cfg))
    return hit


def _forward(prob, scratch=None):
    """Algorithm 0's three kernels for the checked problem `prob` (common.host.problem.prepare); the
    work arrays in `scratch` when given (_scratch_for_sequences)."""
    b, h, n_q, n_k = prob.batch, prob.heads, prob.n_q, prob.n_k
    if b * h > 65535:
        raise ValueError(f"standard needs batch * heads <= 65535, got {b * h}")
    kern = kernels_for(prob)
    n_pad = padded_keys(n_k)
    s_view, p16 = _work_arrays(prob, scratch, _FORWARD_WORK, b, h, n_q, n_k)   # S fp32, P 16-bit
    row_tiles = (n_q + TILE - 1) // TILE
    sizes = np.int32(n_q), np.int32(n_k)

    launch(kern.scores, (row_tiles, n_pad // TILE, b * h), THREADS, kern.scores_smem, prob.stream,
           prob.q, prob.k, s_view, *sizes, np.int32(prob.kv_group),
           np.float32(prob.softmax_scale))
    launch(kern.softmax, ((n_q + WARPS - 1) // WARPS, b, h), THREADS, 0, prob.stream, s_view,
           arrays.as_elements(p16, np.uint32, 2), prob.lse, *sizes, *mask_args(prob))
    launch(kern.output, (row_tiles, b, h), THREADS, kern.output_smem, prob.stream,
           p16, prob.v, prob.o32, *sizes, np.int32(prob.kv_group))
    return prob.result()


# The head dims the compile report covers (the others change tile widths, not the code's shape)
REPORTED_HEAD_DIMS = (64, 128)


def compile_targets():
    """(name, kernel, argument types, mma count in its PTX) of every kernel `forward` launches."""
    i32, f32 = types.int32, types.float32
    s_type = types.Array(types.float32, 4, "C")
    for head_dim in REPORTED_HEAD_DIMS:
        for element in (BFLOAT16, FLOAT16):
            tag = f"d={head_dim} {element.tag}"
            cfg = Config(head_dim, element)
            yield f"standard scores {tag}", build_scores(cfg)[0], \
                (QKV_TYPE, QKV_TYPE, s_type, i32, i32, i32, f32), head_dim // 16 * TILE // 8
            yield f"standard output {tag}", build_output(cfg)[0], \
                (types.Array(types.uint16, 4, "C"), QKV_TYPE, OUT_TYPE, i32, i32, i32), \
                TILE // 16 * head_dim // 8
    for causal in (False, True):
        for element in (BFLOAT16, FLOAT16):
            yield f"standard softmax causal={causal} {element.tag}", \
                build_softmax(causal, False, element), \
                (s_type, types.Array(types.uint32, 4, "C"), LSE_TYPE, i32, i32) + MASK_TYPES, 0
    # The backward's own kernels (it reuses scores and output), bf16.
    u32 = types.Array(types.uint32, 4, "C")
    for causal in (False, True):
        yield f"standard softmax_backward causal={causal} bf16", \
            build_softmax_backward(causal, False, BFLOAT16), \
            (s_type, s_type, LSE_TYPE, u32, u32, i32, i32) + MASK_TYPES + (f32,), 0
    for head_dim in REPORTED_HEAD_DIMS:
        yield f"standard transposed_output d={head_dim} bf16", \
            build_transposed_output(Config(head_dim, BFLOAT16))[0], \
            (types.Array(types.uint16, 4, "C"), QKV_TYPE, OUT_TYPE, i32, i32, i32), \
            TILE // 16 * head_dim // 8
