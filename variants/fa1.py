"""FlashAttention-1 forward (Dao et al. 2022, Algorithm 1) on the tile layer of `common/`, with
switches that turn it, one FA2 change at a time, into FA2's algorithm (the FA1 -> FA2 ladder:
conf/experiment/ladder.yaml, docs/performance/ladder.md).

    l.1   B_c = ceil(M / 4d), B_r = min(B_c, d)                     (DEFAULTS: the sizes used, and why)
    l.2   O = 0, l = 0, m = -inf in HBM
    l.5   for 1 <= j <= T_c:
    l.6     load K_j, V_j from HBM to SRAM
    l.7     for 1 <= i <= T_r:
    l.8       load Q_i, O_i, l_i, m_i from HBM to SRAM
    l.9       S_ij = Q_i K_j^T
    l.10      m~_ij = rowmax(S_ij), P~_ij = exp(S_ij - m~_ij), l~_ij = rowsum(P~_ij)
    l.11      m_new = max(m_i, m~_ij), l_new = e^(m_i - m_new) l_i + e^(m~_ij - m_new) l~_ij
    l.12      O_i <- diag(l_new)^-1 (diag(l_i) e^(m_i - m_new) O_i + e^(m~_ij - m_new) P~_ij V_j) to HBM
    l.13      l_i <- l_new, m_i <- m_new to HBM

On the hardware, as in FA1's CUDA kernels: one thread block per (batch, head); K_j and V_j stay in
shared memory while the Q_i stream past them (Q_{i+1}'s copy overlaps step i); the warps split the
keys of K_j (split-K), so each row's max, sum and P~ V are combined through shared memory
(common/tile/splitk.py); O_i (fp32), l_i and m_i make a round trip through HBM on every inner step.

The switches, each a rung of the ladder in the order of the FA2 paper:
  outer_loop="q"         FA2 Sec. 3.2: the loops swapped; query blocks are the grid (a thread block
                         per (i, batch, head)) and O_i, l_i, m_i stay on chip across the K/V loop,
                         whose next K and V copies overlap the current step
  deferred_rescale=True  FA2 Sec. 3.1: O_i stays un-normalised until the end (one division), and
                         only L = m + log l is written, not m and l
  (split-Q warps are fa2 itself; causal block skipping is fa2's `causal_skip`)
  causal_skip=True       visit only blocks on or below the diagonal here too
  q_splits=n             n thread blocks per (batch, head) along the queries, each running Alg. 1
                         over its share of query blocks; 0: enough to fill the GPU (FA1's released
                         kernels' `num_splits`, which the FA2 paper's FA1 numbers had)

Packed batches (`forward_varlen`, as FA1's own `flash_attn_unpadded_func`): the grid's batch index
is a sequence of the packed tensors, whose rows and keys the block reads from cu_seqlens; O, l, m
make their round trips through HBM in the packed rows. The backward is Algorithm 4's schedule of
fa2's kernel, as for fixed lengths (`backward_varlen`).
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import target
from common.hardware.elements import BFLOAT16, FLOAT16, Element
from common.hardware.target import MAX_SHARED_BYTES, device_function, kernel
from common.host import arrays, configs
from common.host.launching import launch
from common.host.problem import (
    LSE_TYPE,
    MASK_TYPES,
    OUT_TYPE,
    QKV_TYPE,
    SEQS_TYPE,
    prepare,
    prepare_varlen,
)
from common.host.replay import replayed
from common.tile import masks, pipeline, softmax, splitk, tiles
from common.tile.smem import SharedLayout
from variants import backward_shared as bwd

HEAD_DIMS = tiles.HEAD_DIMS
RESIDENT = 2    # fa1 thread blocks an SM holds at the defaults (~107 KB of shared memory, 255 registers)


@dataclass(frozen=True)
class Config:
    """Compile-time shape of the kernel. block_m = B_r, block_n = B_c of the paper."""
    head_dim: int
    element: Element             # the 16-bit type of the inputs and the output (common/hardware/elements.py)
    causal: bool                 # a band mask (causal and/or sliding window, common/tile/masks.py)
    window: bool = False         # the band has a left edge (sliding window): its test compiled in
    softcap: bool = False        # scores soft-capped (Gemma 2)
    block_m: int = 16            # B_r: query rows a step (DEFAULTS)
    block_n: int = 128           # B_c: keys a block, split over the warps
    warps: int = 4               # split-K: warp w takes keys [w, w+1) * B_c / warps of K_j
    outer_loop: str = "kv"       # "kv": Algorithm 1; "q": FA2's loop order and grid
    deferred_rescale: bool = False   # FA2: O normalised once at the end, only L saved
    causal_skip: bool = False    # visit only K/V blocks inside the band (on or below the diagonal)
    q_splits: int = 1            # thread blocks per (batch, head) along the queries (outer_loop="kv";
                                 # 0: enough for every SM to hold RESIDENT of them)
    varlen: bool = False         # a packed batch of sequences (forward_varlen): bounds per block
    bottom_right: bool = True    # varlen: the band's diagonal at each sequence's bottom-right

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def m_tiles(self):           # every warp holds all B_r rows
        return self.block_m // 16

    @property
    def keys_per_warp(self):
        return self.block_n // self.warps

    @property
    def q_buffers(self):         # Q_{i+1} is prefetched into a second tile in the inner loop
        return 2 if self.outer_loop == "kv" else 1

    @property
    def tile_dim(self):          # columns of the Q, K, V tiles and of O's owners: head_dim
        return tiles.tile_columns(self.head_dim)   # zero-padded to whole k16 steps

    @property
    def partial_o_stride(self):  # floats a row of a warp's partial P~ V tile: 8 mod 32, so the 8
        return self.tile_dim + 8  # row groups of an accumulator store land in distinct banks

    @configs.once_per_config
    def smem_layout(self):
        """K_j | V_j | Q tile(s) (16-bit, swizzled) | split-K's exchange area (fp32): each warp's
        partial P~ V, row maxima and row sums."""
        stride = tiles.tile_row_stride(self.tile_dim, tiles.swizzle_fits(self.tile_dim))
        rows = self.warps * self.block_m
        return SharedLayout(("k", self.block_n * stride, 2), ("v", self.block_n * stride, 2),
                            ("q", self.q_buffers * self.block_m * stride, 2),
                            ("o_part", rows * self.partial_o_stride, 4), ("red_max", rows, 4),
                            ("red_sum", rows, 4))

    def smem_bytes(self):
        return self.smem_layout().bytes

    def validate(self):
        tiles.check_head_dim(self.head_dim, "fa1")
        if self.outer_loop not in ("kv", "q"):
            raise ValueError(f"outer_loop must be 'kv' (Algorithm 1) or 'q' (FA2's order), got "
                             f"{self.outer_loop!r}")
        if self.block_m % 16 or self.threads % self.block_m:
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16 that divides the "
                             f"{self.threads} threads (each row's O is owned by threads / block_m)")
        if self.tile_dim % (self.threads // self.block_m) or \
                (self.tile_dim // (self.threads // self.block_m)) % 2:
            raise ValueError(f"block_m={self.block_m} does not give each of the "
                             f"{self.threads // self.block_m} threads of a row whole pairs of O's "
                             f"{self.tile_dim} columns at head_dim {self.head_dim} with "
                             f"{self.warps} warps")
        if self.block_n % (16 * self.warps):
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16 * warps="
                             f"{16 * self.warps} (split-K: 16-key steps a warp)")
        if self.q_splits < 0 or (self.q_splits != 1 and self.outer_loop != "kv"):
            raise ValueError(f"q_splits={self.q_splits}: a count (0: fill the GPU), other than 1 "
                             "only with outer_loop='kv' (with 'q' every query block is its own "
                             "thread block)")
        for rows in (self.block_m, self.block_n):
            tiles.check_tile_copy(rows, self.tile_dim, self.threads)
        if self.smem_bytes() > MAX_SHARED_BYTES:
            raise ValueError(f"block_m={self.block_m}, block_n={self.block_n} need "
                             f"{self.smem_bytes()} bytes of shared memory, more than "
                             f"{MAX_SHARED_BYTES}")
        return self


OPTIONS = configs.options_of(Config)

# Alg.1 l.1 with M = 64 Ki 16-bit elements (128 KB of the 227 KB of shared memory an H100/H200
# thread block may use): B_c = ceil(M / 4d) = 256 at d=64 and 128 at d=128, which are also the key
# blocks of FA1's own kernels. B_r = min(B_c, d) would be 64 and 128, but under split-K every warp
# holds a B_r x d partial P~ V in registers (B_r * d / 32 fp32 a lane: 256 at B_r=64, d=128, more
# than the 255 a thread has), so B_r = 16, one m16 tile, as in FA1's kernels (16-row steps).
# Other head dims: B_c = M / 4d in whole multiples of 64 keys (16 a warp), 64 to 256 (d = 96: 128;
# d > 128: 64), d counted in the tile's columns (tiles.tile_columns).
DEFAULTS = {64: dict(block_m=16, block_n=256), 128: dict(block_m=16, block_n=128)}
for _d in HEAD_DIMS:
    DEFAULTS.setdefault(_d, dict(block_m=16, block_n=min(256, max(
        64, 65536 // (4 * tiles.tile_columns(_d)) // 64 * 64))))


default_config = configs.default_config_function("fa1", Config, DEFAULTS, OPTIONS, HEAD_DIMS)


@lru_cache(maxsize=None)
def build(cfg):
    """Compile-time constants of one configuration, closed over by its kernel."""
    D, BR, BC, WARPS, THREADS = cfg.tile_dim, cfg.block_m, cfg.block_n, cfg.warps, cfg.threads
    DV = cfg.head_dim        # columns in HBM (D: the tiles', zero-padded to whole k16 steps)
    KW, M_TILES = cfg.keys_per_warp, cfg.m_tiles
    ROWS = 2 * M_TILES                               # rows a lane holds: 2 an m16 tile
    ELEM, BANDED, DEFERRED, SOFTCAP = cfg.element.code, cfg.causal, cfg.deferred_rescale, cfg.softcap
    WINDOW = cfg.window
    OUTER_KV, SKIP = cfg.outer_loop == "kv", cfg.causal and cfg.causal_skip
    VARLEN, SHIFT = cfg.varlen, cfg.varlen and cfg.bottom_right
    SWIZZLE = tiles.swizzle_fits(D)                  # swizzled 16-bit tiles, or padded rows
    STRIDE = tiles.tile_row_stride(D, SWIZZLE)
    # Tile copies compute their global address once (tiles.load_tile_async's address_once, fewer
    # integer instructions), except at d=128: there the loop is at 255 registers and the extra
    # live addresses spill inside it (compile report, loop_local).
    ADDRESS_ONCE = D < 128
    KV_TILE, Q_TILE, WARP_KEYS = BC * STRIDE, BR * STRIDE, KW * STRIDE
    Q_STAGES = cfg.q_buffers                         # outer_loop="kv": Q_{i+1} copied during step i
    LAYOUT = cfg.smem_layout()                       # K_j | V_j | Q tile(s) | fp32 exchange area
    K0, V0, Q_START = LAYOUT.start("k"), LAYOUT.start("v"), LAYOUT.start("q")
    O_PART, RED_MAX, RED_SUM = ((LAYOUT.start(r), LAYOUT.end(r))    # in floats
                                for r in ("o_part", "red_max", "red_sum"))
    O_STRIDE = cfg.partial_o_stride                  # partial P~ V rows, in floats
    CHUNK = D // (THREADS // BR)                     # columns of O a thread owns
    Q_FRAG, S_ACC = (M_TILES, 1, 4), (M_TILES, KW // 8, 4)   # Q_i streamed from its tile
    P_FRAG, O_ACC = (M_TILES, KW // 16, 4), (M_TILES, D // 8, 4)
    NEG_INF = float32(-math.inf)

    @device_function
    def scores_and_partial_max(s, q_frag, q_s, k_s, red_max, row0, col0, n_k, lo, hi, softcap,
                               warp, lane):
        """l.9 and the start of l.10 over this warp's keys of K_j: S_w = Q_i K_w^T (masked), and each
        row's max over those keys published for the other warps."""
        key0 = col0 + warp * KW
        tiles.fill(s, float32(0))
        tiles.gemm_abt_streamed(s, q_frag, q_s, 0, D // 16, k_s[warp * WARP_KEYS:(warp + 1) * WARP_KEYS],
                                lane, STRIDE, SWIZZLE, ELEM)
        if SOFTCAP:
            softmax.softcap_scores(s, softcap)
        if masks.block_is_partial(row0, BR, key0, KW, n_k, BANDED, lo, hi, WINDOW):
            tiles.mask_scores(s, row0, key0, n_k, BANDED, lo, hi, lane, WINDOW)
        for r in range(ROWS):
            row_max = softmax.quad_max(softmax.lane_row_max(s, r >> 1, r & 1, NEG_INF))
            splitk.publish(red_max, r, row_max, warp, lane, BR)

    @device_function
    def exp_and_partial_pv(s, p, o_w, v_s, o_part, red_max, red_sum, warp, lane, scale_log2):
        """The rest of l.10, and the P~ V of l.12, over this warp's keys (after a barrier): m~_ij
        gathered from every warp's maxima, P~_w = exp(S_w - m~_ij), and the partial row sums and
        P~_w V_w published for the owners of O_i."""
        for r in range(ROWS):
            m_blk = splitk.gather_max(red_max, splitk.block_row(r, lane), WARPS, BR)
            part = softmax.exponentiate_row(s, r >> 1, r & 1, softmax.exp2_base(m_blk, scale_log2),
                                            scale_log2, 0)
            splitk.publish(red_sum, r, softmax.quad_sum(part), warp, lane, BR)
        tiles.accumulator_to_a(p, s, ELEM)
        tiles.fill(o_w, float32(0))
        tiles.gemm_ab(o_w, p, v_s[warp * WARP_KEYS:(warp + 1) * WARP_KEYS], lane, STRIDE, SWIZZLE,
                      ELEM)
        tiles.stage_accumulator_f32(o_part, o_w, warp * BR, lane, O_STRIDE)

    @device_function
    def update_rows(o_own, m_old, l_old, o_part, red_max, red_sum, row, c0, scale_log2):
        """l.11-12 for the owned chunk of one row of O_i (after a barrier): the block's m~, l~ and
        P~ V, summed over the warps, merged into (O, m, l). Returns (m_new, l_new)."""
        m_blk = splitk.gather_max(red_max, row, WARPS, BR)
        l_blk = splitk.gather_sum(red_sum, row, WARPS, BR)
        m_new, l_new, alpha, beta = softmax.merge_statistics(m_old, l_old, m_blk, l_blk, scale_log2)
        if not DEFERRED:   # l.12 as written: O stays normalised, diag(l_new)^-1 every step
            inv = float32(1) / l_new if l_new > float32(0) else float32(0)   # 0: no key yet
            alpha, beta = alpha * l_old * inv, beta * inv
        splitk.merge_partial_o(o_own, o_part, row, c0, alpha, beta, WARPS, BR, O_STRIDE)
        return m_new, l_new

    @device_function
    def write_output(o32, lse, m_ws, l_ws, o_own, grow, c0, m_row, l_row, softmax_scale):
        """O_i's owned chunk in the output dtype (deferred: normalised now, once) and the row's
        L = m + log l; without deferral also FA1's saved statistics m and l."""
        seen = l_row > float32(0)   # a row that sees no key: O = 0, L = -inf
        if DEFERRED:
            inv = float32(1) / l_row if seen else float32(0)
            for c in range(CHUNK):
                o_own[c] *= inv
        splitk.store_row_chunk(o32, grow, c0, o_own, ELEM, DV if DV < D else 0)
        if c0 == 0:
            lse[grow] = m_row * softmax_scale + math.log(l_row) if seen else NEG_INF
            if not DEFERRED:
                m_ws[grow] = m_row
                l_ws[grow] = l_row

    @kernel
    def fa1_forward(q, k, v, o, lse, o_ws, m_ws, l_ws, n_q, n_k, kv_group, lo, hi, softcap,
                    softmax_scale, scale_log2, cu_q, cu_k):
        """q, k, v: (B, H, N, d) uint16 views; o: (B, H, N_q, d/2) uint32 view; lse, m_ws, l_ws:
        (B, H, N_q) fp32; o_ws: (B, H, N_q, D) fp32 (D = tiles.tile_columns(d)), O between K/V
        blocks (outer_loop="kv");
        lo, hi, softcap: the mask (variants/fa2.py). VARLEN: B = 1 and batch b of the grid is the
        sequence of rows cu_q[b] .. cu_q[b+1] - 1 (keys: cu_k), lo and hi relative to its top-left
        corner (as fa2's forward)."""
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        if VARLEN:   # sequence b of the packed batch: its rows, and its own band
            first_q, first_k = cu_q[b], cu_k[b]
            n_q, n_k = int32(cu_q[b + 1] - first_q), int32(cu_k[b + 1] - first_k)
            if SHIFT:
                lo, hi = int32(lo + (n_k - n_q)), int32(hi + (n_k - n_q))
            q_bh = q[0, h, first_q:first_q + n_q]
            k_h = k[0, h // kv_group, first_k:first_k + n_k]
            v_h = v[0, h // kv_group, first_k:first_k + n_k]
            o_bh, lse_bh = o[0, h, first_q:first_q + n_q], lse[0, h, first_q:first_q + n_q]
            m_bh, l_bh = m_ws[0, h, first_q:first_q + n_q], l_ws[0, h, first_q:first_q + n_q]
            o_ws_bh = o_ws[0, h, first_q:first_q + n_q] if OUTER_KV else o_ws[0, 0]
        else:
            q_bh, k_h, v_h = q[b, h], k[b, h // kv_group], v[b, h // kv_group]
            o_bh, lse_bh, m_bh, l_bh = o[b, h], lse[b, h], m_ws[b, h], l_ws[b, h]
            o_ws_bh = o_ws[b, h] if OUTER_KV else o_ws[0, 0]
        smem = cuda.shared.array(0, uint16)
        k_s, v_s = smem[K0:K0 + KV_TILE], smem[V0:V0 + KV_TILE]
        f32 = cuda.shared.array(0, float32)
        o_part = f32[O_PART[0]:O_PART[1]]
        red_max = f32[RED_MAX[0]:RED_MAX[1]]
        red_sum = f32[RED_SUM[0]:RED_SUM[1]]
        row, c0 = splitk.owner_of(tid, THREADS, BR, D)    # the row and columns of O this thread owns
        q_frag = cuda.local.array(Q_FRAG, uint32)
        s = cuda.local.array(S_ACC, float32)
        p = cuda.local.array(P_FRAG, uint32)
        o_w = cuda.local.array(O_ACC, float32)
        o_own = cuda.local.array(CHUNK, float32)
        t_c = (n_k + BC - 1) // BC
        t_r = (n_q + BR - 1) // BR

        if OUTER_KV:
            # Alg. 1 over this thread block's share of the query blocks (all of them: q_splits=1).
            share = (t_r + cuda.gridDim.x - 1) // cuda.gridDim.x
            i_begin = cuda.blockIdx.x * share
            i_end = min(t_r, i_begin + share)
            if VARLEN and i_begin >= i_end:   # the grid covers the longest sequence
                return
            # query blocks that see no key at all (skipping; a packed sequence of no key) are
            # never visited: O = 0, L = -inf
            if SKIP or VARLEN:
                for i in range(i_begin, i_end):
                    j_first, j_stop = masks.key_blocks(i * BR, BR, n_q, n_k, BC, lo, hi)
                    if j_stop <= j_first and i * BR + row < n_q:
                        for c in range(CHUNK):
                            o_own[c] = float32(0)
                        write_output(o_bh, lse_bh, m_bh, l_bh, o_own, i * BR + row, c0, NEG_INF,
                                     float32(0), softmax_scale)
            for j in range(t_c):                                   # l.5
                col0 = j * BC
                i_first, i_stop = i_begin, i_end
                if SKIP:   # only the query blocks whose band reaches K_j
                    i0, i1 = masks.query_blocks(col0, BC, n_q, n_k, BR, lo, hi)
                    i_first, i_stop = max(i_begin, i0), min(i_end, i1)
                if i_first < i_stop:
                    # l.6: K_j, V_j to SRAM (with the first Q_i), once every warp is done with the
                    # previous ones.
                    cuda.syncthreads()
                    tiles.load_tile_async(k_s, k_h, col0, n_k, 0, BC, D, STRIDE, SWIZZLE,
                                          tid, THREADS, ADDRESS_ONCE, DV)
                    tiles.load_tile_async(v_s, v_h, col0, n_k, 0, BC, D, STRIDE, SWIZZLE,
                                          tid, THREADS, ADDRESS_ONCE, DV)
                    tiles.load_tile_async(smem[Q_START:Q_START + Q_TILE], q_bh, i_first * BR, n_q,
                                          0, BR, D, STRIDE, SWIZZLE, tid, THREADS, ADDRESS_ONCE,
                                          DV)
                    pipeline.commit()
                for i in range(i_first, i_stop):                   # l.7
                    row0 = i * BR
                    q0 = pipeline.slot_start(Q_START, i - i_first, Q_STAGES, Q_TILE)   # Q_i's tile
                    pipeline.wait_and_release(0)   # Q_i landed; every warp is done with step i-1
                    if i + 1 < i_stop:     # Q_{i+1} into the other tile while step i computes
                        nxt = pipeline.slot_start(Q_START, i + 1 - i_first, Q_STAGES, Q_TILE)
                        tiles.load_tile_async(smem[nxt:nxt + Q_TILE], q_bh, row0 + BR, n_q, 0, BR, D,
                                              STRIDE, SWIZZLE, tid, THREADS, ADDRESS_ONCE,
                                              DV)
                    pipeline.commit()
                    # l.8: O_i, l_i, m_i from HBM; their first visit (j = 0, or the first block
                    # of the band) starts from l.2's values.
                    grow = row0 + row
                    j_first, j_stop = int32(0), int32(t_c)
                    if SKIP:
                        j_first, j_stop = masks.key_blocks(row0, BR, n_q, n_k, BC, lo, hi)
                    m_old, l_old = NEG_INF, float32(0)
                    for c in range(CHUNK):
                        o_own[c] = float32(0)
                    if j > j_first and grow < n_q:
                        m_old, l_old = m_bh[grow], l_bh[grow]
                        for c in range(CHUNK):
                            o_own[c] = o_ws_bh[grow, c0 + c]
                    # l.9-10 over each warp's keys; maxima, sums and P~ V exchanged (split-K).
                    q_s = smem[q0:q0 + Q_TILE]
                    scores_and_partial_max(s, q_frag, q_s, k_s, red_max, row0, col0, n_k, lo, hi,
                                           softcap, warp, lane)
                    cuda.syncthreads()
                    exp_and_partial_pv(s, p, o_w, v_s, o_part, red_max, red_sum, warp, lane,
                                       scale_log2)
                    cuda.syncthreads()
                    # l.11-12 by the owners of O_i's rows.
                    m_new, l_new = update_rows(o_own, m_old, l_old, o_part, red_max, red_sum, row,
                                               c0, scale_log2)
                    # l.12-13: back to HBM; after the last K/V block Q_i sees, O_i is the output.
                    if grow < n_q:
                        if j == j_stop - 1:
                            write_output(o_bh, lse_bh, m_bh, l_bh, o_own, grow, c0, m_new, l_new,
                                         softmax_scale)
                        else:
                            for c in range(CHUNK):
                                o_ws_bh[grow, c0 + c] = o_own[c]
                            if c0 == 0:
                                m_bh[grow] = m_new
                                l_bh[grow] = l_new
        else:
            # FA2's loop order: this thread block is query block i; O_i, l_i, m_i stay on chip.
            i = masks.query_block(SKIP)   # skipping blocks: the longest first
            row0 = i * BR
            if VARLEN and row0 >= n_q:    # the grid covers the longest sequence
                return
            j0, j1 = int32(0), int32(t_c)
            if SKIP:
                j0, j1 = masks.key_blocks(row0, BR, n_q, n_k, BC, lo, hi)
            q_s = smem[Q_START:Q_START + Q_TILE]
            tiles.load_tile_async(q_s, q_bh, row0, n_q, 0, BR, D, STRIDE, SWIZZLE,
                                  tid, THREADS, ADDRESS_ONCE, DV)
            tiles.load_tile_async(k_s, k_h, j0 * BC, n_k, 0, BC, D, STRIDE, SWIZZLE,
                                  tid, THREADS, ADDRESS_ONCE, DV)
            pipeline.commit()
            tiles.load_tile_async(v_s, v_h, j0 * BC, n_k, 0, BC, D, STRIDE, SWIZZLE,
                                  tid, THREADS, ADDRESS_ONCE, DV)
            pipeline.commit()
            m_row, l_row = NEG_INF, float32(0)
            for c in range(CHUNK):
                o_own[c] = float32(0)
            for j in range(j0, j1):   # l.9-12 for K_j, V_j as in the other loop order
                col0 = j * BC
                pipeline.wait_and_release(1)   # K_j landed; every warp is done with step j-1
                scores_and_partial_max(s, q_frag, q_s, k_s, red_max, row0, col0, n_k, lo, hi,
                                       softcap, warp, lane)
                pipeline.wait_and_release(0)   # V_j landed; every warp is done with K_j: copy
                if j + 1 < j1:                 # K_{j+1}
                    tiles.load_tile_async(k_s, k_h, col0 + BC, n_k, 0, BC, D, STRIDE, SWIZZLE, tid,
                                          THREADS, ADDRESS_ONCE, DV)
                pipeline.commit()
                exp_and_partial_pv(s, p, o_w, v_s, o_part, red_max, red_sum, warp, lane,
                                   scale_log2)
                pipeline.release()     # every warp is done with V_j: copy V_{j+1}
                if j + 1 < j1:
                    tiles.load_tile_async(v_s, v_h, col0 + BC, n_k, 0, BC, D, STRIDE, SWIZZLE, tid,
                                          THREADS, ADDRESS_ONCE, DV)
                pipeline.commit()
                m_row, l_row = update_rows(o_own, m_row, l_row, o_part, red_max, red_sum, row, c0,
                                           scale_log2)
            pipeline.wait(0)   # a block that visits no K/V block (j1 <= j0): Q, K, V in flight
            grow = row0 + row
            if grow < n_q:
                write_output(o_bh, lse_bh, m_bh, l_bh, o_own, grow, c0, m_row, l_row, softmax_scale)

    return fa1_forward


@replayed(3)
def forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            align=masks.BOTTOM_RIGHT, out=None, **options):
    """FA1 forward; same arguments and results as variants.fa2.forward. options: see Config."""
    prob = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out,
                   head_dims=HEAD_DIMS, variant="fa1", window_size=window_size, softcap=softcap,
                   align=align)
    return _run(prob, options)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   align=masks.BOTTOM_RIGHT, out=None, **options):
    """FA1 forward over a packed batch of sequences; arguments and results as
    variants.fa2.forward_varlen. The grid covers max_seqlen_q rows of every sequence (its query
    blocks split q_splits ways); a block past its sequence's end returns at once."""
    prob = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal=causal, softmax_scale=softmax_scale, out=out,
                          head_dims=HEAD_DIMS, variant="fa1", window_size=window_size,
                          softcap=softcap, align=align)
    return _run(prob, options)


def _run(prob, options):
    cfg = default_config(prob.head_dim, prob.element, prob.banded, configs.mask_fields(prob),
                         **options)
    b, h, n_q = prob.batch, prob.heads, prob.n_q    # packed: b sequences, n_q rows in all
    seqs = prob.varlen
    rows = n_q if seqs is None else seqs.max_q      # the grid covers the longest sequence
    cu_q, cu_k = (seqs.cu_q, seqs.cu_k) if seqs is not None else \
        (arrays.placeholder(prob.library, 1, prob.like, "int32"),) * 2
    ws = (1 if seqs is not None else b, h, n_q)      # the workspaces: rows as O's
    t_r = (rows + cfg.block_m - 1) // cfg.block_m
    if cfg.outer_loop == "kv":
        splits = cfg.q_splits or -(-RESIDENT * target.multiprocessor_count() // (b * h))
        grid = (min(splits, t_r), b, h)
        o_shape = ws + (cfg.tile_dim,)                    # O between K/V blocks, fp32
    else:
        grid = (t_r, b, h)
        o_shape = (1, 1, 1, cfg.tile_dim)                 # not used
    o_ws, m_ws, l_ws = prob.scratch_views((o_shape, np.float32), (ws, np.float32),
                                          (ws, np.float32))
    launch(build(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream,
           prob.q, prob.k, prob.v, prob.o32, prob.lse,
           o_ws, m_ws, l_ws,
           np.int32(n_q), np.int32(prob.n_k), np.int32(prob.kv_group), *prob.mask_args(),
           np.float32(prob.softmax_scale), np.float32(prob.softmax_scale * math.log2(math.e)),
           cu_q, cu_k)
    return prob.result()


# --------------------------------------------------------------------------- backward
# FA1 Algorithm 4 and FA2 Algorithm 2 compute the same products per (K/V block j, query block i):
# S, P from the saved statistics, dV_j += P^T dO_i, dP, dS, dQ_i += dS K_j (read-modify-write in
# HBM), dK_j += dS^T Q_i. What FA2 changed is the schedule: Alg. 4 walks every j inside one thread
# block per (batch, head) (l.5), Alg. 2 makes j the grid. So fa1's backward is fa2's kernel run in
# Alg. 4's schedule (kv_blocks="sequential": the block's own fp32 adds into dQ in HBM are Alg. 4's
# read-modify-write, l.21), with fa1's causal default (no block skipping). Two details differ from
# the paper's listing and are shared with fa2: D_i = rowsum(dO_i o O_i) (Alg. 4 l.19, inside the
# loop) comes from one pass before it, and P is rebuilt from L = m + log l, which equals
# diag(l)^-1 exp(S - m) (l.13-14).

BACKWARD_OPTIONS = ("block_m", "block_n", "warps", "query_warps", "causal_skip", "swizzle",
                    "kv_in_registers", "dq_reduce")


def default_backward_config(head_dim, element, causal, problem=(), **options):
    """The configuration of fa2's backward kernel that `backward` launches: Algorithm 4's schedule
    (kv_blocks="sequential", dq="atomic"), causal_skip False unless set, the rest fa2's backward
    defaults (variants/fa2_backward.py), overridden by the options (BACKWARD_OPTIONS) not None."""
    if not options:   # the common call: resolved once per problem
        return _plain_backward_config(head_dim, element, causal, tuple(problem))
    return _backward_config(head_dim, element, causal, problem, **options)


@lru_cache(maxsize=None)
def _plain_backward_config(head_dim, element, causal, problem):
    return _backward_config(head_dim, element, causal, problem)


def _backward_config(head_dim, element, causal, problem, **options):
    from variants import fa2_backward
    unknown = set(options) - set(BACKWARD_OPTIONS)
    if unknown:
        raise ValueError(f"fa1 backward has no option {', '.join(sorted(unknown))}; its options: "
                         f"{', '.join(BACKWARD_OPTIONS)}")
    tiles.check_head_dim(head_dim, "fa1 backward", HEAD_DIMS)
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("causal_skip", False)
    return fa2_backward.default_backward_config(head_dim, element, causal, problem, dq="atomic",
                                                kv_blocks="sequential", **options)


@replayed(6)
def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
             softcap=0.0, align=masks.BOTTOM_RIGHT, grads=None, **options):
    """FA1 backward (Algorithm 4's schedule); arguments as variants.fa2_backward.backward. options: the tile
    of fa2's backward kernel (BACKWARD_OPTIONS), causal_skip False unless set."""
    from variants import fa2_backward
    g = bwd.prepare_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                             grads=grads, head_dims=HEAD_DIMS, variant="fa1",
                             window_size=window_size, softcap=softcap, align=align)
    cfg = default_backward_config(g.prob.head_dim, g.prob.element, g.prob.banded,
                                  configs.mask_fields(g.prob), **options)
    return fa2_backward.run_backward(g, cfg)


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    align=masks.BOTTOM_RIGHT, grads=None, **options):
    """The backward of forward_varlen: Algorithm 4's schedule of fa2's kernel over each sequence
    of the packed batch (a thread block per (sequence, K/V head) walking its K/V blocks), dQ added
    by vector atomics (dq_reduce="red": the bulk reduction's staging is per query block of one
    sequence); arguments as variants.fa2_backward.backward_varlen."""
    from variants import fa2_backward
    return fa2_backward.run_backward_varlen(
        (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
             align=align, grads=grads), options, "fa1", default_backward_config)


def compile_targets():
    """(name, kernel, argument types, mma count in its PTX) of the configurations `forward`
    launches by default in bf16 (fp16: d=64 non-causal), and of the ladder's other fa1 rungs
    (d=128, bf16)."""
    ws4, ws3 = types.Array(types.float32, 4, "C"), LSE_TYPE
    argtypes = (QKV_TYPE, QKV_TYPE, QKV_TYPE, OUT_TYPE, LSE_TYPE, ws4, ws3, ws3, types.int32,
                types.int32, types.int32) + MASK_TYPES + (types.float32, types.float32, SEQS_TYPE,
                                                          SEQS_TYPE)
    rungs = [dict(), dict(outer_loop="q"), dict(outer_loop="q", deferred_rescale=True)]
    for head_dim in (64, 128):   # the other head dims change tile widths, not the code
        for element in (BFLOAT16, FLOAT16):
            for causal in (False, True):
                if element != BFLOAT16 and (causal or head_dim != 64):
                    continue   # fp16 changes only the mma and cvt opcodes: one configuration
                ladder = element == BFLOAT16 and not causal and head_dim == 128
                for options in rungs if ladder else rungs[:1]:
                    cfg = default_config(head_dim, element, causal, **options)
                    # Q K^T and P~ V over a warp's keys: m_tiles * (d/16 * K_w/8 + K_w/16 * d/8)
                    mma = cfg.m_tiles * head_dim * cfg.keys_per_warp // 64
                    tag = "".join(f" {k}={v}" for k, v in options.items())
                    yield f"fa1 d={head_dim} {element.tag} causal={causal}{tag}", \
                        build(cfg), argtypes, mma
    from variants import fa2_backward
    cfg = default_backward_config(128, BFLOAT16, False)
    yield from fa2_backward.backward_compile_targets(cfg, "fa1 backward d=128 bf16 causal=False")
