"""FlashAttention-2 backward (Dao 2023, Algorithm 2) on the tile layer of `common/`: dQ, dK, dV from
Q, K, V, O, L and dO without an N x N matrix in HBM. The backward of fa2 and of fa3 (from their o and
lse), and, with `kv_blocks="sequential"`, of fa1 (Algorithm 4's schedule: variants/fa1.py).
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import ptx
from common.hardware.elements import BFLOAT16, Element
from common.hardware.target import MAX_SHARED_BYTES, device_function, kernel
from common.host import arrays, configs
from common.host.launching import launch
from common.host.mods import no_block_mask, with_mods
from common.host.problem import (
    BLOCK_MASK_TYPES,
    LSE_TYPE,
    MASK_TYPES,
    MOD_TYPES,
    OUT_TYPE,
    QKV_TYPE,
    DROPOUT_TYPES,
    SCORE_TYPES,
    SEQS_TYPE,
    with_dropout,
    with_score_terms,
)
from common.host.replay import replayed
from common.tile import dropout, masks, mods, pipeline, softmax, tiles
from common.tile.smem import SharedLayout
from variants import backward_shared as bwd

HEAD_DIMS = tiles.HEAD_DIMS

# FA2 Algorithm 2: given Q, K, V, O, L and dO, return dQ, dK, dV without ever storing an N x N
# matrix; P is recomputed from Q, K and L (recomputation, FlashAttention's fourth technique).
#
#   l.4   D = rowsum(dO o O)                                   (variants/backward_shared.py: preprocess)
#   l.5   for 1 <= j <= T_c  (the grid: one thread block per K/V block j, batch, K/V head)
#   l.6     load K_j, V_j to SRAM;  l.7  dK_j = 0, dV_j = 0 on chip
#   l.8     for 1 <= i <= T_r  (causal or a window: only blocks i whose band reaches block j)
#   l.9       load Q_i, dO_i, L_i, D_i to SRAM
#   l.10      S_i^(j) = Q_i K_j^T;  l.11  P_i^(j) = exp(S_ij - L_i)
#   l.12      dV_j += (P_i^(j))^T dO_i
#   l.13      dP_i^(j) = dO_i V_j^T;  l.14  dS_i^(j) = P_i^(j) o (dP_i^(j) - D_i)
#   l.15      dQ_i += dS_i^(j) K_j   (read-modify-write in HBM: fp32 atomics here, `dq="atomic"`)
#   l.16      dK_j += (dS_i^(j))^T Q_i
#   l.17    write dK_j, dV_j to HBM
#
# The kernel computes S^T = K_j Q_i^T and dP^T = V_j dO_i^T (keys x queries). Its warps tile them
# in one of two ways (`query_warps`):
# - 1: warp w owns keys [16*M*w, 16*M*(w+1)) of K_j, their whole rows of S^T, dP^T and of dK_j,
#   dV_j, so the accumulators re-pack straight into the A operands of dV_j += P^T dO_i and
#   dK_j += dS^T Q_i, all in the warp's registers; but every warp reads all of Q_i and dO_i twice.
# - 2 (FA2's 2-D warp tiles, the default): warps 2p and 2p+1 share keys [32p, 32p+32) (M = 2);
#   each computes half of the pair's queries of S^T, dP^T, writes P^T and dS^T to shared memory,
#   meets its partner at a named barrier, and accumulates half of d of dK_j, dV_j from the pair's
#   whole rows: each B fragment read from shared memory feeds two m16 tiles (152 ldmatrix.x4 a
#   warp-step at d=128 against 184).
# dQ_i += dS K_j needs every warp's keys: dS^T is staged in shared memory and read back transposed
# (ldmatrix.trans) one step later, after the barrier that step needs anyway (two dS^T buffers), so
# the product costs no barrier.
# The product's terms reach HBM either as 16 red.global.add.v2.f32 a thread (`dq_reduce="red"`), or
# (`"bulk"`, the default) stored by each warp to its own fp32 shared buffer in fragment order and
# added by one bulk reduction of the copy engine (cp.reduce.async.bulk .add.f32, sm_90) that the
# warp's lane 0 issues at once (it waits for the reduction's read a step later, before the warp
# stages again: no barrier involved); dQ's accumulator then holds each query block contiguous in
# that order and `convert_dq` unpermutes it.
# `dq="separate"` instead leaves dQ to a second kernel with the query blocks outer (one thread block
# per Q_i, looping over K/V blocks, as the forward): deterministic, at the price of recomputing S
# and dP once more.

@dataclass(frozen=True)
class BackwardConfig:
    """Compile-time shape of the backward kernels. block_n = B_c (keys a thread block owns),
    block_m = B_r (queries per inner step)."""
    head_dim: int
    element: Element           # the 16-bit type of the inputs and gradients (common/hardware/elements.py)
    causal: bool               # a band mask (causal and/or sliding window, common/tile/masks.py)
    window: bool = False       # the band has a left edge (sliding window): its test compiled in
    softcap: bool = False      # scores soft-capped (Gemma 2): dS times 1 - tanh^2
    alibi: bool = False        # ALiBi's bias in the recomputed S (no term in dS)
    dropout: bool = False      # dropout on P: the forward's mask regenerated (common/tile/dropout.py)
    mods: object = None        # score_mod / mask_mod and score_mod_grad (common/host/mods.py)
    block_mask: bool = False   # visit only the blocks a BlockMask lists (common/tile/mods.py)
    block_m: int = 64          # B_r
    block_n: int = 128         # B_c
    warps: int = 8             # each warp owns block_n / (warps / query_warps) keys
    query_warps: int = 1       # warps sharing a key's row of S^T, dP^T (each a 1/query_warps
                               # slice of B_r, and of d in dK_j, dV_j): 1 = every product in the
                               # warp's own registers; 2 = FA2's 2-D warp tiles, P^T and dS^T
                               # through shared memory (fewer ldmatrix a step)
    dq: str = "atomic"         # "atomic" | "separate" (a second, query-block-outer kernel,
                               # deterministic)
    dq_query_warps: int = 0    # dq="atomic": warps across B_r in the dQ product (the others across
                               # d); 0: FA2's split, two m16 tiles of queries a warp where the
                               # warps allow (min(warps, B_r / 32), at least 1)
    dq_reduce: str = "bulk"    # dq="atomic": how dS K_j is added into dQ's fp32 accumulator:
                               # "bulk": staged in shared memory, one bulk reduction by the copy
                               # engine a step (sm_90); "red": red.global.add.v2.f32 from registers
    causal_skip: bool = True   # banded: never visit query blocks outside the band
    swizzle: bool = True
    kv_in_registers: bool = False   # K_j, V_j A fragments held in registers through the i loop
    dq_block_m: int = 64       # the separate dQ kernel: queries a thread block owns,
    dq_block_n: int = 64       # keys per inner step,
    dq_warps: int = 4          # and warps (split-Q, as the forward)
    kv_blocks: str = "parallel"     # "parallel": a thread block per K/V block (FA2) | "sequential":
                                    # one per (batch, K/V head) walking them all (FA1 Alg. 4)
    varlen: bool = False       # a packed batch of sequences (backward_varlen): bounds per block
    bottom_right: bool = True  # varlen: the band's diagonal at each sequence's bottom-right

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def key_warps(self):    # warps across B_c
        return self.warps // self.query_warps

    @property
    def m_tiles(self):      # m16 tiles of keys per warp
        return self.block_n // (16 * self.key_warps)

    @property
    def tile_dim(self):     # columns of the Q, K, V, dO tiles: head_dim zero-padded to whole k16
        return tiles.tile_columns(self.head_dim)

    @property
    def staged_ds(self):    # dS^T goes through shared memory (dQ's product, or 2-D warp tiles)
        return self.dq == "atomic" or self.query_warps > 1

    @property
    def dq_split(self):
        """(WQ, WD): the warps' grid over dQ_i (B_r x d) in the fused dQ product."""
        wq = self.dq_query_warps or max(1, min(self.warps, self.block_m // 32))
        return wq, self.warps // wq

    @property
    def bulk(self):
        return self.dq == "atomic" and self.dq_reduce == "bulk"

    @configs.once_per_config
    def smem_layout(self):
        """The K/V kernel's shared memory: K_j | V_j | 2 x (Q_i | dO_i) | 2 x dS^T | P^T (2-D warp
        tiles) in 16-bit tiles, then fp32: 2 x (L_i log2 e, D_i) | dQ_i's terms (bulk
        reductions: B_r x d, a slice a warp, in fragment order)."""
        kv = self.block_n * tiles.tile_row_stride(self.tile_dim, self.swizzle)
        qo = self.block_m * tiles.tile_row_stride(self.tile_dim, self.swizzle)
        ds = self.block_n * tiles.tile_row_stride(self.block_m, self.swizzle) \
            if self.staged_ds else 0
        return SharedLayout(("k", kv, 2), ("v", kv, 2), ("q_do", 4 * qo, 2), ("ds", 2 * ds, 2),
                            ("p", ds if self.query_warps > 1 else 0, 2),
                            ("stats", 4 * self.block_m, 4),
                            ("dq", self.block_m * self.tile_dim if self.bulk else 0, 4))

    def smem_bytes(self):
        return self.smem_layout().bytes

    @configs.once_per_config
    def dq_layout(self):
        """Where the fused dQ product's terms go in dQ's accumulator: fragment order when added
        by bulk reductions (a query block's B_r x d floats contiguous), else row-major (None)."""
        if not self.bulk:
            return None
        return bwd.DqLayout(rows=self.block_m, cols=self.tile_dim, threads=self.threads,
                            warps_across=self.dq_split[1])

    @configs.once_per_config
    def dq_smem_layout(self):
        """The separate dQ kernel's: Q_i | dO_i | 2 x (K_j, V_j), 16-bit tiles."""
        d = tiles.tile_row_stride(self.tile_dim, self.swizzle)
        return SharedLayout(("q", self.dq_block_m * d, 2), ("do", self.dq_block_m * d, 2),
                            ("kv", 4 * self.dq_block_n * d, 2))

    def dq_smem_bytes(self):
        return self.dq_smem_layout().bytes

    def validate(self):
        tiles.check_head_dim(self.head_dim, "fa2")
        if self.dq not in ("atomic", "separate"):
            raise ValueError(f"dq must be 'atomic' or 'separate', got {self.dq!r}")
        if self.dq_reduce not in ("bulk", "red"):
            raise ValueError(f"dq_reduce must be 'bulk' or 'red', got {self.dq_reduce!r}")
        if self.kv_blocks not in ("parallel", "sequential"):
            raise ValueError(f"kv_blocks must be 'parallel' or 'sequential', got {self.kv_blocks!r}")
        if self.varlen and self.bulk:
            raise ValueError("a packed batch (varlen) adds dQ by dq_reduce='red' or computes it "
                             "with dq='separate': dq_reduce='bulk' stages it in per-query-block "
                             "fragment order, which a packed batch has not yet")
        if self.kv_blocks == "sequential" and self.dq != "atomic":
            raise ValueError("kv_blocks='sequential' (FA1's schedule) accumulates dQ in its own "
                             "kernel: it needs dq='atomic'")
        if self.query_warps not in (1, 2, 4) or self.warps % self.query_warps:
            raise ValueError(f"query_warps must be 1, 2 or 4 and divide warps={self.warps}, got "
                             f"{self.query_warps}")
        if self.block_n % (16 * self.key_warps):
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16 * (warps / "
                             f"query_warps)={16 * self.key_warps}")
        if self.block_m % (16 * self.query_warps):
            raise ValueError(f"block_m={self.block_m} must be a multiple of 16 * query_warps="
                             f"{16 * self.query_warps}")
        if self.query_warps > 1:
            # A warp's slices of B_r (its S^T columns) and of d (its dK_j, dV_j columns): whole
            # pairs of n8 tiles; in a swizzled tile they start at multiples of their own width, so
            # that their n8 tiles are XOR steps.
            slices = (self.block_m // self.query_warps, self.tile_dim // self.query_warps)
            if self.block_m % self.query_warps or self.tile_dim % self.query_warps or \
                    not _column_slice(slices[0], self.swizzle, 16) or \
                    not _column_slice(slices[1], self.swizzle):
                raise ValueError(f"query_warps={self.query_warps} needs block_m / query_warps and "
                                 f"head_dim / query_warps to be {_SLICES[self.swizzle]}, got "
                                 f"{slices}")
        if self.dropout and (self.m_tiles % 2 or self.block_n % 32 or
                             (self.dq == "separate" and self.dq_block_n % 32)):
            raise ValueError(f"dropout needs an even number of m16 tiles of keys a warp (block_n / "
                             f"(16 * warps / query_warps) = {self.m_tiles}) and block_n, "
                             f"dq_block_n multiples of 32 (a Philox call's 32 keys)")
        if self.staged_ds:
            tiles.tile_row_stride(self.block_m, self.swizzle)   # the dS^T (and P^T) tiles
        for rows in (self.block_m, self.block_n):
            tiles.check_tile_copy(rows, self.tile_dim, self.threads)
        if self.smem_bytes() > MAX_SHARED_BYTES:
            raise ValueError(
                f"fa2 backward (dq={self.dq!r}, dq_reduce={self.dq_reduce!r}, query_warps="
                f"{self.query_warps}) with block_m={self.block_m}, block_n={self.block_n} at "
                f"head_dim {self.head_dim} needs {self.smem_bytes()} bytes of shared memory, over "
                f"the {MAX_SHARED_BYTES} a thread block may have" +
                (" (dq_reduce='red' needs less)" if self.bulk else ""))
        if self.dq == "atomic":
            wq, wd = self.dq_split
            cols = self.tile_dim // max(wd, 1)
            if wq < 1 or wq * wd != self.warps or (self.block_m // 16) % wq or \
                    self.tile_dim % wd or not _column_slice(cols, self.swizzle):
                raise ValueError(f"{self.warps} warps do not split a {self.block_m}x{self.tile_dim} "
                                 f"dQ block ({wq} across its rows) into whole m16 tiles and column "
                                 f"slices of {_SLICES[self.swizzle]}")
        else:
            if self.dq_block_m % (16 * self.dq_warps) or self.dq_block_n % 16:
                raise ValueError(f"dq_block_m={self.dq_block_m} must be a multiple of 16 * "
                                 f"dq_warps={16 * self.dq_warps}, dq_block_n of 16")
            for rows in (self.dq_block_m, self.dq_block_n):
                tiles.check_tile_copy(rows, self.tile_dim, 32 * self.dq_warps)
        return self


_SLICES = {True: "powers of two >= 16", False: "multiples of 16 (of d: of 8)"}


def _column_slice(width, swizzle, unit=8):
    """Whether a warp's slice of `width` tile columns is whole n8 tiles of the products it takes
    part in (`unit`: 16 for S^T's queries, taken in pairs by tiles.gemm_abt; 8 for d's columns,
    where tiles.gemm_ab takes an odd last one), and, in a swizzled tile, a power of two >= 16 (its
    n8 steps are XORs: tiles.column_step)."""
    if swizzle:
        return width >= 16 and width & (width - 1) == 0
    return width >= unit and width % unit == 0


BACKWARD_OPTIONS = configs.options_of(BackwardConfig)

# FA2's own tiles (Flash_bwd_kernel_traits for sm80): B_c = 128 keys over 8 warps in 2-D warp tiles
# (query_warps=2: dK_j and dV_j take 2 * d/2 registers a thread), B_r = 64 queries a step at d=128
# and 128 at d=64, and the dQ product's warps 2 x 4 at d=128 (32 x 32 of dQ_i each), 4 x 2 at d=64
# (dq_query_warps=0: B_r / 32 warps across B_r). Measured on an H100
# (docs/results/bwd_breakdown_h100.txt, backward call, session 9): the 2-D tiles 5-6% faster than
# one row of S^T a warp at d=128, 1-4% at d=64 (2k-8k); FA2's dQ split another 2-6% (3-4% at 8k;
# level at d=64 2k causal). dQ: since the reductions are issued after the next step's copies,
# the atomics are faster at both head dims (backward call alone on an H100, seqlen 8k non-causal,
# docs/results/bwd_breakdown_h100.txt: 9.95 vs 10.67 ms at d=64, 10.06 vs 11.50 ms at d=128;
# causal 2k: 1.62 vs 1.71 and 1.62 vs 1.70). Not bitwise reproducible: pass dq="separate" for that.
# The separate dQ kernel at d=64 takes two m16 tiles of queries a warp (B_r = 128 over 4 warps), so
# each K and V fragment feeds two MMAs: 64 ldmatrix for 192 MMAs a step instead of 56 for 96.
BACKWARD_DEFAULTS = {64: dict(block_m=128, query_warps=2, dq="atomic", dq_block_m=128),
                     128: dict(dq="atomic", query_warps=2)}


def _backward_defaults(d):
    """Defaults at head dims other than 64 and 128: not yet tuned by measurement, but FA2's
    arrangement where it fits. The tiles of the nearer of 64 and 128 (past 128: B_c = B_r = 64, so
    that a warp's dK_j, dV_j slices stay at d / 2 registers a thread, as FA2's kernels at d = 256,
    with the 8 warps 4 across B_r where d / 4 is whole n8 tiles, else 2: measured below); padded
    rows where the swizzle does not fit (2-D warp tiles of d / 2 or d / 4 columns then need only
    whole n8 tiles); then the first dQ split over the warps, and the first dQ path, that fits
    (bulk reduction, then red.global.add, then the separate kernel). A head_dim that is not a
    multiple of 16 takes the tiles of the next one (tiles.tile_columns)."""
    t = tiles.tile_columns(d)
    base = dict(BACKWARD_DEFAULTS[64] if t <= 64 else BACKWARD_DEFAULTS[128] if t <= 128 else
                dict(block_m=64, block_n=64, query_warps=4, dq="atomic"))
    if not tiles.swizzle_fits(t):
        base["swizzle"] = False
    # past 128, 4 warps across B_r (each a d/4 slice of dK_j, dV_j: 64 registers each at d=256)
    # where the slices are whole n8 tiles, else 2: at d=256 query_warps=4 measured 4-6% faster
    # than 2 (H100, 2k-8k, causal or not: docs/results/head_dims_h100_20261126b.txt)
    for query_warps in ((4, 2) if t > 128 else (base["query_warps"],) if "query_warps" in base
                        else (1,)):
        for path in (dict(), dict(dq_reduce="red"), dict(dq="separate")):
            for wq in (0, 1, 2, 4, 8):
                candidate = dict(base, query_warps=query_warps, dq_query_warps=wq, **path)
                try:
                    BackwardConfig(d, BFLOAT16, False, **candidate).validate()
                    return candidate
                except ValueError:
                    continue
    raise ValueError(f"fa2 backward: no default configuration fits head_dim {d}")


BACKWARD_DEFAULTS.update({d: _backward_defaults(d) for d in HEAD_DIMS
                          if d not in BACKWARD_DEFAULTS})

default_backward_config = configs.default_config_function(
    "fa2 backward", BackwardConfig, BACKWARD_DEFAULTS, BACKWARD_OPTIONS, HEAD_DIMS)


@lru_cache(maxsize=None)
def build_backward(cfg):
    """The K/V-block-outer kernel of Algorithm 2 (dK, dV, and with dq="atomic" dQ)."""
    D, BR, BC, THREADS = cfg.tile_dim, cfg.block_m, cfg.block_n, cfg.threads
    DV = cfg.head_dim     # columns in HBM (D: the tiles', zero-padded to whole k16 steps)
    M = cfg.m_tiles
    ELEM, BANDED, SWIZZLE, SOFTCAP = cfg.element.code, cfg.causal, cfg.swizzle, cfg.softcap
    SKIP, WINDOW = cfg.causal and cfg.causal_skip, cfg.window
    ATOMIC, KV_IN_REGISTERS = cfg.dq == "atomic", cfg.kv_in_registers
    BULK = cfg.bulk
    SEQUENTIAL = cfg.kv_blocks == "sequential"
    VARLEN, SHIFT = cfg.varlen, cfg.varlen and cfg.bottom_right
    ALIBI, DROPOUT = cfg.alibi, cfg.dropout
    STRIDE = tiles.tile_row_stride(D, SWIZZLE)
    QW, TWO_D, STAGED_DS = cfg.query_warps, cfg.query_warps > 1, cfg.staged_ds
    QC, DC = BR // QW, D // QW      # a warp's queries of S^T, dP^T and columns of dK_j, dV_j
    QW_SHIFT = QW.bit_length() - 1
    DS_STRIDE = tiles.tile_row_stride(BR, SWIZZLE) if STAGED_DS else 0
    KV_TILE, QO_TILE, DS_TILE = BC * STRIDE, BR * STRIDE, BC * DS_STRIDE
    LAYOUT = cfg.smem_layout()   # region starts: 16-bit elements, the fp32 ones in floats
    K0, V0, QO0, DS0, P0 = (LAYOUT.start(r) for r in ("k", "v", "q_do", "ds", "p"))
    STAT0, DQF0 = LAYOUT.start("stats"), LAYOUT.start("dq")
    DQF_WARP = BR * D // cfg.warps          # floats of dQ_i's terms a warp stages and reduces
    WQ, WD = cfg.dq_split if ATOMIC else (1, 1)
    MQ, DQ_COLS = BR // WQ // 16, D // WD
    KV_FRAG = (M, D // 16 if KV_IN_REGISTERS else 1, 4)
    ST_ACC, P_FRAG, DKV_ACC = (M, QC // 8, 4), (M, BR // 16, 4), (M, DC // 8, 4)
    DQ_ACC, DS_FRAG = (MQ, DQ_COLS // 8, 4), (MQ, BC // 16, 4)
    CAP_GRAD = ST_ACC if SOFTCAP else (1, 1, 1)      # 1 - tanh^2 of each score (softcap)
    MODS, APPLY_MODS, APPLY_MOD_GRAD, SAVED = mods.for_kernel(cfg.mods, True, ST_ACC)
    LISTED = cfg.block_mask
    STATS_PER_THREAD = (BR + THREADS - 1) // THREADS    # rows of L_i, D_i a thread loads

    @device_function
    def rows_of(x, b, h, first, n):
        """Head h's rows of sequence b: x[b, h], or (VARLEN) rows first .. first + n - 1 of the
        packed batch."""
        if VARLEN:
            return x[0, h, first:first + n]
        return x[b, h]

    @device_function
    def next_position(h, i, i0, i1):
        """The inner step after (query head h, query block i): the steps walk every query head of
        the K/V head's group, each over the query blocks i0..i1-1 that block j meets (with a
        block mask: the entries i0..i1-1 of block j's list). Heads are
        unsigned so that indexing with them costs no negative-index wrap-around."""
        if int32(i + 1) < i1:
            return uint32(h), int32(i + 1)
        return uint32(h + 1), int32(i0)

    @device_function
    def load_q_do(smem, stage, q, do, b, h, i, n_q, first_q, tid):
        """Start the cp.async copies of Q_i and dO_i into stage `stage`."""
        base = QO0 + stage * 2 * QO_TILE
        tiles.load_tile_async(smem[base:base + QO_TILE], rows_of(q, b, h, first_q, n_q), i * BR,
                              n_q, 0, BR, D, STRIDE, SWIZZLE, tid, THREADS, True, DV)
        tiles.load_tile_async(smem[base + QO_TILE:base + 2 * QO_TILE],
                              rows_of(do, b, h, first_q, n_q), i * BR, n_q, 0, BR, D, STRIDE,
                              SWIZZLE, tid, THREADS, True, DV)

    @device_function
    def load_stats(lse, d_vec, b, h, i, n_q, first_q, r):
        """L_i * log2(e) and D_i of row r of block i (0 past the block or n_q: masked anyway)."""
        row = int32(i * BR + r)
        if r < BR and row < n_q:
            if VARLEN:
                at = uint32(first_q + row)
                return softmax.lse_log2(lse[0, h, at]), d_vec[0, h, at]
            return softmax.lse_log2(lse[b, h, uint32(row)]), d_vec[b, h, uint32(row)]
        return float32(0), float32(0)

    @device_function
    def update_dq(smem, smem_f32, k_s, dq_acc_bh, buf, q0, n_q, dq, dsa, warp, lane):
        """l.15 for the step that staged dS^T in buffer `buf`: dQ_i += dS K_j, this warp's rows
        and columns of it, added into dQ's fp32 accumulator in HBM (other thread blocks add the
        other K/V blocks' terms). dq_reduce="red": by vector atomics from registers; "bulk": staged
        in the warp's slice of the dQ buffer and added by one bulk reduction, issued by lane 0."""
        ds_s = smem[DS0 + buf * DS_TILE:DS0 + (buf + 1) * DS_TILE]
        row, col = (warp // WD) * 16 * MQ, (warp % WD) * DQ_COLS
        for m in range(MQ):
            tiles.load_a_fragments_transposed(dsa, m, ds_s, row + 16 * m, lane, DS_STRIDE, SWIZZLE)
        tiles.fill(dq, float32(0))
        tiles.gemm_ab(dq, dsa, k_s, lane, STRIDE, SWIZZLE, ELEM, col)
        if BULK:
            dqf = DQF0 + warp * DQF_WARP
            if lane == 0:
                ptx.bulk_wait_read(0)   # the warp's previous reduction has read its slice
            ptx.syncwarp()
            tiles.stage_accumulator_fragments_f32(smem_f32[dqf:dqf + DQF_WARP], dq, lane)
            ptx.fence_proxy_async_shared()    # the copy engine reads what these stores wrote
            ptx.syncwarp()
            if lane == 0:   # the slice is rows q0 + warp * DQF_WARP / d.. of the (contiguous)
                ptx.bulk_reduce_add_f32(dq_acc_bh, int32(q0 + warp * (DQF_WARP // D)), smem_f32,
                                        dqf, 4 * DQF_WARP)
                ptx.bulk_commit()
        else:
            tiles.atomic_add_accumulator_f32(dq_acc_bh, dq, q0 + row, col, n_q, lane)

    @device_function
    def kv_block(j, b, h_kv, q, k, v, do, lse, d_vec, dq_acc, dk32, dv32, n_q, n_k, kv_group,
                 lo, hi, softcap, softmax_scale, scale_log2, first_q, first_k, alibi,
                 alibi_stride, alibi_shift, rng, drop_scale, drop_cg, mod_args):
        """l.6-17 for K/V block j of batch b, K/V head h_kv (VARLEN: of sequence b, whose rows
        start at first_q and first_k of the packed batch); ALiBi's slopes and shift as the
        forward's (fa2.py); rng, drop_scale, drop_cg: dropout's (DROPOUT; fa2.py); mod_args:
        (aux, the arrays of score_mod, mask_mod and score_mod_grad (MODS; common/tile/mods.py);
        bm_blocks, bm_counts, bm_per_b, bm_per_h: a BlockMask's lists of the key blocks
        (LISTED: one list for the K/V head's group), as fa2.py's) in one tuple: a call of more
        than 30 arguments compiles to CALL_FUNCTION_EX, which Numba's inliner refuses."""
        aux, bm_blocks, bm_counts, bm_per_b, bm_per_h = mod_args
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        key0 = int32(j * BC)
        # This warp's first key in K_j, first query of Q_i in its S^T, dP^T tiles, and first
        # column of its dK_j, dV_j (shifts and masks: QW is a power of two, and the compiler then
        # knows these are not negative, so indexing with them needs no wrap-around).
        warp_key = (warp >> QW_SHIFT) * 16 * M
        warp_q = (warp & (QW - 1)) * QC
        warp_col = (warp & (QW - 1)) * DC
        smem = cuda.shared.array(0, uint16)
        smem32 = cuda.shared.array(0, uint32)
        smem_f32 = cuda.shared.array(0, float32)
        stats = smem_f32
        k_s = smem[K0:K0 + KV_TILE]
        v_s = smem[V0:V0 + KV_TILE]

        # The query blocks block j meets: causal or a window skips those outside the band. (Step
        # arithmetic in 32 bits: Numba types int32 + int32 as int64, so each sum is cast back.)
        i0, i1 = int32(0), int32((n_q + BR - 1) // BR)
        if SKIP:
            i0, i1 = masks.query_blocks(key0, BC, n_q, n_k, BR, lo, hi)
        # With a block mask the steps walk the entries u0 .. u1 - 1 of block j's list within
        # [i0, i1) instead (mods.step_block: entry u's query block).
        listed = bm_blocks[b * bm_per_b, h_kv * kv_group * bm_per_h, j if LISTED else 0]
        u0, u1 = i0, i1
        if LISTED:
            u0, u1 = mods.listed_range(listed, bm_counts[b * bm_per_b, h_kv * kv_group * bm_per_h,
                                                         j], i0, i1)
        n_i = max(int32(u1 - u0), int32(0))
        n_steps = int32(kv_group * n_i)

        # l.6: K_j, V_j to SRAM, with the first step's Q_i, dO_i, L_i, D_i (l.9).
        tiles.load_tile_async(k_s, rows_of(k, b, h_kv, first_k, n_k), key0, n_k, 0, BC, D, STRIDE,
                              SWIZZLE, tid, THREADS, True, DV)
        tiles.load_tile_async(v_s, rows_of(v, b, h_kv, first_k, n_k), key0, n_k, 0, BC, D, STRIDE,
                              SWIZZLE, tid, THREADS, True, DV)
        h, u = uint32(h_kv * kv_group), int32(u0)   # the first step's query head and entry
        i, full = mods.step_block(listed, u, LISTED)   # ... and query block
        q0 = int32(i * BR)                 # first query of Q_i
        load_q_do(smem, 0, q, do, b, h, i, n_q, first_q, tid)
        pipeline.commit()
        for r in range(tid, BR, THREADS):
            lse2_0, d_0 = load_stats(lse, d_vec, b, h, i, n_q, first_q, r)
            stats[STAT0 + r] = lse2_0
            stats[STAT0 + BR + r] = d_0

        # l.7: dK_j = 0, dV_j = 0, on chip.
        dk = cuda.local.array(DKV_ACC, float32)
        dv = cuda.local.array(DKV_ACC, float32)
        tiles.fill(dk, float32(0))
        tiles.fill(dv, float32(0))
        kf = cuda.local.array(KV_FRAG, uint32)
        vf = cuda.local.array(KV_FRAG, uint32)
        s = cuda.local.array(ST_ACC, float32)
        dp = cuda.local.array(ST_ACC, float32)
        pa = cuda.local.array(P_FRAG, uint32)
        dsa = cuda.local.array(DS_FRAG, uint32)
        dq = cuda.local.array(DQ_ACC, float32)
        cap_grad = cuda.local.array(CAP_GRAD, float32)
        saved = cuda.local.array(SAVED, float32)     # the scaled scores score_mod_grad takes
        inv_scale = float32(1) / softmax_scale if MODS else float32(0)
        next_lse2 = cuda.local.array(STATS_PER_THREAD, float32)
        next_d = cuda.local.array(STATS_PER_THREAD, float32)
        if KV_IN_REGISTERS:                 # K_j, V_j's A fragments of the warp's keys, once
            pipeline.wait_and_release(0)
            for m in range(M):
                tiles.load_a_fragments(kf, m, k_s, warp_key + 16 * m, lane, STRIDE, SWIZZLE)
                tiles.load_a_fragments(vf, m, v_s, warp_key + 16 * m, lane, STRIDE, SWIZZLE)

        for step in range(n_steps):     # l.8 (over the group's query heads too, for GQA)
            stage = pipeline.slot(step, 2)   # Q_i, dO_i, L_i, D_i: two stages
            qo = QO0 + stage * 2 * QO_TILE
            q_s = smem[qo:qo + QO_TILE]
            do_s = smem[qo + QO_TILE:qo + 2 * QO_TILE]
            st = STAT0 + stage * 2 * BR
            lse2_s = stats[st:st + BR]
            d_s = stats[st + BR:st + 2 * BR]
            # l.9: Q_i, dO_i (and K_j, V_j at the first step) have landed and every warp is done
            # with the other stage: start copying step+1's Q, dO there (and read its L, D).
            pipeline.wait_and_release(0)
            h_prev = h
            if step > 0:
                h, u = next_position(h, u, u0, u1)
                i, full = mods.step_block(listed, u, LISTED)
            more = int32(step + 1) < n_steps
            if more:
                h_next, u_next = next_position(h, u, u0, u1)
                i_next = mods.step_block(listed, u_next, LISTED)[0]
                load_q_do(smem, pipeline.other(stage), q, do, b, h_next, i_next, n_q, first_q,
                          tid)
                for r in range(STATS_PER_THREAD):
                    next_lse2[r], next_d[r] = load_stats(lse, d_vec, b, h_next, i_next, n_q,
                                                         first_q, tid + r * THREADS)
            pipeline.commit()
            if ATOMIC and step > 0:
                # l.15 of the previous step, its dS^T now visible to all warps. After the copies
                # are issued: with dq_reduce="red" its 16 reductions a thread would otherwise
                # queue ahead of them in the load/store unit (5% of the kernel's time at d=128 on
                # an H100).
                update_dq(smem, smem_f32, k_s, rows_of(dq_acc, b, h_prev, first_q, n_q),
                          pipeline.other(stage), q0, n_q, dq, dsa, warp, lane)
            q0 = int32(i * BR)

            # l.10: S^T = K_j Q_i^T (keys x queries); l.11: P^T = exp(S^T - L_i). The warp's keys
            # x its QC queries (all B_r of them when query_warps = 1).
            tiles.fill(s, float32(0))
            tiles.gemm_abt_held_or_streamed(s, kf, KV_IN_REGISTERS, k_s, warp_key, D // 16, q_s,
                                            lane, STRIDE, SWIZZLE, ELEM, warp_q)
            if SOFTCAP:
                softmax.softcap_scores_with_grad(s, cap_grad, softcap)
            if ALIBI:   # the forward's bias, S^T[key, query] -= slope |query + shift - key|
                tiles.add_alibi_transposed(s, key0 + warp_key - alibi_shift, q0 + warp_q,
                                           alibi[b * alibi_stride + h] / softmax_scale, lane)
            if MODS:   # the forward's score_mod and mask_mod, on S^T (keys in rows)
                APPLY_MODS(s, saved, key0 + warp_key, q0 + warp_q, n_q, n_k, int32(b), int32(h),
                           aux, softmax_scale, inv_scale, lane, full)
            if int32(q0 + BR) > n_q or masks.block_is_partial(q0, BR, key0, BC, n_k, BANDED, lo,
                                                              hi, WINDOW):
                tiles.mask_scores_transposed(s, key0 + warp_key, n_k, q0 + warp_q, n_q, BANDED,
                                             lo, hi, lane, WINDOW)
            softmax.recompute_p_columns(s, lse2_s, lane, scale_log2, warp_q)
            # l.13: dP^T = V_j dO_i^T; l.14: dS^T = P^T o (dP^T - D_i).
            tiles.fill(dp, float32(0))
            tiles.gemm_abt_held_or_streamed(dp, vf, KV_IN_REGISTERS, v_s, warp_key, D // 16, do_s,
                                            lane, STRIDE, SWIZZLE, ELEM, warp_q)
            if DROPOUT:   # dP^T of the kept elements (Z o dP / (1 - p)), the dropped marked in P^T
                dropout.drop_transposed(s, dp, key0 + warp_key, q0 + warp_q, lane,
                                        b * (cuda.gridDim.z * kv_group) + h, drop_cg, rng,
                                        drop_scale)
            softmax.grad_columns(s, dp, d_s, lane, warp_q, DROPOUT)
            if DROPOUT:   # l.12's operand: Z o P^T / (1 - p)
                dropout.unsign(s, drop_scale)
            if MODS:   # dS of the unmodified scores: through score_mod's derivative
                APPLY_MOD_GRAD(dp, saved, key0 + warp_key, q0 + warp_q, n_q, n_k, int32(b),
                               int32(h), aux, lane)
            if SOFTCAP:   # dS of the raw scores: through the cap's derivative
                tiles.multiply(dp, cap_grad)
            ds = DS0 + stage * DS_TILE
            ds_s = smem[ds:ds + DS_TILE]
            if STAGED_DS:
                # l.15 needs whole rows of dS (every warp's keys) for each warp's part of dQ_i, and
                # with 2-D warp tiles l.16 needs every query of the warp's keys: stage dS^T in shared
                # memory (l.15's product runs after the next barrier).
                tiles.stage_accumulator(smem32[ds // 2:(ds + DS_TILE) // 2], dp, warp_key, lane,
                                        DS_STRIDE, SWIZZLE, ELEM, warp_q)
            if TWO_D:
                # P^T too, and the warps that share these keys meet (named barrier 1 + key slice).
                tiles.stage_accumulator(smem32[P0 // 2:(P0 + DS_TILE) // 2], s, warp_key, lane,
                                        DS_STRIDE, SWIZZLE, ELEM, warp_q)
                ptx.bar_sync(1 + (warp >> QW_SHIFT), 32 * QW)
                # l.12: dV_j += P^T dO_i, the warp's DC columns of it;
                for m in range(M):
                    tiles.load_a_fragments(pa, m, smem[P0:P0 + DS_TILE], warp_key + 16 * m, lane,
                                           DS_STRIDE, SWIZZLE)
                tiles.gemm_ab(dv, pa, do_s, lane, STRIDE, SWIZZLE, ELEM, warp_col)
                # l.16: dK_j += dS^T Q_i (softmax_scale applied once, at l.17).
                for m in range(M):
                    tiles.load_a_fragments(pa, m, ds_s, warp_key + 16 * m, lane, DS_STRIDE,
                                           SWIZZLE)
                tiles.gemm_ab(dk, pa, q_s, lane, STRIDE, SWIZZLE, ELEM, warp_col)
            else:
                # l.12: dV_j += P^T dO_i, P^T straight from its accumulator into A fragments.
                tiles.accumulator_to_a(pa, s, ELEM)
                tiles.gemm_ab(dv, pa, do_s, lane, STRIDE, SWIZZLE, ELEM)
                # l.16: dK_j += dS^T Q_i (softmax_scale applied once, at l.17).
                tiles.accumulator_to_a(pa, dp, ELEM)
                tiles.gemm_ab(dk, pa, q_s, lane, STRIDE, SWIZZLE, ELEM)
            if more:   # step+1's L, D: its stage's statistics are free since the barrier
                nst = STAT0 + pipeline.other(stage) * 2 * BR
                for r in range(STATS_PER_THREAD):
                    if tid + r * THREADS < BR:
                        stats[nst + tid + r * THREADS] = next_lse2[r]
                        stats[nst + BR + tid + r * THREADS] = next_d[r]

        # A block no query sees (n_steps = 0: keys past a top-left band, a sequence with no
        # queries) still has K_j, V_j in flight: they land before dK_j = dV_j = 0 is staged there.
        pipeline.wait_and_release(0)
        if ATOMIC and n_steps > 0:   # l.15 of the last step
            update_dq(smem, smem_f32, k_s, rows_of(dq_acc, b, h, first_q, n_q),
                      pipeline.slot(n_steps - 1, 2), q0, n_q, dq, dsa, warp, lane)
            cuda.syncthreads()   # every warp is done reading K_j: its tile stages dK_j next
        # l.17: write dK_j = softmax_scale * dK_j and dV_j, staged through the K, V tiles.
        tiles.scale_accumulator(dk, softmax_scale)
        tiles.stage_accumulator(smem32[K0 // 2:(K0 + KV_TILE) // 2], dk, warp_key, lane, STRIDE,
                                SWIZZLE, ELEM, warp_col)
        tiles.stage_accumulator(smem32[V0 // 2:(V0 + KV_TILE) // 2], dv, warp_key, lane, STRIDE,
                                SWIZZLE, ELEM, warp_col)
        cuda.syncthreads()
        tiles.store_tile(rows_of(dk32, b, h_kv, first_k, n_k), smem32[K0 // 2:(K0 + KV_TILE) // 2],
                         key0, n_k, BC, D, STRIDE, SWIZZLE, tid, THREADS, DV)
        tiles.store_tile(rows_of(dv32, b, h_kv, first_k, n_k), smem32[V0 // 2:(V0 + KV_TILE) // 2],
                         key0, n_k, BC, D, STRIDE, SWIZZLE, tid, THREADS, DV)
        if BULK and lane == 0:
            ptx.bulk_wait(0)    # the warp's reductions are done (and its slice free for FA1's next j)

    @kernel
    def fa2_backward_kv(q, k, v, do, lse, d_vec, dq_acc, dk32, dv32, n_q, n_k, kv_group, lo, hi,
                        softcap, softmax_scale, scale_log2, cu_q, cu_k, alibi, alibi_stride,
                        alibi_shift, sinks, seed_lo, seed_hi, offset_lo, offset_hi, keep_below,
                        drop_scale, drop_cg, aux, bm_blocks, bm_counts, bm_per_b, bm_per_h):
        """q, k, v, do: (B, H, N, d) uint16 views; lse, d_vec: (B, H, N_q); dq_acc: (B, H, N_q, D)
        fp32 (D = tiles.tile_columns(d)); dk32, dv32: (B, H_kv, N_k, d/2) uint32 views; lo, hi, softcap: the mask (fa2.py).
        VARLEN: B = 1, and batch b of the grid is the sequence of rows cu_q[b] .. cu_q[b+1] - 1
        (keys: cu_k), lo and hi relative to its top-left corner. alibi..sinks: the forward's
        score terms (sinks unread: L holds them); seed_lo .. drop_cg: its dropout (fa2.py)."""
        b, h_kv = uint32(cuda.blockIdx.y), uint32(cuda.blockIdx.z)   # unsigned: no index wrap
        rng = (seed_lo, seed_hi, offset_lo, offset_hi, keep_below)
        first_q, first_k = int32(0), int32(0)
        if VARLEN:   # sequence b of the packed batch: its rows, and its own band
            first_q, first_k = cu_q[b], cu_k[b]
            n_q, n_k = int32(cu_q[b + 1] - first_q), int32(cu_k[b + 1] - first_k)
            if int32(cuda.blockIdx.x * BC) >= n_k:     # the grid covers the longest sequence
                return
            if SHIFT:
                lo, hi = int32(lo + (n_k - n_q)), int32(hi + (n_k - n_q))
                alibi_shift = int32(n_k - n_q)
        if SEQUENTIAL:   # FA1 Alg. 4: one thread block walks every K/V block j in turn
            for j in range((n_k + BC - 1) // BC):
                kv_block(j, b, h_kv, q, k, v, do, lse, d_vec, dq_acc, dk32, dv32, n_q, n_k,
                         kv_group, lo, hi, softcap, softmax_scale, scale_log2, first_q, first_k,
                         alibi, alibi_stride, alibi_shift, rng, drop_scale, drop_cg,
                         (aux, bm_blocks, bm_counts, bm_per_b, bm_per_h))
                cuda.syncthreads()   # every warp is done with the tiles before the next K_j, V_j
        else:            # l.5: "for 1 <= j <= T_c" is the grid
            kv_block(cuda.blockIdx.x, b, h_kv, q, k, v, do, lse, d_vec, dq_acc, dk32, dv32, n_q,
                     n_k, kv_group, lo, hi, softcap, softmax_scale, scale_log2, first_q, first_k,
                     alibi, alibi_stride, alibi_shift, rng, drop_scale, drop_cg,
                     (aux, bm_blocks, bm_counts, bm_per_b, bm_per_h))

    return fa2_backward_kv


@lru_cache(maxsize=None)
def build_backward_dq(cfg):
    """dq="separate": dQ_i = softmax_scale * sum_j dS_i^(j) K_j with the query blocks outer (one
    thread block per Q_i, warps split Q_i as in the forward), recomputing S and dP; no atomics, so
    dQ is bitwise reproducible."""
    D, BR, BC, THREADS = cfg.tile_dim, cfg.dq_block_m, cfg.dq_block_n, 32 * cfg.dq_warps
    DV = cfg.head_dim     # columns in HBM (D: the tiles')
    M = BR // (16 * cfg.dq_warps)
    ELEM, BANDED, SWIZZLE, SOFTCAP = cfg.element.code, cfg.causal, cfg.swizzle, cfg.softcap
    SKIP, WINDOW = cfg.causal and cfg.causal_skip, cfg.window
    STRIDE = tiles.tile_row_stride(D, SWIZZLE)
    Q_TILE, KV_TILE = BR * STRIDE, BC * STRIDE
    LAYOUT = cfg.dq_smem_layout()
    Q0, DO0, KV0 = LAYOUT.start("q"), LAYOUT.start("do"), LAYOUT.start("kv")
    A_FRAG, S_ACC, P_FRAG, DQ_ACC = (M, 1, 4), (M, BC // 8, 4), (M, BC // 16, 4), (M, D // 8, 4)
    ROWS = 2 * M
    CAP_GRAD = S_ACC if SOFTCAP else (1, 1, 1)
    VARLEN, SHIFT = cfg.varlen, cfg.varlen and cfg.bottom_right
    ALIBI, DROPOUT = cfg.alibi, cfg.dropout
    MODS, APPLY_MODS, APPLY_MOD_GRAD, SAVED = mods.for_kernel(cfg.mods, False, S_ACC)
    LISTED = cfg.block_mask

    @kernel
    def fa2_backward_dq(q, k, v, do, lse, d_vec, dq32, n_q, n_k, kv_group, lo, hi, softcap,
                        softmax_scale, scale_log2, cu_q, cu_k, alibi, alibi_stride, alibi_shift,
                        sinks, seed_lo, seed_hi, offset_lo, offset_hi, keep_below, drop_scale,
                        drop_cg, aux, bm_blocks, bm_counts, bm_per_b, bm_per_h):
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        i = masks.query_block(BANDED)   # with a band, the blocks with the most K/V blocks first
        b, h = cuda.blockIdx.y, cuda.blockIdx.z
        row0 = i * BR
        first_q, first_k = int32(0), int32(0)
        if VARLEN:   # sequence b of the packed batch (as the forward, fa2.py)
            first_q, first_k = cu_q[b], cu_k[b]
            n_q, n_k = int32(cu_q[b + 1] - first_q), int32(cu_k[b + 1] - first_k)
            if row0 >= n_q:
                return
            if SHIFT:
                lo, hi = int32(lo + (n_k - n_q)), int32(hi + (n_k - n_q))
                alibi_shift = int32(n_k - n_q)
            k_h = k[0, h // kv_group, first_k:first_k + n_k]
            v_h = v[0, h // kv_group, first_k:first_k + n_k]
            q_h, do_h = q[0, h, first_q:first_q + n_q], do[0, h, first_q:first_q + n_q]
            lse_h, d_h = lse[0, h, first_q:first_q + n_q], d_vec[0, h, first_q:first_q + n_q]
        else:
            k_h, v_h = k[b, h // kv_group], v[b, h // kv_group]
            q_h, do_h, lse_h, d_h = q[b, h], do[b, h], lse[b, h], d_vec[b, h]
        warp_row = warp * 16 * M
        slope = alibi[b * alibi_stride + h] / softmax_scale if ALIBI else float32(0)
        smem = cuda.shared.array(0, uint16)
        q_s = smem[Q0:Q0 + Q_TILE]
        do_s = smem[DO0:DO0 + Q_TILE]
        j0, j1 = int32(0), int32((n_k + BC - 1) // BC)
        if SKIP:
            j0, j1 = masks.key_blocks(row0, BR, n_q, n_k, BC, lo, hi)
        listed = bm_blocks[b * bm_per_b, h * bm_per_h, i if LISTED else 0]   # as the forward's
        t0, t1 = j0, j1
        if LISTED:
            t0, t1 = mods.listed_range(listed, bm_counts[b * bm_per_b, h * bm_per_h, i], j0, j1)
        first_col = mods.step_block(listed, t0, LISTED)[0] * BC
        tiles.load_tile_async(q_s, q_h, row0, n_q, 0, BR, D, STRIDE, SWIZZLE, tid, THREADS,
                              True, DV)
        tiles.load_tile_async(do_s, do_h, row0, n_q, 0, BR, D, STRIDE, SWIZZLE, tid, THREADS,
                              True, DV)
        tiles.load_tile_async(smem[KV0:KV0 + KV_TILE], k_h, first_col, n_k, 0, BC, D, STRIDE,
                              SWIZZLE, tid, THREADS, True, DV)
        tiles.load_tile_async(smem[KV0 + KV_TILE:KV0 + 2 * KV_TILE], v_h, first_col, n_k, 0, BC,
                              D, STRIDE, SWIZZLE, tid, THREADS, True, DV)
        pipeline.commit()
        # L_i * log2(e) and D_i of the lane's rows, in registers.
        lse2 = cuda.local.array(ROWS, float32)
        d_rows = cuda.local.array(ROWS, float32)
        for r in range(ROWS):
            row = row0 + warp_row + 16 * (r >> 1) + (lane >> 2) + 8 * (r & 1)
            lse2[r] = softmax.lse_log2(lse_h[row]) if row < n_q else float32(0)
            d_rows[r] = d_h[row] if row < n_q else float32(0)
        a = cuda.local.array(A_FRAG, uint32)
        s = cuda.local.array(S_ACC, float32)
        dp = cuda.local.array(S_ACC, float32)
        pa = cuda.local.array(P_FRAG, uint32)
        dq = cuda.local.array(DQ_ACC, float32)
        cap_grad = cuda.local.array(CAP_GRAD, float32)
        saved = cuda.local.array(SAVED, float32)
        inv_scale = float32(1) / softmax_scale if MODS else float32(0)
        tiles.fill(dq, float32(0))
        for t in range(t0, t1):
            j, full = mods.step_block(listed, t, LISTED)
            col0 = j * BC
            kv = pipeline.slot_start(KV0, t - t0, 2, 2 * KV_TILE)   # K_j, V_j: two stages
            k_s = smem[kv:kv + KV_TILE]
            v_s = smem[kv + KV_TILE:kv + 2 * KV_TILE]
            # K_j, V_j landed, and every warp is done with the other stage: the next ones there
            pipeline.wait_and_release(0)
            if t + 1 < t1:
                nxt = pipeline.slot_start(KV0, t + 1 - t0, 2, 2 * KV_TILE)
                col1 = mods.step_block(listed, t + 1, LISTED)[0] * BC
                tiles.load_tile_async(smem[nxt:nxt + KV_TILE], k_h, col1, n_k, 0, BC, D,
                                      STRIDE, SWIZZLE, tid, THREADS, True, DV)
                tiles.load_tile_async(smem[nxt + KV_TILE:nxt + 2 * KV_TILE], v_h, col1, n_k,
                                      0, BC, D, STRIDE, SWIZZLE, tid, THREADS, True, DV)
            pipeline.commit()
            # l.10-11: S = Q_i K_j^T, P = exp(S - L_i); l.13-14: dP = dO_i V_j^T, dS = P o (dP - D_i)
            tiles.fill(s, float32(0))
            tiles.gemm_abt_streamed(s, a, q_s, warp_row, D // 16, k_s, lane, STRIDE, SWIZZLE,
                                    ELEM)
            if SOFTCAP:
                softmax.softcap_scores_with_grad(s, cap_grad, softcap)
            if ALIBI:
                tiles.add_alibi(s, row0 + warp_row + alibi_shift, col0, slope, lane)
            if MODS:
                APPLY_MODS(s, saved, row0 + warp_row, col0, n_q, n_k, int32(b), int32(h), aux,
                           softmax_scale, inv_scale, lane, full)
            if masks.block_is_partial(row0, BR, col0, BC, n_k, BANDED, lo, hi, WINDOW):
                tiles.mask_scores(s, row0 + warp_row, col0, n_k, BANDED, lo, hi, lane, WINDOW)
            softmax.recompute_p_rows(s, lse2, scale_log2)
            tiles.fill(dp, float32(0))
            tiles.gemm_abt_streamed(dp, a, do_s, warp_row, D // 16, v_s, lane, STRIDE, SWIZZLE,
                                    ELEM)
            if DROPOUT:   # Z o dP / (1 - p): the forward's mask, from the same Philox counters
                dropout.drop_rows(dp, row0 + warp_row, col0, lane, b * cuda.gridDim.z + h,
                                  drop_cg, (seed_lo, seed_hi, offset_lo, offset_hi, keep_below),
                                  drop_scale)
            softmax.grad_rows(s, dp, d_rows)
            if MODS:
                APPLY_MOD_GRAD(dp, saved, row0 + warp_row, col0, n_q, n_k, int32(b), int32(h),
                               aux, lane)
            if SOFTCAP:
                tiles.multiply(dp, cap_grad)
            # l.15: dQ_i += dS K_j, dS straight from its accumulator into A fragments.
            tiles.accumulator_to_a(pa, dp, ELEM)
            tiles.gemm_ab(dq, pa, k_s, lane, STRIDE, SWIZZLE, ELEM)
        # dQ_i = softmax_scale * dQ_i to HBM, staged through the Q tile (for rows that see no key,
        # j1 <= j0, once their own Q_i copy has landed there).
        pipeline.wait_and_release(0)
        q_s32 = cuda.shared.array(0, uint32)[Q0 // 2:(Q0 + Q_TILE) // 2]
        tiles.scale_accumulator(dq, softmax_scale)
        tiles.stage_accumulator(q_s32, dq, warp_row, lane, STRIDE, SWIZZLE, ELEM)
        cuda.syncthreads()
        dq_h = dq32[0, h, first_q:first_q + n_q] if VARLEN else dq32[b, h]
        tiles.store_tile(dq_h, q_s32, row0, n_q, BR, D, STRIDE, SWIZZLE, tid, THREADS, DV)

    return fa2_backward_dq


@replayed(6)
def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
             softcap=0.0, align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, dropout_p=0.0,
             dropout_seed=0, dropout_offset=0, score_mod=None, mask_mod=None, score_mod_grad=None,
             aux=None, block_mask=None, grads=None, **options):
    """FA2 backward: (dq, dk, dv) shaped like (q, k, v), from the forward's inputs, its outputs
    (o, lse) and dO = dLoss/dO (like o); the mask, score terms and dropout as the forward's (with
    sinks, a fourth gradient: d sinks (H,) fp32; dropout: the forward's seed and offset;
    score_mod with its score_mod_grad, mask_mod, aux: common/host/mods.py).
    options: see BackwardConfig and BACKWARD_OPTIONS."""
    g = bwd.prepare_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                             grads=grads, head_dims=HEAD_DIMS, variant="fa2",
                             window_size=window_size, softcap=softcap, align=align)
    with_score_terms(g.prob, alibi_slopes, sinks, align)
    with_dropout(g.prob, dropout_p, dropout_seed, dropout_offset)
    with_mods(g.prob, score_mod, mask_mod, score_mod_grad, aux, "fa2", backward=True,
              block_mask=block_mask)
    cfg = default_backward_config(g.prob.head_dim, g.prob.element, g.prob.banded,
                                  configs.mask_fields(g.prob, backward=True), **options)
    return run_backward(g, cfg)


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                    align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, dropout_p=0.0,
                    dropout_seed=0, dropout_offset=0, score_mod=None, mask_mod=None,
                    score_mod_grad=None, aux=None, grads=None, **options):
    """FA2 backward of a packed batch (fa2.forward_varlen): (dq, dk, dv) shaped like (q, k, v),
    from the forward's inputs, o (total_q, H, d), lse (H, total_q) and dO like o. dQ is added by
    vector atomics into a row-major accumulator (dq_reduce="red", the default here) or computed
    by the separate kernel (dq="separate")."""
    return run_backward_varlen(
        (do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
        dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
             align=align, grads=grads), options, "fa2", default_backward_config,
        (alibi_slopes, sinks), (dropout_p, dropout_seed, dropout_offset),
        (score_mod, mask_mod, score_mod_grad, aux))


def run_backward_varlen(arrays_and_lengths, mask, options, variant, config_function,
                        score_terms=(None, None), drop=(0.0, 0, 0), mods=(None,) * 4):
    """A packed batch's backward through this module's kernels, for fa2 and fa1 (which differ in
    the variant's name and its configuration function): checked, dQ by vector atomics unless
    options say otherwise (the bulk reduction's staging is per query block of one sequence)."""
    g = bwd.prepare_backward_varlen(*arrays_and_lengths, head_dims=HEAD_DIMS, variant=variant,
                                    **mask)
    with_score_terms(g.prob, *score_terms, mask.get("align", masks.BOTTOM_RIGHT))
    with_dropout(g.prob, *drop)
    with_mods(g.prob, *mods, variant, backward=True)
    options.setdefault("dq_reduce", "red")
    cfg = config_function(g.prob.head_dim, g.prob.element, g.prob.banded,
                          configs.mask_fields(g.prob, backward=True), **options)
    return run_backward(g, cfg)


def _block_mask_args(prob, cfg, block_m, block_n, transposed):
    """A backward kernel's block-mask arguments (the K/V kernel's lists transposed: query blocks
    of each key block), placeholders without one."""
    if not cfg.block_mask:
        return no_block_mask(prob)
    return prob.block_mask.args(block_m, block_n, prob.stream, transposed)


def run_backward(g, cfg):
    """Launch Algorithm 2 (or, with cfg.kv_blocks="sequential", FA1's schedule of it) for the
    checked problem `g` (variants.backward_shared.prepare_backward)."""
    prob = g.prob
    atomic = cfg.dq == "atomic"
    bwd.preprocess(g, zero_dq=atomic, dq_layout=cfg.dq_layout())                # l.4
    scale, scale_log2 = np.float32(prob.softmax_scale), \
        np.float32(prob.softmax_scale * math.log2(math.e))
    sizes = (np.int32(prob.n_q), np.int32(prob.n_k), np.int32(prob.kv_group), *prob.mask_args())
    seqs = prob.varlen   # a packed batch: the grid covers its longest sequences
    rows_q, rows_k = (prob.n_q, prob.n_k) if seqs is None else (seqs.max_q, seqs.max_k)
    cu = (seqs.cu_q, seqs.cu_k) if seqs is not None else \
        (arrays.placeholder(prob.library, 1, prob.like, "int32"),) * 2
    terms = prob.score_args() + prob.dropout_args()
    kv_blocks = 1 if cfg.kv_blocks == "sequential" else (rows_k + cfg.block_n - 1) // cfg.block_n
    grid = (kv_blocks, prob.batch, prob.heads_kv)
    launch(build_backward(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream,
           prob.q, prob.k, prob.v, g.do, prob.lse, g.d_vec, g.dq_acc, g.dk32, g.dv32, *sizes,
           scale, scale_log2, *cu, *terms, prob.aux,
           *_block_mask_args(prob, cfg, cfg.block_m, cfg.block_n, True))
    if atomic:
        bwd.convert_dq(g)
    else:
        grid = ((rows_q + cfg.dq_block_m - 1) // cfg.dq_block_m, prob.batch, prob.heads)
        launch(build_backward_dq(cfg), grid, 32 * cfg.dq_warps, cfg.dq_smem_bytes(), prob.stream,
               prob.q, prob.k, prob.v, g.do, prob.lse, g.d_vec, g.dq32, *sizes, scale, scale_log2,
               *cu, *terms, prob.aux,
               *_block_mask_args(prob, cfg, cfg.dq_block_m, cfg.dq_block_n, False))
    return g.result() if prob.sinks is None else g.result() + (bwd.sink_grad(g),)


def backward_compile_targets(cfg, tag):
    """(name, kernel, argument types, mma count in its PTX, or (in the PTX, in the main loop)) of
    the kernels `run_backward` launches for cfg (the preprocess and dQ conversion: common/
    backward.py's compile_targets)."""
    f32_4, f32_3 = types.Array(types.float32, 4, "C"), types.Array(types.float32, 3, "C")
    sizes = (types.int32, types.int32, types.int32) + MASK_TYPES + (types.float32, types.float32,
                                                                     SEQS_TYPE, SEQS_TYPE) + \
        SCORE_TYPES + DROPOUT_TYPES + MOD_TYPES + BLOCK_MASK_TYPES
    # S^T, dP^T, dV, dK: 4 * M * (B_r / query_warps) * d / 128 mma a step (2-D warp tiles: a warp
    # has M m16 tiles of keys and a query_warps-th of B_r in S^T, dP^T and of d in dV, dK); with
    # atomics dQ's product appears twice (in the loop and for the last step):
    # 2 * MQ * (d / WD) * B_c / 128. In the SASS's main loop: the query loop's, or FA1's K/V loop's
    # (which holds the last one too).
    wq, wd = cfg.dq_split
    mma = 4 * cfg.m_tiles * cfg.block_m * cfg.head_dim // (128 * cfg.query_warps)
    if cfg.dq == "atomic":
        dq_mma = (cfg.block_m // wq // 16) * (cfg.head_dim // wd) * cfg.block_n // 128
        mma = (mma + 2 * dq_mma, mma + (2 if cfg.kv_blocks == "sequential" else 1) * dq_mma)
    yield f"{tag} kv", build_backward(cfg), \
        (QKV_TYPE,) * 4 + (LSE_TYPE, f32_3, f32_4, OUT_TYPE, OUT_TYPE) + sizes, mma
    if cfg.dq == "separate":   # S, dP, dQ: 3 * M * B_c * d / 128
        m = cfg.dq_block_m // (16 * cfg.dq_warps)
        yield f"{tag} dq", build_backward_dq(cfg), \
            (QKV_TYPE,) * 4 + (LSE_TYPE, f32_3, OUT_TYPE) + sizes, 3 * m * cfg.dq_block_n * cfg.head_dim // 128


# The head dims the compile report covers (as the forward's, variants/fa2.py): at 96, padded 2-D
# warp tiles; at 256, B_c = B_r = 64, dQ by red.global.add.
REPORTED_HEAD_DIMS = (64, 128, 96, 256)


def compile_targets():
    """(name, kernel, argument types, mma count) of the backward's kernels at the defaults, bf16
    (the dtype changes only the mma and cvt opcodes), and of the default dQ path's other setting
    (fa1's backward runs the atomic one's code on FA1's schedule); the dQ conversion of the default
    (bulk-reduced) fragment order."""
    for head_dim in REPORTED_HEAD_DIMS:
        for causal in (False, True):
            if head_dim not in (64, 128) and causal:
                continue   # the other head dims' layouts and tiles: non-causal
            yield from backward_compile_targets(default_backward_config(head_dim, BFLOAT16, causal),
                                                f"fa2 backward d={head_dim} bf16 causal={causal}")
        if head_dim not in (64, 128):
            continue
        other = "separate" if BACKWARD_DEFAULTS[head_dim]["dq"] == "atomic" else "atomic"
        yield from backward_compile_targets(
            default_backward_config(head_dim, BFLOAT16, False, dq=other),
            f"fa2 backward d={head_dim} bf16 causal=False dq={other}")
    # dropout at d=128 (the mask regenerated in S^T; the separate dQ kernel's is the forward's code)
    yield from backward_compile_targets(
        default_backward_config(128, BFLOAT16, False, (("dropout", True),)),
        "fa2 backward d=128 bf16 causal=False dropout")
    # the conversion of the default (bulk-reduced) dQ terms, in this backward's fragment order
    f32_4 = types.Array(types.float32, 4, "C")
    for head_dim in (64, 128):
        layout = default_backward_config(head_dim, BFLOAT16, False).dq_layout()
        yield f"backward convert_dq fragments d={head_dim} bf16", \
            bwd.build_convert_dq_fragments(layout, BFLOAT16, head_dim), \
            (f32_4, OUT_TYPE, types.int32, types.float32), 0
