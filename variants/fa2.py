"""FlashAttention-2 forward (Dao 2023, Algorithm 1) on the tile layer of `common/`.

What makes it FA2 rather than FA1:
- the outer loop over query blocks i is the grid (one thread block per (i, batch, head)), the inner
  loop over K/V blocks j runs inside the block, so O_i, l_i, m_i never leave the chip;
- O_i stays un-normalised and is divided by l_i once, at the end (l.12); only L = m + log l is saved;
- the warps split Q_i (split-Q): warp w owns rows [16*M*w, 16*M*(w+1)) of the block and needs no
  other warp's results, so there is no inter-warp reduction;
- causal: blocks j entirely above the diagonal are never visited; only blocks that cross the diagonal
  (or the ragged end) are masked.

Hardware mapping: S and O are mma.m16n8k16 accumulators in registers; P~ goes from the S
accumulator straight into the A operand of the P V mma (never through shared memory); K_j and V_j
arrive by cp.async into one shared tile each, the copy of K_{j+1} overlapping softmax and P V, the
copy of V_{j+1} overlapping the next Q K^T (FA2's schedule; `pipeline=False` waits for every copy).
"""
import math
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint32, uint16

from common import ptx, softmax, tiles
from common.problem import LSE_TYPE, OUT_TYPE, QKV_TYPE, prepare
from common.target import kernel, launch

HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class Config:
    """Compile-time shape of the kernel. block_m = B_r, block_n = B_c of the paper."""
    head_dim: int
    is_bf16: bool
    causal: bool
    block_m: int = 64       # B_r: query rows a thread block owns
    block_n: int = 64       # B_c: keys per inner step
    warps: int = 4          # split-Q: each warp owns block_m / warps query rows
    pipeline: bool = True   # overlap the K/V copies with compute (cp.async groups)
    swizzle: bool = True    # XOR-swizzled shared tiles (False: padded rows)

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def m_tiles(self):  # m16 tiles per warp
        return self.block_m // (16 * self.warps)

    def smem_bytes(self):
        d = tiles.tile_row_stride(self.head_dim, self.swizzle)
        return 2 * d * (self.block_m + 2 * self.block_n)

    def validate(self):
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"fa2 supports head_dim in {HEAD_DIMS}, got {self.head_dim}")
        if self.block_m % (16 * self.warps):
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16 * warps={16 * self.warps}")
        if self.block_n % 16:
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16")
        for rows in (self.block_m, self.block_n):
            tiles.check_tile_copy(rows, self.head_dim, self.threads)
        return self


OPTIONS = ("block_m", "block_n", "warps", "pipeline", "swizzle")

# Default tiles by head_dim, chosen by `python experiments/run.py -m experiment=fa2_tiles` on an H200
# (docs/performance.md): at d=64 two m16 tiles per warp (B_r = 128) reuse every K/V fragment loaded
# from shared memory twice, 320 vs 262 TFLOP/s; at d=128 the same doubling needs ~2x the registers of
# the O accumulator and loses (287 vs 300), so B_r = 64 with one m16 tile per warp.
DEFAULT_TILES = {64: dict(block_m=128, block_n=64), 128: dict(block_m=64, block_n=64)}


def default_config(head_dim, is_bf16, causal, **options):
    """The tile shape used unless options override it."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"fa2 has no option {', '.join(sorted(unknown))}; its options: {', '.join(OPTIONS)}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"fa2 supports head_dim in {HEAD_DIMS}, got {head_dim}")
    chosen = dict(DEFAULT_TILES[head_dim], **{k: v for k, v in options.items() if v is not None})
    return replace(Config(head_dim, is_bf16, causal), **chosen).validate()


@lru_cache(maxsize=None)
def build(cfg):
    """Compile-time constants of one configuration, closed over by its kernel."""
    D, BR, BC, THREADS = cfg.head_dim, cfg.block_m, cfg.block_n, cfg.threads
    M = cfg.m_tiles
    IS_BF16, CAUSAL, PIPELINE, SWIZZLE = cfg.is_bf16, cfg.causal, cfg.pipeline, cfg.swizzle
    STRIDE = tiles.tile_row_stride(D, SWIZZLE)
    Q_TILE, KV_TILE = BR * STRIDE, BC * STRIDE
    # Register arrays need literal shapes: A fragments of Q (k-steps of 16 over d), the S and O
    # accumulators (n-tiles of 8), P~ as A fragments (k-steps of 16 over B_c), 2 rows a lane per m-tile.
    Q_FRAG, S_ACC, O_ACC, P_FRAG = (M, D // 16, 4), (M, BC // 8, 4), (M, D // 8, 4), (M, BC // 16, 4)
    ROWS = 2 * M

    @kernel
    def fa2_forward(q, k, v, o, lse, n_q, n_k, kv_group, softmax_scale, scale_log2):
        """q, k, v: (B, H, N, d) uint16 views; o: (B, H, N_q, d/2) uint32 view; lse: (B, H, N_q)."""
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        # Alg.1 l.3: "for 1 <= i <= T_r" is the grid; with causal masking the blocks with the most
        # K/V blocks to visit are started first.
        i = cuda.gridDim.x - 1 - cuda.blockIdx.x if CAUSAL else cuda.blockIdx.x
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        q_i, k_h, v_h = q[b, h], k[b, h // kv_group], v[b, h // kv_group]
        row0 = i * BR                       # first query row of Q_i
        warp_row = warp * 16 * M            # first row of this warp's part of Q_i (split-Q)

        smem = cuda.shared.array(0, uint16)
        q_s = smem[0:Q_TILE]
        k_s = smem[Q_TILE:Q_TILE + KV_TILE]
        v_s = smem[Q_TILE + KV_TILE:Q_TILE + 2 * KV_TILE]

        # Causal: K/V blocks past the diagonal of the last row of Q_i are never visited.
        t_c = (n_k + BC - 1) // BC
        if CAUSAL:
            t_c = min(t_c, (row0 + BR - 1) // BC + 1)

        # Alg.1 l.4: load Q_i (and, ahead of the loop, K_1 and V_1) from HBM to SRAM.
        tiles.load_tile_async(q_s, q_i, row0, n_q, 0, BR, D, STRIDE, SWIZZLE, tid, THREADS)
        tiles.load_tile_async(k_s, k_h, 0, n_k, 0, BC, D, STRIDE, SWIZZLE, tid, THREADS)
        ptx.cp_async_commit()
        tiles.load_tile_async(v_s, v_h, 0, n_k, 0, BC, D, STRIDE, SWIZZLE, tid, THREADS)
        ptx.cp_async_commit()
        ptx.cp_async_wait(1)
        cuda.syncthreads()
        q_frag = cuda.local.array(Q_FRAG, uint32)
        for m in range(M):
            tiles.load_a_fragments(q_frag, m, q_s, warp_row + 16 * m, lane, STRIDE, SWIZZLE)

        # Alg.1 l.5: O_i = 0, l_i = 0, m_i = -inf, on chip.
        o_acc = cuda.local.array(O_ACC, float32)
        tiles.fill(o_acc, float32(0))
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        softmax.init_rows(m_i, l_i)
        s = cuda.local.array(S_ACC, float32)
        p = cuda.local.array(P_FRAG, uint32)

        for j in range(t_c):  # Alg.1 l.6
            # l.7: K_j is in SRAM (its copy was issued one step earlier).
            ptx.cp_async_wait(1)
            cuda.syncthreads()
            # l.8: S_ij = Q_i K_j^T.
            tiles.fill(s, float32(0))
            tiles.gemm_abt(s, q_frag, k_s, lane, STRIDE, SWIZZLE, IS_BF16)
            col0 = j * BC
            if col0 + BC > n_k or (CAUSAL and col0 + BC - 1 > row0):
                tiles.mask_scores(s, row0 + warp_row, col0, n_k, CAUSAL, lane)
            cuda.syncthreads()  # every warp is done with K_j: refill the tile with K_{j+1}
            if j + 1 < t_c:
                tiles.load_tile_async(k_s, k_h, col0 + BC, n_k, 0, BC, D, STRIDE, SWIZZLE, tid, THREADS)
            ptx.cp_async_commit()
            if not PIPELINE:
                ptx.cp_async_wait(0)
            # l.9: m_ij = max(m_i, rowmax(S_ij)), P~_ij = exp(S_ij - m_ij), l_ij = e^(m_i - m_ij) l_i
            # + rowsum(P~_ij); and the first half of l.10, O_i <- diag(e^(m_i - m_ij)) O_i.
            softmax.online_softmax(s, m_i, l_i, o_acc, scale_log2)
            tiles.accumulator_to_a(p, s, IS_BF16)
            # l.10, second half: O_i += P~_ij V_j, with V_j now in SRAM.
            ptx.cp_async_wait(1)
            cuda.syncthreads()
            tiles.gemm_ab(o_acc, p, v_s, lane, STRIDE, SWIZZLE, IS_BF16)
            cuda.syncthreads()  # every warp is done with V_j: refill the tile with V_{j+1}
            if j + 1 < t_c:
                tiles.load_tile_async(v_s, v_h, col0 + BC, n_k, 0, BC, D, STRIDE, SWIZZLE, tid, THREADS)
            ptx.cp_async_commit()
            if not PIPELINE:
                ptx.cp_async_wait(0)

        # l.12-13: O_i = diag(l_i)^-1 O_i and L_i = m_i + log(l_i), once.
        inv_l = cuda.local.array(ROWS, float32)
        lse_rows = cuda.local.array(ROWS, float32)
        softmax.finalize(m_i, l_i, inv_l, lse_rows, softmax_scale)
        # l.14: write O_i to HBM, staged through the (now free) Q tile for 16-byte stores.
        q_s32 = cuda.shared.array(0, uint32)[0:Q_TILE // 2]
        tiles.stage_accumulator(q_s32, o_acc, inv_l, warp_row, lane, STRIDE, SWIZZLE, IS_BF16)
        cuda.syncthreads()
        tiles.store_tile(o[b, h], q_s32, row0, n_q, BR, D, STRIDE, SWIZZLE, tid, THREADS)
        # l.15: write L_i (one lane of each quad holds its rows' statistics).
        if lane & 3 == 0:
            for r in range(2 * M):
                row = row0 + warp_row + 16 * (r >> 1) + (lane >> 2) + 8 * (r & 1)
                if row < n_q:
                    lse[b, h, row] = lse_rows[r]

    return fa2_forward


def forward(q, k, v, *, causal=False, softmax_scale=None, out=None, **options):
    """FA2 forward. q: (B, N_q, H, d), k, v: (B, N_k, H_kv, d) in flash_attn_func's layout, fp16 or
    bf16, on the GPU (CuPy, Numba or torch). Returns (o, lse) with o like q and lse (B, H, N_q) fp32.
    options: block_m, block_n, warps, pipeline, swizzle (see Config)."""
    prob = prepare(q, k, v, causal=causal, softmax_scale=softmax_scale, out=out,
                   head_dims=HEAD_DIMS, variant="fa2")
    cfg = default_config(prob.head_dim, prob.is_bf16, causal, **options)
    grid = ((prob.n_q + cfg.block_m - 1) // cfg.block_m, prob.batch, prob.heads)
    launch(build(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream,
           prob.q, prob.k, prob.v, prob.o32, prob.lse, np.int32(prob.n_q), np.int32(prob.n_k),
           np.int32(prob.kv_group), np.float32(prob.softmax_scale),
           np.float32(prob.softmax_scale * math.log2(math.e)))
    return prob.result()


def compile_targets():
    """(name, kernel, argument types, mma count in its PTX) of every configuration `forward`
    launches by default."""
    argtypes = (QKV_TYPE, QKV_TYPE, QKV_TYPE, OUT_TYPE, LSE_TYPE, types.int32, types.int32,
                types.int32, types.float32, types.float32)
    for head_dim in HEAD_DIMS:
        for is_bf16 in (True, False):
            for causal in (False, True):
                cfg = default_config(head_dim, is_bf16, causal)
                # Q K^T and P V: m_tiles * (d/16 * B_c/8 + B_c/16 * d/8) mma.m16n8k16 a step
                mma = cfg.m_tiles * head_dim * cfg.block_n // 64
                yield f"fa2 d={head_dim} {'bf16' if is_bf16 else 'fp16'} causal={causal}", \
                    build(cfg), argtypes, mma
