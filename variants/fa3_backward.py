"""FlashAttention-3 backward on Hopper (Shah et al. 2024, section 3.3 and Appendix B: the backward
with warpgroup MMAs and warp specialisation): FA2's Algorithm 2 (variants/fa2_backward.py has the
math) with every GEMM a wgmma on shared-memory descriptors, Q_i and dO_i brought in by the bulk
tensor copy engine (TMA) into a ring of stages guarded by mbarriers, and a producer warp that only
copies.

The grid: a thread block per K/V block j of B_c keys (batch, K/V head), as FA2. Its consumer
warpgroups each own 64 keys of K_j, V_j (the M of wgmma.m64nNk16) and their rows of dK_j, dV_j in
registers; the query blocks i (B_r = 64 queries at d = 128, 128 at d = 64) come round the ring.
Per step, warpgroup w:

  l.10   S^T = K_j[w] Q_i^T            SS-wgmma m64 n=B_r, both operands K-major (TMA tiles)
  l.13   dP^T = V_j[w] dO_i^T          SS-wgmma, issued right behind S^T
  l.11   P^T = exp(S^T - L_i)          once S^T has landed (dP^T may still be running)
  l.12   dV_j[w] += P^T dO_i           RS-wgmma m64 n=d: P^T from the S^T accumulator's registers,
                                       dO_i read MN-major (transposed) from its TMA tile
  l.14   dS^T = P^T o (dP^T - D_i)     once dP^T has landed (dV still running)
  l.16   dK_j[w] += dS^T Q_i           RS-wgmma, dS^T from registers, Q_i MN-major
  l.15   dQ_i += dS K_j                needs every warpgroup's keys: dS^T is staged in shared memory
                                       (two buffers, alternate steps), the warpgroups meet at a
                                       named barrier, and warpgroup w computes its share of
                                       dS K_j (B_r = 64: columns [w d/W, (w+1) d/W); B_r = 128:
                                       the rows of queries 64 w..) with an SS-wgmma whose A (dS)
                                       is read M-major (imm-trans-a) and B (K_j) MN-major; its
                                       warps stage the fp32 product in shared memory and add it to
                                       dQ's accumulator in HBM with one bulk reduction each
                                       (cp.reduce.async.bulk .add.f32, as fa2's dq_reduce="bulk")
  release the stage (Q_i, dO_i, L_i, D_i) to the producer.
  l.17   dK_j = softmax_scale dK_j, dV_j written once the query blocks are done.
The producer warp loads K_j, V_j once, then for each step waits for a free stage, issues Q_i and
dO_i by TMA and copies L_i log2(e) and D_i (rows past N_q: +inf and 0, so P = 0 there) into the
stage with its 32 lanes; the stage's "full" mbarrier completes on the bytes and the 32 arrivals.

Masks: fa3's forward's, any band lo <= key - query <= hi (common/tile/masks.py: causal bottom-right
or top-left, sliding windows; the query blocks outside a K/V block's band are skipped, those on its
edges masked; a K/V block that no query sees writes dK_j = dV_j = 0), ragged N_q and N_k (TMA
fills zeros past the ends; rows past N_k are not stored). GQA: the block loops over its K/V head's query heads, accumulating dK_j, dV_j.
The order above is `early_dv` (d=128's default): dV issued as soon as P^T is ready, so that it
runs while dS is computed. Off (d=64's default, FA3's order), dV is issued with dK once dS is done:
P^T's registers are not live beside S^T's and dP^T's, which at B_r = 128 is what keeps ptxas from
serialising every wgmma (docs/performance/fa3_backward.md).
`dq_deferred` issues step i's dQ product with step i+1's S^T and dP^T instead (the dQ terms are
written out while dP^T runs): +1-3% at d=64, B_r=64; it holds 32 more registers, and ptxas spills
in the other configurations (docs/results/fa3_backward_h200.txt), so it is off by default.
Not yet: the warpgroups out of phase (FA3's ping-pong: one's softmax while the other's GEMMs run;
here they meet every step at the dS^T barrier), a persistent tile scheduler, softcap, FP8 (fa2's
backward takes softcap: `kernel="fa2"`).
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import ptx, sm90
from common.hardware.elements import BFLOAT16, Element
from common.hardware.target import MAX_SHARED_BYTES, device_function, kernel_for_one_block_per_sm
from common.host import configs, replay, tensormaps
from common.host.launching import launch
from common.host.problem import LSE_TYPE, OUT_TYPE, SCORE_TYPES, with_score_terms
from common.tile import masks, softmax, tiles
from common.tile.mbarrier_ring import ring
from variants import backward_shared as bwd

HEAD_DIMS = tuple(d for d in tiles.HEAD_DIMS if d <= 128)   # multiples of 8 from 32 to 128
WG_KEYS = 64            # keys of one consumer warpgroup: the M of wgmma.m64nNk16
WG_THREADS = 128
BARRIER_BYTES = 256     # room for 32 mbarriers ahead of the tiles
PANEL_COLS = sm90.PANEL_COLS
ROW_BYTES = sm90.SWIZZLE_BYTES
TMAP_TYPE = types.Array(types.uint64, 2, "C")
F32_3 = types.Array(types.float32, 3, "C")
F32_4 = types.Array(types.float32, 4, "C")


@dataclass(frozen=True)
class BackwardConfig:
    """Compile-time shape of the kernel: block_n = B_c (keys a thread block owns, 64 a consumer
    warpgroup), block_m = B_r (queries a step: the N of the S^T and dP^T wgmmas)."""
    head_dim: int
    element: Element
    causal: bool
    block_m: int = 64       # B_r: 64, or 128 with two consumer warpgroups (each then computes
                            # dQ's rows of its 64 queries, rather than half of dQ's columns)
    block_n: int = 128      # B_c: 64 per consumer warpgroup
    stages: int = 2         # Q_i / dO_i buffers in the ring (2: the copy of step i+1 overlaps step i)
    setmaxnreg: bool = True  # a producer warpgroup that gives its registers to the consumers
                             # (False: a producer warp beside them)
    dq_deferred: bool = False    # issue step i's dQ product with step i+1's S^T, dP^T (its terms
                                 # written out while dP^T runs) rather than at the end of step i
    early_dv: bool = True   # issue dV += P^T dO as soon as P^T is ready, so that it runs while dS
                            # is computed (P^T's registers live beside S^T's and dP^T's); False:
                            # with dK once dS is done (FA3's order, fewer registers at once)
    window: bool = False    # the band has a left edge (a sliding window): its test compiled in
    alibi: bool = False     # ALiBi's bias in the recomputed S^T (no term in dS)

    @property
    def consumers(self):
        return self.block_n // WG_KEYS

    @property
    def tile_dim(self):
        """Columns of the Q, K, V, dO tiles and of dQ's accumulator rows: head_dim in whole 64-column
        panels (as fa3's forward: TMA zero-fills the columns past head_dim, S^T and dP^T skip their
        k-steps, dK, dV and dQ's conversion leave them out)."""
        return sm90.panel_columns(self.head_dim)

    @property
    def threads(self):
        return WG_THREADS * (self.consumers + 1) if self.setmaxnreg else WG_THREADS * self.consumers + 32

    @property
    def registers(self):
        """(consumer, producer) registers a thread after setmaxnreg: 65536 a block."""
        return {1: (256, 56), 2: (240, 24)}[self.consumers]

    @property
    def dq_row_groups(self):
        """Consumer warpgroups across dQ_i's rows (B_r / 64); the others split its columns."""
        return self.block_m // 64

    def regions(self):
        """Byte offsets (from the 1024-aligned start of the tiles) and sizes of shared memory: K_j,
        V_j (TMA panels of B_c rows x 128 bytes), the stages' Q_i and dO_i (B_r-row panels), two
        dS^T buffers (B_c keys x B_r queries, panels of 64 queries), dQ's fp32 staging
        (B_r x d), the stages' L_i log2(e) and D_i (2 B_r floats each)."""
        d, br, bc = self.tile_dim, self.block_m, self.block_n
        sizes = [("k", bc * d * 2), ("v", bc * d * 2), ("qdo", self.stages * 2 * br * d * 2),
                 ("ds", 2 * bc * br * 2), ("dq", br * d * 4), ("stats", self.stages * 2 * br * 4)]
        out, at = {}, 0
        for name, size in sizes:
            out[name] = at
            at += size
        return out, at

    @configs.once_per_config
    def smem_bytes(self):   # the mbarriers, the worst-case alignment pad, the tiles
        return BARRIER_BYTES + sm90.SWIZZLE_ATOM_BYTES - 2 + self.regions()[1]

    @configs.once_per_config
    def dq_layout(self):
        """dQ's accumulator as the warps stage it: a query block's B_r x d floats contiguous, warp
        (row tile 4 r + v, column tile c) = warp v of the warpgroup in row group r, column group
        c, holding rows 16 (4 r + v).. and columns c d / (W / B_r * 64).. (variants/backward_shared.py:
        DqLayout)."""
        return bwd.DqLayout(rows=self.block_m, cols=self.tile_dim,
                            threads=WG_THREADS * self.consumers,
                            warps_across=self.consumers // self.dq_row_groups)

    def validate(self):
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"fa3's backward supports head_dim in multiples of 8 from 32 to 128, "
                             f"got {self.head_dim}")
        if self.block_m not in (64, 128) or self.consumers % self.dq_row_groups:
            raise ValueError(f"fa3's backward: block_m={self.block_m} must be 64, or 128 with "
                             "block_n=128 (two consumer warpgroups, one a 64-row half of dQ_i)")
        if self.block_n not in (64, 128):
            raise ValueError(f"fa3's backward: block_n={self.block_n} must be 64 or 128 (64 keys "
                             "a consumer warpgroup, one or two)")
        if (self.tile_dim * self.dq_row_groups // self.consumers) % 16:
            raise ValueError(f"fa3's backward: head_dim {self.head_dim} does not split into "
                             f"{self.consumers // self.dq_row_groups} dQ column blocks of a "
                             "multiple of 16")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"stages must be 1 to 4, got {self.stages}")
        if self.smem_bytes() > MAX_SHARED_BYTES:
            raise ValueError(f"fa3's backward block_n={self.block_n}, stages={self.stages} at "
                             f"head_dim {self.head_dim} needs {self.smem_bytes()} bytes of shared "
                             f"memory; the limit is {MAX_SHARED_BYTES}")
        return self


BACKWARD_OPTIONS = configs.options_of(BackwardConfig)
# Two consumer warpgroups of 64 keys (B_c = 128); B_r = 64 at d = 128 (194 KB of shared memory),
# 128 at d = 64, measured on an H200 (docs/results/fa3_backward_h200.txt, bf16, backward TFLOP/s at
# 1k / 4k / 16k, non-causal | causal):
#   d=64   B_r 64: 254 / 335 / 364 | 185 / 291 / 350;  + dq_deferred (its default then): +1-3%
#          B_r 128: 276 / 369 / 398 | 185 / 310 / 381;  + dq_deferred: 233 / 309 / 339 (spills)
#   d=128  B_r 64: 358 / 467 / 499 | 253 / 398 / 481;  + dq_deferred: 269 / 325 / 341 (spills:
#          dQ_{i-1}'s 32 registers beside S^T, dP^T, dK and dV's 192)
#   d=64, B_r 128 with early_dv (dV issued before dS is computed): ptxas serialises every wgmma
#          for want of registers (C7512: P^T's 32 beside S^T's and dP^T's 64 each); off, none:
#          289 / 419 / 462 | 207 / 364 / 449 (third run; with early_dv 275 / 367 / 398)
#   d=128  early_dv off: within 1% of on.
BACKWARD_DEFAULTS = {64: dict(block_m=128, block_n=128, early_dv=False),
                     128: dict(block_m=64, block_n=128)}
# the other head dims take the defaults of their tile (BackwardConfig.tile_dim: 96 runs in 128)
BACKWARD_DEFAULTS.update({d: BACKWARD_DEFAULTS[sm90.panel_columns(d)] for d in HEAD_DIMS
                          if d not in BACKWARD_DEFAULTS})
default_backward_config = configs.default_config_function(
    "fa3 backward", BackwardConfig, BACKWARD_DEFAULTS, BACKWARD_OPTIONS, HEAD_DIMS)


@lru_cache(maxsize=None)
def build_backward(cfg):
    """The kernel of one configuration."""
    D, BR, BC, STAGES, NWG = cfg.tile_dim, cfg.block_m, cfg.block_n, cfg.stages, cfg.consumers
    DV = cfg.head_dim if cfg.head_dim < D else 0   # valid columns of dK, dV's stores (0: all)
    ELEM, DTYPE, CAUSAL, WINDOW = cfg.element.code, cfg.element.ptx, cfg.causal, cfg.window
    ALIBI = cfg.alibi
    PANELS = D // PANEL_COLS
    ROW = ROW_BYTES // 2                        # a 128-byte row in 16-bit elements
    REG, _ = cfg.regions()
    K0, V0, QDO0, DS0 = REG["k"] // 2, REG["v"] // 2, REG["qdo"] // 2, REG["ds"] // 2
    DQF_BYTES, STATS_BYTES = REG["dq"], REG["stats"]
    Q_ELEMS = BR * D                            # a Q_i (or dO_i) tile; a stage holds both
    Q_BYTES, KV_BYTES = 2 * Q_ELEMS, 2 * BC * D
    DS_ELEMS = BC * BR
    CONSUMERS = WG_THREADS * NWG
    PRODUCER_WARP = 4 * NWG
    SETMAXNREG = cfg.setmaxnreg
    TAKE_REGISTERS = sm90.setmaxnreg("inc", cfg.registers[0])
    GIVE_REGISTERS = sm90.setmaxnreg("dec", cfg.registers[1])
    # mbarriers (8 bytes = 4 elements each): K_j and V_j landed; then the ring of Q_i, dO_i,
    # L_i, D_i (common/tile/mbarrier_ring.py), per stage full (lane 0's expect_tx and the
    # producer warp's 32 lanes) and empty (a consumer warp each).
    BAR_KV = 0
    QDO = ring(STAGES, 4, 4 + 4 * STAGES, 33, 4 * NWG)
    slot, init_ring, wait_full, release = QDO.slot, QDO.init, QDO.wait_full, QDO.release
    acquire, arm, full, arrive_full = QDO.acquire, QDO.arm, QDO.full, QDO.arrive_full
    DS_BARRIER = 1 + NWG                        # named: the warpgroups' dS^T halves are staged
    RG = cfg.dq_row_groups                      # warpgroups across dQ_i's rows (64 each)
    CG = NWG // RG                              # ... across its columns
    DQ_COLS = D // CG                           # dQ columns of a warpgroup
    DQF_WARP = BR * D // (4 * NWG)              # floats of one warp's dQ terms
    SBO = 8 * ROW_BYTES
    K_D = -(-cfg.head_dim // 16)                # k-steps of S^T, dP^T (16 of d each; none over
                                                # the tile's zero columns)
    K_Q = BR // 16                              # ... of dV, dK (16 queries each)
    K_K = BC // 16                              # ... of dQ (16 keys each)
    MMA_ST = sm90.wgmma_ss(BR, DTYPE)                      # S^T, dP^T   (m64 n=B_r k16)
    MMA_KV = sm90.wgmma_rs(D, DTYPE, True)                 # dV, dK      (m64 n=d, B transposed)
    MMA_DQ = sm90.wgmma_ss(DQ_COLS, DTYPE, True, True)     # dQ          (A and B transposed)
    WAIT1_ST = sm90.wgmma_wait(1, BR // 2)      # all but the last group (dP^T, or dV) landed
    WAIT0_ST = sm90.wgmma_wait(0, BR // 2)      # dP^T landed (nothing issued after it)
    WAIT_ALL = sm90.wgmma_wait(0, DQ_COLS // 2, D // 2, D // 2, 4 * K_Q, 4 * K_Q)  # the step's
    # dq_deferred: dQ_{i-1} and S^T (not dP^T); dK, dV and their A registers (dQ_i not issued
    # yet); the last step's dQ after the loop
    WAIT1_ST_DQ = sm90.wgmma_wait(1, BR // 2, DQ_COLS // 2)
    WAIT_KV = sm90.wgmma_wait(0, D // 2, D // 2, 4 * K_Q, 4 * K_Q)
    WAIT_DQ = sm90.wgmma_wait(0, DQ_COLS // 2)
    EARLY_DV, DQ_DEFERRED = cfg.early_dv, cfg.dq_deferred
    ST_ACC, KV_ACC, DQ_ACC, A_FRAG = (1, BR // 8, 4), (1, D // 8, 4), (1, DQ_COLS // 8, 4), \
        (1, K_Q, 4)

    @device_function
    def position(step, n_i, i0, h0):
        """(query head, query block) of a step: the group's heads outer, the blocks inner."""
        return h0 + step // n_i, i0 + step % n_i

    @device_function
    def transposed_scores(acc, a_desc, b_desc):
        """Issue acc = A B^T over d (S^T = K_j[w] Q_i^T, or dP^T = V_j[w] dO_i^T): A this
        warpgroup's 64 rows of a B_c-row tile, B a B_r-row tile, both K-major; one commit group."""
        for kk in range(K_D):
            MMA_ST(acc, sm90.descriptor_advance(a_desc, (kk >> 2) * BC * ROW_BYTES + (kk & 3) * 32),
                   sm90.descriptor_advance(b_desc, (kk >> 2) * BR * ROW_BYTES + (kk & 3) * 32), kk)
        sm90.wgmma_commit()

    @device_function
    def accumulate(acc, a, b_desc):
        """Issue acc += A B over B_r queries (dV += P^T dO_i, dK += dS^T Q_i): A from registers, B
        the stage's tile read MN-major; one commit group."""
        for kk in range(K_Q):
            MMA_KV(acc, a[0, kk, 0], a[0, kk, 1], a[0, kk, 2], a[0, kk, 3],
                   sm90.descriptor_advance(b_desc, kk * 16 * ROW_BYTES), 1)
        sm90.wgmma_commit()

    @device_function
    def dq_product(acc, ds_desc, k_desc):
        """Issue acc = dS K_j[:, this warpgroup's columns] over B_c keys: dS read M-major from
        the staged dS^T, K_j MN-major; one commit group."""
        for kk in range(K_K):
            MMA_DQ(acc, sm90.descriptor_advance(ds_desc, kk * 16 * ROW_BYTES),
                   sm90.descriptor_advance(k_desc, kk * 16 * ROW_BYTES), kk)
        sm90.wgmma_commit()

    @device_function
    def write_dq(smem_f32, dq_acc, dq, dqf, b, h, row, lane):
        """l.15's terms of this warp into dQ's fp32 accumulator in HBM: staged in the warp's slice
        of the dQ buffer (fragment order), added by one bulk reduction that lane 0 issues; `row`:
        the slice's first row of head h's (contiguous) accumulator."""
        if lane == 0:
            ptx.bulk_wait_read(0)   # the warp's previous reduction has read its slice
        ptx.syncwarp()
        tiles.stage_accumulator_fragments_f32(smem_f32[dqf:dqf + DQF_WARP], dq, lane)
        ptx.fence_proxy_async_shared()    # the copy engine reads what these stores wrote
        ptx.syncwarp()
        if lane == 0:
            ptx.bulk_reduce_add_f32(dq_acc[b, h], row, smem_f32, dqf, 4 * DQF_WARP)
            ptx.bulk_commit()

    @device_function
    def produce(smem, smem_f32, tiles0, tmaps, lse, d_vec, b, h_kv, h0, key0, i0, n_i, n_steps,
                n_q, lane):
        """The producer warp: K_j, V_j once (lane 0), then per step a free stage's Q_i, dO_i (lane
        0, TMA) and L_i log2(e), D_i (every lane, B_r / 32 rows each)."""
        if lane == 0:
            for m in range(4):
                sm90.tensormap_acquire(tmaps, m)
            sm90.mbarrier_arrive_expect_tx(smem, BAR_KV, 2 * KV_BYTES)             # l.6
            for p in range(PANELS):
                sm90.tma_load_4d(smem, tiles0 + K0 + p * BC * ROW, tmaps, 1, p * PANEL_COLS, key0,
                                 h_kv, b, smem, BAR_KV)
                sm90.tma_load_4d(smem, tiles0 + V0 + p * BC * ROW, tmaps, 2, p * PANEL_COLS, key0,
                                 h_kv, b, smem, BAR_KV)
        stats0 = (2 * tiles0 + STATS_BYTES) >> 2
        for step in range(n_steps):                                                # l.8
            h, i = position(step, n_i, i0, h0)
            stage, parity = slot(step)
            acquire(smem, step, stage, parity)   # released what it held STAGES steps ago
            if lane == 0:                                                          # l.9
                qdo = tiles0 + QDO0 + stage * 2 * Q_ELEMS
                arm(smem, stage, 2 * Q_BYTES)
                for p in range(PANELS):
                    sm90.tma_load_4d(smem, qdo + p * BR * ROW, tmaps, 0, p * PANEL_COLS, i * BR,
                                     h, b, smem, full(stage))
                    sm90.tma_load_4d(smem, qdo + Q_ELEMS + p * BR * ROW, tmaps, 3, p * PANEL_COLS,
                                     i * BR, h, b, smem, full(stage))
            st = stats0 + stage * 2 * BR
            for r in range(lane, BR, 32):
                row = i * BR + r
                if row < n_q:
                    smem_f32[st + r] = softmax.lse_log2(lse[b, h, row])
                    smem_f32[st + BR + r] = d_vec[b, h, row]
                else:
                    smem_f32[st + r] = float32(math.inf)
                    smem_f32[st + BR + r] = float32(0)
            arrive_full(smem, stage)

    @kernel_for_one_block_per_sm(cfg.threads)
    def fa3_backward_kv(tmaps, lse, d_vec, dq_acc, dk32, dv32, n_q, n_k, kv_group, lo, hi,
                        softmax_scale, scale_log2, alibi, alibi_stride, alibi_shift, sinks):
        """tmaps: (4, 16) tensor maps of q, k, v, do; lse, d_vec: (B, H, N_q); dq_acc: (B, H, N_q
        padded to B_r, d) fp32 in `dq_layout` order; dk32, dv32: (B, H_kv, N_k, d/2) uint32 views;
        lo, hi: the band of keys a query sees (lo <= key - query <= hi; causal, a window);
        alibi..sinks: the forward's score terms (sinks unread: L holds them). The grid: (K/V
        blocks, B, H_kv)."""
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31
        j, b, h_kv = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
        key0 = int32(j * BC)

        smem = cuda.shared.array(0, uint16)
        smem32 = cuda.shared.array(0, uint32)
        smem_f32 = cuda.shared.array(0, float32)
        base = sm90.shared_address(smem, 0)
        # the tiles start 1024-byte aligned (the swizzle's period), after the mbarriers
        aligned = (base + uint32(BARRIER_BYTES + 1023)) & uint32(0xFFFFFC00)
        tiles0 = int32(aligned - base) >> 1

        # l.8: the query blocks that see one of this block's keys (causal, a window: those of
        # its band; none, and dK_j = dV_j = 0, when no query sees its keys).
        i0, i1 = int32(0), int32((n_q + BR - 1) // BR)
        if CAUSAL:
            i0, i1 = masks.query_blocks(key0, BC, n_q, n_k, BR, lo, hi)
        n_i = max(int32(i1 - i0), int32(0))
        n_steps = int32(kv_group * n_i)
        h0 = int32(h_kv * kv_group)

        if tid == 0:
            sm90.mbarrier_init(smem, BAR_KV, 1)
            init_ring(smem)
            sm90.fence_mbarrier_init()
        cuda.syncthreads()

        if warp >= PRODUCER_WARP:
            if SETMAXNREG:
                GIVE_REGISTERS()
            if warp == PRODUCER_WARP:
                produce(smem, smem_f32, tiles0, tmaps, lse, d_vec, b, h_kv, h0, key0, i0, n_i,
                        n_steps, n_q, lane)
            return
        if SETMAXNREG:
            TAKE_REGISTERS()

        # ---- a consumer warpgroup: keys key0 + 64 wg .. + 63 of K_j, V_j
        wg, wg_warp = warp >> 2, warp & 3
        rg, cg = wg % RG, wg // RG     # its row group (queries 64 rg.. of dQ_i: dS^T's panel rg)
                                       # and column group of dQ_i
        # Descriptors of this warpgroup's operands, built once from addresses broadcast from lane
        # 0 (uniform registers, as fa3's forward), advanced by a step's offsets.
        kw_addr = ptx.broadcast_u32(sm90.shared_address(smem, tiles0 + K0 + wg * WG_KEYS * ROW))
        vw_addr = ptx.broadcast_u32(sm90.shared_address(smem, tiles0 + V0 + wg * WG_KEYS * ROW))
        qdo_addr = sm90.shared_address(smem, tiles0 + QDO0)
        ds_addr = ptx.broadcast_u32(sm90.shared_address(smem, tiles0 + DS0 + rg * BC * ROW))
        # this warpgroup's dQ columns (of K_j, MN-major: 64-column panels B_c x 128 bytes apart)
        c0 = cg * DQ_COLS
        kd_addr = ptx.broadcast_u32(sm90.shared_address(
            smem, tiles0 + K0 + (c0 // PANEL_COLS) * BC * ROW + c0 % PANEL_COLS))
        k_desc = sm90.smem_descriptor(kw_addr, 16, SBO)                # K-major A of S^T
        v_desc = sm90.smem_descriptor(vw_addr, 16, SBO)                # K-major A of dP^T
        qk_desc = sm90.smem_descriptor(qdo_addr, 16, SBO)             # K-major B: Q_i, dO_i
        qmn_desc = sm90.smem_descriptor(qdo_addr, BR * ROW_BYTES, SBO)   # MN-major B: Q_i, dO_i
        ds_desc = sm90.smem_descriptor(ds_addr, BC * ROW_BYTES, SBO)  # M-major A: dS (from dS^T)
        kd_desc = sm90.smem_descriptor(kd_addr, BC * ROW_BYTES, SBO)  # MN-major B: K_j's columns
        warp_key = wg * WG_KEYS + 16 * wg_warp          # this warp's first key in K_j
        stats0 = (2 * tiles0 + STATS_BYTES) >> 2
        dq_slice = (4 * rg + wg_warp) * CG + cg          # this warp's slice of a query block's dQ
        dqf = ((2 * tiles0 + DQF_BYTES) >> 2) + dq_slice * DQF_WARP
        dq_row = dq_slice * (DQF_WARP // D)              # ... its first row in the block

        dk = cuda.local.array(KV_ACC, float32)
        dv = cuda.local.array(KV_ACC, float32)
        s = cuda.local.array(ST_ACC, float32)
        dp = cuda.local.array(ST_ACC, float32)
        dq = cuda.local.array(DQ_ACC, float32)
        p = cuda.local.array(A_FRAG, uint32)
        ds = cuda.local.array(A_FRAG, uint32)
        tiles.fill(dk, float32(0))                                                 # l.7
        tiles.fill(dv, float32(0))
        sm90.mbarrier_wait(smem, BAR_KV, 0)

        # The tensor cores' queue a step: S^T, dP^T, then dV, dK, dQ. With `dq_deferred`: dQ of the
        # previous step (its dS^T is staged), S^T, dP^T, then dV, dK; so the dQ terms of step i-1
        # are written out while dP^T of step i runs. Either way nothing is in flight across the
        # loop's back edge (ptxas would serialise every wgmma).
        h_prev, q0_prev = h0, int32(0)
        for step in range(n_steps):                                                # l.8
            h, i = position(step, n_i, i0, h0)
            q0 = int32(i * BR)
            stage, parity = slot(step)
            stage_bytes = stage * 4 * Q_ELEMS                  # a stage: Q_i then dO_i
            st = stats0 + stage * 2 * BR
            buf = step & 1
            wait_full(smem, stage, parity)                                         # l.9
            sm90.wgmma_fence()
            if DQ_DEFERRED and step > 0:                       # l.15 of the previous step
                dq_product(dq, sm90.descriptor_advance(ds_desc, (1 - buf) * 2 * DS_ELEMS), kd_desc)
            transposed_scores(s, k_desc, sm90.descriptor_advance(qk_desc, stage_bytes))      # l.10
            transposed_scores(dp, v_desc,
                              sm90.descriptor_advance(qk_desc, stage_bytes + Q_BYTES))   # l.13
            if DQ_DEFERRED:
                WAIT1_ST_DQ(s, dq)            # dQ_{i-1} and S^T landed; dP^T may still run
                if step > 0:
                    write_dq(smem_f32, dq_acc, dq, dqf, b, h_prev, q0_prev + dq_row, lane)
            else:
                WAIT1_ST(s)                   # S^T landed; dP^T may still run
            if ALIBI:   # the forward's bias, S^T[key, query] -= slope |query + shift - key|
                tiles.add_alibi_transposed(s, key0 + warp_key - alibi_shift, q0,
                                           alibi[b * alibi_stride + h] / softmax_scale, lane)
            # pairs out of the band (past a query's diagonal, before its window) on its edges
            if CAUSAL and masks.block_is_partial(q0, BR, key0 + wg * WG_KEYS, WG_KEYS, n_k, True,
                                                 lo, hi, WINDOW):
                tiles.mask_scores_transposed(s, key0 + warp_key, n_k, q0, n_q, True, lo, hi,
                                             lane, WINDOW)
            softmax.recompute_p_columns(s, smem_f32[st:st + BR], lane, scale_log2)       # l.11
            if EARLY_DV:
                tiles.accumulator_to_a(p, s, ELEM)
                sm90.wgmma_fence()
                accumulate(dv, p, sm90.descriptor_advance(qmn_desc, stage_bytes + Q_BYTES))  # l.12
                WAIT1_ST(dp)                                  # dP^T landed; dV may still run
            else:
                WAIT0_ST(dp)                                  # dP^T landed
            softmax.grad_columns(s, dp, smem_f32[st + BR:st + 2 * BR], lane)             # l.14
            if not EARLY_DV:
                tiles.accumulator_to_a(p, s, ELEM)
            tiles.accumulator_to_a(ds, dp, ELEM)
            tiles.stage_accumulator_panels(
                smem32[(tiles0 + DS0) // 2 + buf * (DS_ELEMS // 2):
                       (tiles0 + DS0) // 2 + (buf + 1) * (DS_ELEMS // 2)], dp, warp_key, lane, BC,
                ELEM)
            sm90.wgmma_fence()
            if not EARLY_DV:
                accumulate(dv, p, sm90.descriptor_advance(qmn_desc, stage_bytes + Q_BYTES))  # l.12
            accumulate(dk, ds, sm90.descriptor_advance(qmn_desc, stage_bytes))          # l.16
            # every warpgroup's dS^T is staged (and visible to the tensor cores' async proxy)
            # for l.15's product: this warpgroup's columns of dS K_j, now or at the next step
            ptx.fence_proxy_async_shared()
            ptx.bar_sync(DS_BARRIER, CONSUMERS)
            if DQ_DEFERRED:
                WAIT_KV(dk, dv, p, ds)
            else:
                sm90.wgmma_fence()
                dq_product(dq, sm90.descriptor_advance(ds_desc, buf * 2 * DS_ELEMS), kd_desc)
                WAIT_ALL(dq, dk, dv, p, ds)
            release(smem, stage, lane)   # Q_i, dO_i, L_i, D_i read for the last time
            if not DQ_DEFERRED:
                write_dq(smem_f32, dq_acc, dq, dqf, b, h, q0 + dq_row, lane)
            h_prev, q0_prev = h, q0
        if DQ_DEFERRED and n_steps > 0:                                            # l.15, the last
            sm90.wgmma_fence()
            dq_product(dq, sm90.descriptor_advance(ds_desc, ((n_steps - 1) & 1) * 2 * DS_ELEMS),
                       kd_desc)
            WAIT_DQ(dq)
            write_dq(smem_f32, dq_acc, dq, dqf, b, h_prev, q0_prev + dq_row, lane)

        # l.17: dK_j = softmax_scale dK_j and dV_j, staged in K_j's and V_j's room once every
        # warpgroup is done reading them (the last dQ product reads all of K_j).
        if lane == 0:
            ptx.bulk_wait(0)
        ptx.bar_sync(DS_BARRIER, CONSUMERS)
        tiles.scale_accumulator(dk, softmax_scale)
        k32 = smem32[(tiles0 + K0) // 2:(tiles0 + K0 + BC * D) // 2]
        v32 = smem32[(tiles0 + V0) // 2:(tiles0 + V0 + BC * D) // 2]
        tiles.stage_accumulator(k32, dk, warp_key, lane, D, True, ELEM)
        tiles.stage_accumulator(v32, dv, warp_key, lane, D, True, ELEM)
        ptx.bar_sync(DS_BARRIER, CONSUMERS)
        tiles.store_tile(dk32[b, h_kv], k32, key0, n_k, BC, D, D, True, tid, CONSUMERS, DV)
        tiles.store_tile(dv32[b, h_kv], v32, key0, n_k, BC, D, D, True, tid, CONSUMERS, DV)

    return fa3_backward_kv


@replay.replayed(6)
def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
             softcap=0.0, align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, grads=None,
             **options):
    """fa3's backward (Hopper, sm_90a): (dq, dk, dv) shaped like (q, k, v) from the forward's inputs,
    o, lse and dO (like o), fp16 or bf16, head_dim a multiple of 8 from 32 to 128 (in tiles of
    64 or 128 columns); the score terms as the forward's (with sinks, a fourth gradient: d sinks
    (H,) fp32). options: BackwardConfig's."""
    g = bwd.prepare_backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                             grads=grads, head_dims=HEAD_DIMS, variant="fa3",
                             window_size=window_size, softcap=softcap, align=align)
    prob = with_score_terms(g.prob, alibi_slopes, sinks, align)
    if prob.softcapped:
        raise ValueError(f"fa3's backward (kernel='wgmma') takes causal masks and sliding windows "
                         f"but no softcap yet (got softcap={prob.band.softcap}); kernel='fa2' "
                         "(FA2's backward, the default with a softcap) takes it")
    cfg = default_backward_config(prob.head_dim, prob.element, prob.banded,
                                  configs.mask_fields(prob, backward=True), **options)
    bwd.preprocess(g, zero_dq=True, dq_layout=cfg.dq_layout())                   # l.4
    box = PANEL_COLS
    boxes = ((prob.q, cfg.block_m, box), (prob.k, cfg.block_n, box), (prob.v, cfg.block_n, box),
             (g.do, cfg.block_m, box))
    tmaps = replay.derived(tensormaps.tensor_maps, boxes, prob.stream)   # made anew in a replay
    grid = ((prob.n_k + cfg.block_n - 1) // cfg.block_n, prob.batch, prob.heads_kv)
    launch(build_backward(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream,
           tmaps, prob.lse, g.d_vec, g.dq_acc, g.dk32, g.dv32, np.int32(prob.n_q),
           np.int32(prob.n_k), np.int32(prob.kv_group), np.int32(prob.band.lo),
           np.int32(prob.band.hi), np.float32(prob.softmax_scale),
           np.float32(prob.softmax_scale * math.log2(math.e)), *prob.score_args())
    bwd.convert_dq(g)
    return g.result() if prob.sinks is None else g.result() + (bwd.sink_grad(g),)


def compile_targets():
    """(name, kernel, argument types, wgmma count in its PTX) of the default configurations, bf16
    (fp16 changes only the wgmma type): S^T, dP^T d/16 each, dV, dK B_r/16 each, dQ B_c/16."""
    argtypes = (TMAP_TYPE, LSE_TYPE, F32_3, F32_4, OUT_TYPE, OUT_TYPE) + (types.int32,) * 5 + \
        (types.float32, types.float32) + SCORE_TYPES
    for head_dim in (64, 128):   # the tiles' two widths; the head dims between take their code
        for causal in (False, True):
            cfg = default_backward_config(head_dim, BFLOAT16, causal)
            # deferred, the dQ product is issued in the loop and once more after it
            count = 2 * head_dim // 16 + 2 * cfg.block_m // 16 + \
                (2 if cfg.dq_deferred else 1) * cfg.block_n // 16
            yield f"fa3 backward d={head_dim} bf16 causal={causal}", build_backward(cfg), \
                argtypes, count

