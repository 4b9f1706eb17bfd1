"""FlashAttention-2 forward (Dao 2023, Algorithm 1) on the tile layer of `common/`. Its backward
(Algorithm 2) is variants/fa2_backward.py, which fa1 and fa3 run too.

What makes it FA2 rather than FA1:
- the outer loop over query blocks i is the grid (one thread block per (i, batch, head)), the inner
  loop over K/V blocks j runs inside the block, so O_i, l_i, m_i never leave the chip;
- O_i stays un-normalised and is divided by l_i once, at the end (l.12); only L = m + log l is saved;
- the warps split Q_i (split-Q): warp w owns rows [16*M*w, 16*M*(w+1)) of the block and needs no
  other warp's results, so there is no inter-warp reduction;
- causal: blocks j entirely above the diagonal are never visited; only blocks that cross the diagonal
  (or the ragged end) are masked (`causal_skip=False` visits and masks them all: the ladder's last
  rung, variants/fa1.py).

Hardware mapping: S and O are mma.m16n8k16 accumulators in registers; P~ goes from the S
accumulator straight into the A operand of the P V mma (`p_in_registers=False`: through a shared
tile instead); Q_i's A fragments are either held in registers for the whole loop or, as FA2's own
kernels do at head_dim 128, re-read from the shared Q tile at every step (`q_in_registers=False`),
which frees the registers for two m16 tiles a warp. K_j and V_j arrive by cp.async, either into
two buffers each (`kv_stages=2`, the default: K_{j+1} and V_{j+1} are issued at the top of step j,
a whole step before they are needed, one barrier a step) or into one tile each (`kv_stages=1`, FA2's
own kernels: K_{j+1} overlaps softmax and P V, V_{j+1} the next Q K^T, four barriers a step);
`pipeline=False` waits for every copy. Defaults and what each switch is worth:
docs/performance/fa2.md (other head dims: head_dims.md).
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import ptx
from common.hardware.elements import BFLOAT16, FLOAT16, Element
from common.hardware.target import MAX_SHARED_BYTES, device_function, kernel_with_launch_bounds
from common.host import arrays, configs
from common.host.launching import launch
from common.host.mods import no_block_mask, with_mods
from common.host.problem import (
    BLOCK_MASK_TYPES,
    PAGE_TYPES,
    LSE_TYPE,
    MASK_TYPES,
    MOD_TYPES,
    OUT_TYPE,
    QKV_TYPE,
    DROPOUT_TYPES,
    SCORE_TYPES,
    SEQS_TYPE,
    prepare,
    prepare_varlen,
    with_dropout,
    with_score_terms,
)
from common.host.replay import replayed
from common.tile import dropout, masks, mods, paging, pipeline, softmax, tiles
from common.tile.smem import SharedLayout
from variants import fa2_backward

HEAD_DIMS = tiles.HEAD_DIMS

# Algorithm 2, FA2's backward (variants/fa2_backward.py), as fa2's own: its calls and its options
backward, backward_varlen = fa2_backward.backward, fa2_backward.backward_varlen
BACKWARD_OPTIONS, default_backward_config = (fa2_backward.BACKWARD_OPTIONS,
                                             fa2_backward.default_backward_config)


@dataclass(frozen=True)
class Config:
    """Compile-time shape of the kernel. block_m = B_r, block_n = B_c of the paper."""
    head_dim: int
    element: Element        # the 16-bit type of the inputs and the output (common/hardware/elements.py)
    causal: bool            # a band mask (causal and/or sliding window, common/tile/masks.py)
    window: bool = False    # the band has a left edge (sliding window): its test compiled in
    softcap: bool = False   # scores soft-capped (Gemma 2)
    alibi: bool = False     # ALiBi's bias by distance (alibi_slopes)
    sinks: bool = False     # an attention sink a head (gpt-oss): a logit in each row's softmax
    dropout: bool = False   # dropout on P (Philox in the kernel: common/tile/dropout.py)
    mods: object = None     # a user's score_mod / mask_mod (common/host/mods.py: ScoreMods)
    block_mask: bool = False   # visit only the K/V blocks a BlockMask lists (common/tile/mods.py)
    block_m: int = 64       # B_r: query rows a thread block owns (DEFAULTS below: 128)
    block_n: int = 64       # B_c: keys per inner step
    warps: int = 4          # split-Q: each warp owns block_m / warps query rows
    pipeline: bool = True   # overlap the K/V copies with compute (cp.async groups)
    swizzle: bool = True    # XOR-swizzled shared tiles (False: padded rows)
    kv_stages: int = 1      # K/V buffers: 1 (FA2's kernels) or 2 (double-buffered, a step ahead)
    q_in_registers: bool = True   # Q_i's fragments held in registers (False: re-read each step)
    p_in_registers: bool = True   # P~ re-packed in registers (False: through a shared tile)
    causal_skip: bool = True      # banded: never visit K/V blocks outside the band (False: mask them)
    min_blocks_per_sm: int = 0    # launch bounds (threads, n) for ptxas: n thread blocks an SM is
                                  # to hold (it may then give a thread 64K / (n threads) registers
                                  # and schedules to use them); 0: none
    varlen: bool = False          # a packed batch of sequences (forward_varlen): bounds per block
    bottom_right: bool = True     # varlen: the band's diagonal at each sequence's bottom-right
    paged: bool = False           # varlen: K and V in the pages of a cache (block_table), pages of
    #                               a multiple of block_n keys: a K/V tile within one page

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def m_tiles(self):  # m16 tiles per warp
        return self.block_m // (16 * self.warps)

    @property
    def tile_dim(self):  # columns of the Q, K, V tiles: head_dim, zero-padded to a multiple of 16
        return tiles.tile_columns(self.head_dim)

    @configs.once_per_config
    def smem_layout(self):
        """Q_i | kv_stages x (K_j, V_j) | P~ (p_in_registers=False): 16-bit tiles."""
        d = tiles.tile_row_stride(self.tile_dim, self.swizzle)
        p = 0 if self.p_in_registers else self.block_m * tiles.tile_row_stride(self.block_n, self.swizzle)
        return SharedLayout(("q", self.block_m * d, 2),
                            ("kv", 2 * self.kv_stages * self.block_n * d, 2), ("p", p, 2))

    def smem_bytes(self):
        return self.smem_layout().bytes

    def validate(self):
        tiles.check_head_dim(self.head_dim, "fa2")
        if self.block_m % (16 * self.warps):
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16 * warps={16 * self.warps}")
        if self.min_blocks_per_sm < 0:
            raise ValueError(f"min_blocks_per_sm must be 0 (no launch bounds) or a count of thread "
                             f"blocks an SM is to hold, got {self.min_blocks_per_sm}")
        if self.kv_stages not in (1, 2):
            raise ValueError(f"kv_stages must be 1 or 2, got {self.kv_stages}")
        if self.block_n % (32 if self.dropout else 16):
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16 (with dropout: 32, "
                             f"a Philox call's keys)")
        for rows in (self.block_m, self.block_n):
            tiles.check_tile_copy(rows, self.tile_dim, self.threads)
        tiles.tile_row_stride(self.tile_dim, self.swizzle)     # swizzled: 64, 128 or 256 columns
        if not self.p_in_registers:
            tiles.tile_row_stride(self.block_n, self.swizzle)
        if self.smem_bytes() > MAX_SHARED_BYTES:
            raise ValueError(f"fa2 with block_m={self.block_m}, block_n={self.block_n}, "
                             f"kv_stages={self.kv_stages} at head_dim {self.head_dim} needs "
                             f"{self.smem_bytes()} bytes of shared memory, over the "
                             f"{MAX_SHARED_BYTES} a thread block may have")
        return self


OPTIONS = configs.options_of(Config)

# Defaults by head_dim, chosen by measurement on an H200 (docs/performance/fa2.md, head_dims.md;
# sweeps in conf/experiment/fa2_tiles.yaml and fa2_ablations.yaml). Both use B_r = 128 with 4
# warps, i.e. two m16 tiles a warp, so every K/V fragment a warp loads from shared memory feeds two
# MMAs, and double-buffered K/V (a full step for each copy to land, one barrier a step). At d=128
# the O accumulator alone is 128 registers a thread, so Q_i is re-read from shared memory each step
# (as in FA2's kernels) instead of held in 64 more registers. Except at d=128 non-causal, where one
# K/V buffer (FA2's own: K_{j+1} copied while P V runs) measured 2-4% faster (H100 2k-8k,
# docs/results/fwd_kv_stages_h100.csv; +3% on the H200) and two buffers 4-5% faster causal.
# The other head dims take the nearer of the two up to 128; past it, where two m16 tiles of O would
# be 2 * d / 2 registers a thread, a warp owns one m16 tile and B_r = 128 takes 8 warps (FA2's
# tiles at d = 160-256), with launch bounds of one such block an SM (min_blocks_per_sm=1: without
# them ptxas held the d=192 kernel to 173 registers and left each ldmatrix right before its mma;
# common/hardware/target.py: kernel_with_launch_bounds). Tiles of other than 64, 128, 256 columns take padded rows
# (tiles.swizzle_fits); a head_dim that is not a multiple of 16 takes the tile of the next one
# (tiles.tile_columns: d=40 runs in 48 columns, 56 in 64, swizzled).
DEFAULTS = {64: dict(block_m=128, block_n=64, kv_stages=2),
            128: dict(block_m=128, block_n=64, kv_stages=2, q_in_registers=False),
            (128, False): dict(kv_stages=1)}
for _d in HEAD_DIMS:
    _t = tiles.tile_columns(_d)
    DEFAULTS[_d] = dict(DEFAULTS[64] if _t <= 64 else DEFAULTS[128] if _t <= 128 else
                        dict(block_m=128, block_n=64, warps=8, kv_stages=2, q_in_registers=False,
                             min_blocks_per_sm=1),
                        **({} if tiles.swizzle_fits(_t) else dict(swizzle=False)))


default_config = configs.default_config_function("fa2", Config, DEFAULTS, OPTIONS, HEAD_DIMS)


@lru_cache(maxsize=None)
def build(cfg):
    """Compile-time constants of one configuration, closed over by its kernel."""
    D, BR, BC, THREADS = cfg.tile_dim, cfg.block_m, cfg.block_n, cfg.threads
    DV = cfg.head_dim       # columns of q, k, v, o in HBM (D: the tiles', zero-padded to whole k16)
    M = cfg.m_tiles
    ELEM, BANDED, PIPELINE, SWIZZLE = cfg.element.code, cfg.causal, cfg.pipeline, cfg.swizzle
    SKIP, SOFTCAP, WINDOW = cfg.causal and cfg.causal_skip, cfg.softcap, cfg.window
    VARLEN, SHIFT = cfg.varlen, cfg.varlen and cfg.bottom_right
    PAGED = cfg.paged
    ALIBI, SINKS, DROPOUT = cfg.alibi, cfg.sinks, cfg.dropout
    MODS, APPLY_MODS, _, _ = mods.for_kernel(cfg.mods, False, (1, 1, 1))   # (no grad here)
    LISTED = cfg.block_mask
    Q_IN_REGISTERS, P_IN_REGISTERS = cfg.q_in_registers, cfg.p_in_registers
    STRIDE = tiles.tile_row_stride(D, SWIZZLE)
    # Tile copies compute their global address once (tiles.load_tile_async's address_once, fewer
    # integer instructions), except at d=128: there the loop is at 255 registers and the extra
    # live addresses spill inside it (compile report, loop_local).
    ADDRESS_ONCE = D < 128
    P_STRIDE = tiles.tile_row_stride(BC, SWIZZLE) if not P_IN_REGISTERS else 0
    Q_TILE, KV_TILE, P_TILE = BR * STRIDE, BC * STRIDE, BR * P_STRIDE
    STAGES = cfg.kv_stages
    LAYOUT = cfg.smem_layout()
    Q_START, KV_START, P_START = LAYOUT.start("q"), LAYOUT.start("kv"), LAYOUT.start("p")
    # Register arrays need literal shapes: A fragments of Q (all k-steps of 16 over d, or one when
    # they are re-read each step), the S and O accumulators (n-tiles of 8), P~ as A fragments
    # (k-steps of 16 over B_c), 2 rows a lane per m-tile.
    Q_FRAG = (M, D // 16 if Q_IN_REGISTERS else 1, 4)
    S_ACC, O_ACC, P_FRAG = (M, BC // 8, 4), (M, D // 8, 4), (M, BC // 16, 4)
    ROWS = 2 * M

    @device_function
    def load_kv_tile(tile, src, pages, row0, n_rows, tid):
        """Start the cp.async copy of rows row0..row0+B_c of K or V into a shared tile (zeros
        from n_rows on). PAGED: src is the head's (pages, page_size, d) and pages = (the block
        table, the sequence, log2 page_size, the last page): key row0 lies at slot row0 mod
        page_size of its page (common/tile/paging.py, both indices clamped), and so does the
        whole tile (pages hold a multiple of B_c keys)."""
        if PAGED:
            table, seq, page_shift, last_page = pages
            page = paging.checked_page(table, seq, row0, page_shift, last_page)
            slot0 = row0 & int32((int32(1) << page_shift) - int32(1))
            tiles.load_tile_async(tile, src[page], slot0, int32(slot0 + n_rows - row0), 0, BC,
                                  D, STRIDE, SWIZZLE, tid, THREADS, ADDRESS_ONCE, DV)
        else:
            tiles.load_tile_async(tile, src, row0, n_rows, 0, BC, D, STRIDE, SWIZZLE,
                                  tid, THREADS, ADDRESS_ONCE, DV)

    @device_function
    def refill_after_use(tile, src, pages, t, t_end, listed, n_rows, tid):
        """One K/V buffer (FA2's schedule): once every warp has passed the barrier, step t's block
        is no longer needed; start copying step t+1's (if before t_end) into the same tile."""
        pipeline.release()
        if t + 1 < t_end:
            load_kv_tile(tile, src, pages, mods.step_block(listed, t + 1, LISTED)[0] * BC, n_rows,
                         tid)
        pipeline.commit()
        if not PIPELINE:
            pipeline.wait(0)

    @kernel_with_launch_bounds(THREADS, cfg.min_blocks_per_sm)
    def fa2_forward(q, k, v, o, lse, n_q, n_k, kv_group, lo, hi, softcap, softmax_scale,
                    scale_log2, cu_q, cu_k, alibi, alibi_stride, alibi_shift, sinks, seed_lo,
                    seed_hi, offset_lo, offset_hi, keep_below, drop_scale, drop_cg, aux,
                    bm_blocks, bm_counts, bm_per_b, bm_per_h, block_table, page_shift):
        """q, k, v: (B, H, N, d) uint16 views; o: (B, H, N_q, d/2) uint32 view; lse: (B, H, N_q).
        lo, hi: the band of keys a query sees (lo <= key - query <= hi, when BANDED); softcap: the
        cap on raw scores (when SOFTCAP). VARLEN: B = 1 and batch b of the grid is the sequence of
        rows cu_q[b] .. cu_q[b+1] - 1 (keys: cu_k), lo and hi relative to its top-left corner.
        alibi, alibi_stride, alibi_shift: ALiBi's slopes (when ALIBI), slope alibi[b *
        alibi_stride + h], distances from key query + alibi_shift; sinks: a sink logit a head
        (when SINKS). (common/host/problem.py: score_args.) seed_lo .. drop_cg: dropout's Philox
        seed and offset, keep threshold, 1 / (1 - p) and column groups (when DROPOUT;
        problem.dropout_args); aux: the arrays score_mod and mask_mod read (when MODS;
        common/tile/mods.py); bm_blocks, bm_counts: a BlockMask's lists (when LISTED), of batch
        b * bm_per_b and head h * bm_per_h (0: one list for all). PAGED (VARLEN): k, v are
        (pages, H_kv, page_size, d) views of a paged cache, sequence b's key t in page
        block_table[b, t >> page_shift]."""
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        # Alg.1 l.3: "for 1 <= i <= T_r" is the grid; with causal masking the blocks with the most
        # K/V blocks to visit are started first.
        i = masks.query_block(BANDED)
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        row0 = i * BR                       # first query row of Q_i
        if VARLEN:   # sequence b of the packed batch: its rows, and its own band
            first_q, first_k = cu_q[b], cu_k[b]
            n_q, n_k = int32(cu_q[b + 1] - first_q), int32(cu_k[b + 1] - first_k)
            if row0 >= n_q:                 # the grid covers the longest sequence
                return
            if SHIFT:
                lo, hi = int32(lo + (n_k - n_q)), int32(hi + (n_k - n_q))
                alibi_shift = int32(n_k - n_q)
            q_i = q[0, h, first_q:first_q + n_q]
            if PAGED:   # the head's pages; each tile's page from the table (load_kv_tile)
                k_h, v_h = k[:, h // kv_group], v[:, h // kv_group]
            else:
                k_h = k[0, h // kv_group, first_k:first_k + n_k]
                v_h = v[0, h // kv_group, first_k:first_k + n_k]
        else:
            q_i, k_h, v_h = q[b, h], k[b, h // kv_group], v[b, h // kv_group]
        pages = (block_table, b, page_shift, int32(k.shape[0] - 1))   # (PAGED: the table's)
        warp_row = warp * 16 * M            # first row of this warp's part of Q_i (split-Q)
        slope = alibi[b * alibi_stride + h] / softmax_scale if ALIBI else float32(0)
        rng = (seed_lo, seed_hi, offset_lo, offset_hi, keep_below)   # dropout's Philox stream
        bh = b * cuda.gridDim.z + h
        inv_scale = float32(1) / softmax_scale if MODS else float32(0)

        smem = cuda.shared.array(0, uint16)   # Q_i | STAGES x (K, V) | P~ (p_in_registers=False)
        q_s = smem[Q_START:Q_START + Q_TILE]
        p_s = smem[P_START:P_START + P_TILE]
        p_s32 = cuda.shared.array(0, uint32)[P_START // 2:(P_START + P_TILE) // 2]

        # Causal or a window: K/V blocks outside the band of Q_i's rows are never visited
        # (causal_skip=False: they are, fully masked, as an ablation).
        j0, j1 = int32(0), int32((n_k + BC - 1) // BC)
        if SKIP:
            j0, j1 = masks.key_blocks(row0, BR, n_q, n_k, BC, lo, hi)
        # The steps t0 <= t < t1 of the loop: blocks j0 .. j1 - 1, or with a block mask the
        # entries of Q_i's list within them (mods.step_block: step t's block).
        listed = bm_blocks[b * bm_per_b, h * bm_per_h, i if LISTED else 0]
        t0, t1 = j0, j1
        if LISTED:
            t0, t1 = mods.listed_range(listed, bm_counts[b * bm_per_b, h * bm_per_h, i], j0, j1)
        first_col = mods.step_block(listed, t0, LISTED)[0] * BC

        # Alg.1 l.4: load Q_i (and, ahead of the loop, the first K_j and V_j) from HBM to SRAM.
        tiles.load_tile_async(q_s, q_i, row0, n_q, 0, BR, D, STRIDE, SWIZZLE,
                              tid, THREADS, ADDRESS_ONCE, DV)
        load_kv_tile(smem[KV_START:KV_START + KV_TILE], k_h, pages, first_col, n_k, tid)
        pipeline.commit()
        load_kv_tile(smem[KV_START + KV_TILE:KV_START + 2 * KV_TILE], v_h, pages, first_col, n_k,
                     tid)
        pipeline.commit()
        pipeline.wait_and_release(1)   # Q_i and K_j0 landed (V_j0 may still be in flight)
        q_frag = cuda.local.array(Q_FRAG, uint32)
        if Q_IN_REGISTERS:
            for m in range(M):
                tiles.load_a_fragments(q_frag, m, q_s, warp_row + 16 * m, lane, STRIDE, SWIZZLE)

        # Alg.1 l.5: O_i = 0, l_i = 0, m_i = -inf, on chip.
        o_acc = cuda.local.array(O_ACC, float32)
        tiles.fill(o_acc, float32(0))
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        if SINKS:   # the sink as a column already seen: m_i = s_h, l_i = 1
            softmax.init_rows_with_sink(m_i, l_i, sinks[h] / softmax_scale, lane)
        else:
            softmax.init_rows(m_i, l_i)
        s = cuda.local.array(S_ACC, float32)
        p = cuda.local.array(P_FRAG, uint32)

        for t in range(t0, t1):  # Alg.1 l.6: "for 1 <= j <= T_c"
            j, full = mods.step_block(listed, t, LISTED)
            col0 = j * BC
            kv0 = pipeline.slot_start(KV_START, t - t0, STAGES, 2 * KV_TILE)   # this step's K, V
            k_s = smem[kv0:kv0 + KV_TILE]
            v_s = smem[kv0 + KV_TILE:kv0 + 2 * KV_TILE]
            # l.7: K_j (two stages: and V_j) in SRAM; their copies were issued one step earlier.
            if STAGES == 2:
                # ... and every warp is done with step j-1's buffers: refill them with K_{j+1}
                # and V_{j+1} while this step computes.
                pipeline.wait_and_release(0)
                if t + 1 < t1:
                    nxt = pipeline.slot_start(KV_START, t + 1 - t0, STAGES, 2 * KV_TILE)
                    col1 = mods.step_block(listed, t + 1, LISTED)[0] * BC
                    load_kv_tile(smem[nxt:nxt + KV_TILE], k_h, pages, col1, n_k, tid)
                    load_kv_tile(smem[nxt + KV_TILE:nxt + 2 * KV_TILE], v_h, pages, col1, n_k,
                                 tid)
                pipeline.commit()
                if not PIPELINE:
                    pipeline.wait(0)
            else:
                pipeline.wait_and_release(1)   # K_j landed (V_j may still be in flight)
            # l.8: S_ij = Q_i K_j^T.
            tiles.fill(s, float32(0))
            tiles.gemm_abt_held_or_streamed(s, q_frag, Q_IN_REGISTERS, q_s, warp_row, D // 16, k_s,
                                            lane, STRIDE, SWIZZLE, ELEM)
            if SOFTCAP:
                softmax.softcap_scores(s, softcap)
            if ALIBI:
                tiles.add_alibi(s, row0 + warp_row + alibi_shift, col0, slope, lane)
            if MODS:   # the user's score_mod, then mask_mod (common/tile/mods.py)
                APPLY_MODS(s, s, row0 + warp_row, col0, n_q, n_k, int32(b), int32(h), aux,
                           softmax_scale, inv_scale, lane, full)
            if masks.block_is_partial(row0, BR, col0, BC, n_k, BANDED, lo, hi, WINDOW):
                tiles.mask_scores(s, row0 + warp_row, col0, n_k, BANDED, lo, hi, lane, WINDOW)
            if STAGES == 1:  # every warp is done with K_j: refill the tile with K_{j+1}
                refill_after_use(k_s, k_h, pages, t, t1, listed, n_k, tid)
            # l.9: m_ij = max(m_i, rowmax(S_ij)), P~_ij = exp(S_ij - m_ij), l_ij = e^(m_i - m_ij) l_i
            # + rowsum(P~_ij); and the first half of l.10, O_i <- diag(e^(m_i - m_ij)) O_i.
            softmax.online_softmax(s, m_i, l_i, o_acc, scale_log2, float32(0), 0)
            if DROPOUT:   # Alg.1 l.11 (FA2: dropout on P~ after l_ij took it whole): Z o P~_ij
                dropout.drop_rows(s, row0 + warp_row, col0, lane, bh, drop_cg, rng, float32(1))
            if P_IN_REGISTERS:
                tiles.accumulator_to_a(p, s, ELEM)
            else:  # the warp's own rows of the P tile: a warp barrier suffices
                tiles.stage_accumulator(p_s32, s, warp_row, lane, P_STRIDE, SWIZZLE, ELEM)
                ptx.syncwarp()
                for m in range(M):
                    tiles.load_a_fragments(p, m, p_s, warp_row + 16 * m, lane, P_STRIDE, SWIZZLE)
            # l.10, second half: O_i += P~_ij V_j, with V_j in SRAM.
            if STAGES == 1:
                pipeline.wait_and_release(1)   # V_j landed (K_{j+1} may still be in flight)
            tiles.gemm_ab(o_acc, p, v_s, lane, STRIDE, SWIZZLE, ELEM)
            if STAGES == 1:  # every warp is done with V_j: refill the tile with V_{j+1}
                refill_after_use(v_s, v_h, pages, t, t1, listed, n_k, tid)

        # l.12-13: O_i = diag(l_i)^-1 O_i and L_i = m_i + log(l_i), once.
        inv_l = cuda.local.array(ROWS, float32)
        lse_rows = cuda.local.array(ROWS, float32)
        softmax.finalize(m_i, l_i, inv_l, lse_rows, softmax_scale)
        if DROPOUT:   # ... and 1 / (1 - p) on the kept, with 1 / l
            dropout.scale_rows(inv_l, drop_scale)
        # l.14: write O_i to HBM, staged through the (now free) Q tile for 16-byte stores (every
        # copy waited for: a block that visits no K/V block, t1 <= t0, has its first V in flight).
        pipeline.wait_and_release(0)
        q_s32 = cuda.shared.array(0, uint32)[Q_START // 2:(Q_START + Q_TILE) // 2]
        tiles.scale_rows(o_acc, inv_l)
        tiles.stage_accumulator(q_s32, o_acc, warp_row, lane, STRIDE, SWIZZLE, ELEM)
        cuda.syncthreads()
        if VARLEN:
            o_i, lse_i = o[0, h, first_q:first_q + n_q], lse[0, h, first_q:first_q + n_q]
        else:
            o_i, lse_i = o[b, h], lse[b, h]
        tiles.store_tile(o_i, q_s32, row0, n_q, BR, D, STRIDE, SWIZZLE, tid, THREADS, DV)
        # l.15: write L_i (one lane of each quad holds its rows' statistics).
        if lane & 3 == 0:
            for r in range(2 * M):
                row = row0 + warp_row + 16 * (r >> 1) + (lane >> 2) + 8 * (r & 1)
                if row < n_q:
                    lse_i[row] = lse_rows[r]

    return fa2_forward


@replayed(3)
def forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=0,
            dropout_offset=0, score_mod=None, mask_mod=None, score_mod_grad=None, aux=None,
            block_mask=None, out=None, **options):
    """FA2 forward. q: (B, N_q, H, d), k, v: (B, N_k, H_kv, d) in flash_attn_func's layout, fp16 or
    bf16, on the GPU (CuPy, Numba or torch). Returns (o, lse) with o like q and lse (B, H, N_q) fp32.
    causal, window_size, softcap, align: the mask, as flash_attn_func (common/tile/masks.py);
    alibi_slopes ((H,) or (B, H) fp32) and sinks ((H,) fp32): the score terms of
    problem.with_score_terms; dropout_p, dropout_seed, dropout_offset: dropout on P, its mask
    drawn by Philox from the seed and offset (common/tile/dropout.py: the backward given the same
    three drops the same elements); score_mod, mask_mod (and the backward's score_mod_grad), aux:
    a user's functions of the scores compiled into the kernel, block_mask: mask_mod's BlockMask
    (variants.block_mask: only its kept K/V blocks are visited) (common/host/mods.py,
    docs/score_mods.md). options: see Config and OPTIONS."""
    prob = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out,
                   head_dims=HEAD_DIMS, variant="fa2", window_size=window_size, softcap=softcap,
                   align=align)
    with_dropout(prob, dropout_p, dropout_seed, dropout_offset)
    with_mods(prob, score_mod, mask_mod, score_mod_grad, aux, block_mask=block_mask)
    return _run(with_score_terms(prob, alibi_slopes, sinks, align), options)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, dropout_p=0.0,
                   dropout_seed=0, dropout_offset=0, score_mod=None, mask_mod=None,
                   score_mod_grad=None, aux=None, block_mask=None, block_table=None, out=None,
                   **options):
    """FA2 forward over a packed batch of sequences, as flash_attn_varlen_func: q (total_q, H, d),
    k, v (total_k, H_kv, d), sequence b being rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 (int32
    device arrays, batch + 1 entries). Returns o (total_q, H, d) and lse (H, total_q) fp32. The
    grid covers max_seqlen_q rows of every sequence; a block past its sequence's end returns at
    once, so a short sequence costs its own blocks only. block_table (batch, max_pages) int32: k, v
    are a paged cache (num_pages, page_size, H_kv, d), sequence b's cu_seqlens_k[b+1] -
    cu_seqlens_k[b] keys in its pages (a prefill against the cache a decode writes; forward only),
    page_size a power of two and a multiple of block_n."""
    if block_table is not None and (score_mod or mask_mod or block_mask is not None):
        raise ValueError("block_table with score_mod / mask_mod / block_mask: not supported "
                         "together (their positions are a packed batch's, not a paged cache's)")
    prob = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal=causal, softmax_scale=softmax_scale, out=out,
                          head_dims=HEAD_DIMS, variant="fa2", window_size=window_size,
                          softcap=softcap, align=align, block_table=block_table)
    with_dropout(prob, dropout_p, dropout_seed, dropout_offset)
    with_mods(prob, score_mod, mask_mod, score_mod_grad, aux, block_mask=block_mask)
    return _run(with_score_terms(prob, alibi_slopes, sinks, align), options)


def _run(prob, options):
    cfg = default_config(prob.head_dim, prob.element, prob.banded, configs.mask_fields(prob),
                         **options)
    seqs = prob.varlen
    rows = prob.n_q if seqs is None else seqs.max_q
    cu_q, cu_k = (seqs.cu_q, seqs.cu_k) if seqs is not None else \
        (arrays.placeholder(prob.library, 1, prob.like, "int32"),) * 2
    grid = ((rows + cfg.block_m - 1) // cfg.block_m, prob.batch, prob.heads)
    launch(build(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream,
           prob.q, prob.k, prob.v, prob.o32, prob.lse, np.int32(prob.n_q), np.int32(prob.n_k),
           np.int32(prob.kv_group), *prob.mask_args(), np.float32(prob.softmax_scale),
           np.float32(prob.softmax_scale * math.log2(math.e)), cu_q, cu_k, *prob.score_args(),
           *prob.dropout_args(), prob.aux, *_block_mask_args(prob, cfg), *_page_args(prob, cfg))
    return prob.result()


def _page_args(prob, cfg):
    """The kernel's paged-cache arguments: the block table and log2 page_size (a placeholder and
    0 without pages), after checking that a K/V tile of cfg lies within a page."""
    pages = prob.pages
    if pages is None:
        return arrays.placeholder(prob.library, 2, prob.like, "int32"), np.int32(0)
    if pages.page_size % cfg.block_n:
        raise ValueError(f"block_table: pages of {pages.page_size} keys, but fa2's K/V tiles hold "
                         f"block_n={cfg.block_n}: pages must hold a multiple of block_n keys")
    return pages.table, np.int32(pages.page_size.bit_length() - 1)


def _block_mask_args(prob, cfg):
    """The kernel's block-mask arguments: the BlockMask's lists for cfg's blocks, and whether
    they vary by batch and head; placeholders (one list of nothing, never read) without one."""
    if prob.block_mask is None:
        return no_block_mask(prob)
    return prob.block_mask.args(cfg.block_m, cfg.block_n, prob.stream)


# The head dims the compile report covers: FA2's two, and one of each other layout (padded rows
# with row-major copies, 96; eight warps of one m16 tile, swizzled, 256).
REPORTED_HEAD_DIMS = (64, 128, 96, 256)


def compile_targets():
    """(name, kernel, argument types, mma count in its PTX) of every configuration `forward`
    launches by default in bf16 (fp16: d=64 non-causal; the GPU tests compile and run them all)."""
    argtypes = (QKV_TYPE, QKV_TYPE, QKV_TYPE, OUT_TYPE, LSE_TYPE, types.int32, types.int32,
                types.int32) + MASK_TYPES + (types.float32, types.float32, SEQS_TYPE, SEQS_TYPE) + \
        SCORE_TYPES + DROPOUT_TYPES + MOD_TYPES + BLOCK_MASK_TYPES + PAGE_TYPES
    for head_dim in REPORTED_HEAD_DIMS:
        for element in (BFLOAT16, FLOAT16):
            for causal in (False, True):
                if head_dim not in (64, 128) and (causal or element != BFLOAT16):
                    continue   # the other head dims' layouts and warp counts: non-causal bf16
                if element != BFLOAT16 and (causal or head_dim != 64):
                    continue   # fp16 changes only the mma and cvt opcodes: one configuration
                cfg = default_config(head_dim, element, causal)
                # Q K^T and P V: m_tiles * (d/16 * B_c/8 + B_c/16 * d/8) mma.m16n8k16 a step
                mma = cfg.m_tiles * head_dim * cfg.block_n // 64
                yield f"fa2 d={head_dim} {element.tag} causal={causal}", \
                    build(cfg), argtypes, mma
    # the score terms (ALiBi and sinks) at d=128, causal
    cfg = default_config(128, BFLOAT16, True, (("alibi", True), ("sinks", True)))
    yield "fa2 d=128 bf16 causal=True alibi sinks", build(cfg), argtypes, \
        cfg.m_tiles * 128 * cfg.block_n // 64
    # dropout (Philox in the loop) at d=128: the forward's registers are its budget
    cfg = default_config(128, BFLOAT16, False, (("dropout", True),))
    yield "fa2 d=128 bf16 causal=False dropout", build(cfg), argtypes, \
        cfg.m_tiles * 128 * cfg.block_n // 64
    # a packed batch's prefill against a paged cache (block_table), causal at d=128
    cfg = default_config(128, BFLOAT16, True, (("varlen", True), ("bottom_right", True),
                                               ("paged", True)))
    yield "fa2 paged varlen d=128 bf16 causal=True", build(cfg), argtypes, \
        cfg.m_tiles * 128 * cfg.block_n // 64
    # a user's score_mod and mask_mod (ALiBi, a document mask: common/tile/mods.py) at d=128
    from variants import score_mods
    example, aux_types = score_mods.compile_example()
    cfg = default_config(128, BFLOAT16, False, (("mods", example),))
    before_aux = argtypes[:-len(BLOCK_MASK_TYPES) - len(PAGE_TYPES) - 1]
    yield "fa2 d=128 bf16 causal=False score_mod mask_mod", build(cfg), \
        before_aux + aux_types + BLOCK_MASK_TYPES + PAGE_TYPES, \
        cfg.m_tiles * 128 * cfg.block_n // 64
    yield from fa2_backward.compile_targets()   # Algorithm 2's kernels
