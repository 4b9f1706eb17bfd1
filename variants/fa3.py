"""FlashAttention-3 forward (Shah et al. 2024, Algorithm 1) on Hopper: asynchronous warpgroup MMAs
(wgmma) on shared-memory descriptors, K/V brought in by the bulk tensor copy engine (TMA) into a
ring of stages guarded by mbarriers, and warp specialisation (a producer that only copies, consumer
warpgroups that only compute).

What makes it FA3 rather than FA2 (variants/fa2.py):
- the GEMMs are wgmma: a warpgroup (4 warps, 128 threads) owns 64 query rows and issues
  m64n{B_c}k16 for S = Q K^T with both operands read by the tensor cores from shared memory through
  matrix descriptors (no ldmatrix, no A/B fragments in registers), and m64n{d}k16 for O += P~ V
  with P~ from registers (the register-A form) and V read transposed from shared memory;
- the loads are TMA: one thread issues a whole 64-column panel of a tile per instruction (the
  copy engine computes addresses, zero-fills past the end of the sequence and lands the tile in
  the 128-byte swizzle the descriptors read); completion is counted in bytes on an mbarrier;
- warp specialisation (Alg.1's producer/consumer split): the producer (one thread of its warp)
  waits for a stage's K (then V) buffer to be released (its "empty" mbarrier), then issues K_j
  (V_j) into it (the "full" mbarriers); the consumer warpgroups wait on "full", compute, and
  release K once S_j has landed, V once O has. With `stages` buffers the copies run up to
  stages - 1 blocks ahead of the compute, with no block-wide barrier in the loop.
  `setmaxnreg=True`: the producer is a whole warpgroup that drops to 24 registers a thread so
  that the consumers may take 240 (FA3's split; 40 and 224 for the cp.async producer); False: a
  producer warp beside them (288 threads, at most 168 registers each: ptxas budgets registers by
  warpgroup).

Alg.1 of the FA3 paper, with its line numbers (producer: l.3-9; consumer: l.10-22):
  producer  l.5  load Q_i;  l.6-8  for j: wait for stage j % s to be released, load K_j, V_j
  consumer  l.13 wait for Q_i;  l.14-19  for j: wait for K_j, S = Q_i K_j^T (SS-GEMM), m_i,
            P~_i, l_i, rescale O_i; wait for V_j; O_i += P~_i V_j (RS-GEMM); release the stage;
            l.20-22  O_i = diag(l_i)^-1 O_i, L_i = m_i + log l_i, write O_i and L_i.

Scheduling (FA3 section 3.1-3.2), each a switch:
- `pingpong` (inter-warpgroup overlap): the consumer warpgroups take turns at the tensor cores. A
  turn is "issue O += P~_{j-1} V_{j-1}, then S_j = Q K_j^T" (`back_to_back`; False: wait for O
  before issuing S_j); named barriers pass the
  turn round the warpgroups (bar.sync to take it, bar.arrive to hand it on), so that one
  warpgroup's softmax runs while the tensor cores do the next one's GEMMs instead of all of them
  computing exponentials at once with the tensor cores idle.
- `intra_overlap` (FA3's Alg.2): the softmax of block j while the P V wgmma of block j-1 runs in
  the same warpgroup. With ping-pong on it gains nothing on average at d=64 and 128
  (docs/performance/fa3_forward.md, "fa3: the Hopper forward"), so it is off there; at d=256 it is what pays (+10-24%), on.
FP8 (FA3 section 3.3; e4m3 q, k, v with descale factors, `forward(..., q_descale=...)`): the same
kernel with k32 e4m3 wgmmas (twice the tensor-core rate), P~ converted to e4m3 in registers
(`tiles.accumulator_to_a_e4m3`) and V read K-major from V^T made by a pre-pass
(`variants/fp8.py: v_k_major`) or by the producer (below). The descales fold into the softmax scale
(Q: one a warpgroup; K: one a head, or one a key block, folded into the online softmax's max and
exponent scale), V's into O's final 1/l; P~ is computed as 2^P_LOG2_SHIFT P so that it stays clear
of e4m3's underflow, a factor l takes out again. B_c is a multiple of 32 (k32 steps) from 128 to 256: V_j^T's room is whole
128-key panels (`kv_rows`; K_j's is B_c rows), so at B_c = 160..224 its last panel also lands keys
that no wgmma reads. FA3's FP8 tile is 224 keys with the intra-warpgroup overlap (its registers
fit there and not at 256); here 256 without it measured fastest (DEFAULTS).
Persistence (`persistent`, FA3's tile scheduler): a block a SM, each looping over its share of the
(query block, batch, head) tiles, so that the producer loads the next tile's Q and first K/V
blocks while the consumers finish this one and write its O. Causal tiles are dealt in pairs of
equal work (query blocks i and n - 1 - i of one head), so that a head's tiles run side by side and
share its K and V in L2 (`Config.work_items`).
`producer` (the copies, the other setting of FA3's TMA): "cp_async" has every producer thread
issue 16-byte cp.async copies to the swizzled addresses it computes and signal a stage's full
mbarrier with cp.async.mbarrier.arrive, the consumers fencing the generic-proxy writes for wgmma
(0.81-0.91x TMA on an H200: the copies' address arithmetic takes the consumers' issue slots).
Masks: any band lo <= key - query <= hi (common/tile/masks.py: causal bottom-right or top-left, sliding
windows): a tile visits the K/V blocks of its rows' band, masks those on its edges, and a tile
that sees no key (bottom-right, N_q > N_k) runs no step: O = 0, LSE = -inf. softcap (Gemma 2,
16-bit inputs): S <- cap tanh(S / cap) before the mask; its backward is FA2's.
Packed batches (`forward_varlen`, flash_attn_varlen_func's arguments, 16-bit): a tile of sequence
b reads its bounds from cu_seqlens and its rows from the packed tensors at the sequence's offset;
tiles past a sequence's end are skipped by the producer and the consumers alike. Its backward is
FA2's (`backward_varlen`). With the TMA producer a sequence's last key block, when it runs past
the sequence's end, holds the next sequence's rows (TMA zero-fills past the packed tensor only):
their scores are masked (P = 0), and, since 0 x inf = NaN in P V, the consumers zero those V rows
in shared memory before that block's P V wgmma (`clear_v_tail`: the stores, a proxy fence and a
warpgroup barrier run for a partial block only), so that an inf or NaN in one sequence's V stays
out of the others' outputs. producer="cp_async" zero-fills past each sequence in its copies, as
fa2 does (tests/test_varlen.py).
head_dim: every multiple of 8 from 32 to 256, in tiles of whole 64-column panels (`Config.tile_dim`:
d=96 in 128 columns, 160 in 192) whose columns past d the copies zero-fill (TMA: past the tensor
map's innermost dimension, so no HBM traffic); S = Q K^T takes only the k-steps of d, O += P~ V
all of the tile's (FA3's own kernel takes d=96 in a 64-byte swizzle instead) and O's store leaves
the zero columns out. d=256: B_c = 80 so that two K/V stages fit beside Q, O staged in Q's room,
both overlaps; d=192: three panels a tile, B_c = 112, FA3's own. fa3's own backward takes d up to
128 in the same tiles of whole panels (variants/fa3_backward.py); past 128 it is FA2's.
V^T without the pre-pass (`transpose_v="producer"`, FA3's in-kernel transpose): TMA brings V_j as it
is into staging buffers and three producer warps write V_j^T into the ring (ldmatrix.trans, PRMT,
stmatrix: `fp8.unit_transposer`; d=128), bit for bit the pre-pass's tile; 0.91-1.02x the pre-pass
path on an H100 (docs/performance/fp8.md, "V transposed in the kernel"), so the pre-pass stays the default.
Still to come: a TMA store of O.
"""
import math
from collections import namedtuple
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import ptx, sm90, target
from common.hardware.elements import BFLOAT16, E4M3_FN, FLOAT16, Element
from common.hardware.stamps import stamper
from common.hardware.target import MAX_SHARED_BYTES, device_function, kernel_for_one_block_per_sm
from common.host import arrays, configs, replay, tensormaps
from common.host.launching import launch
from common.host.mods import with_mods
from common.host.problem import (
    FP8_DTYPES,
    HALF_DTYPES,
    LSE_TYPE,
    MOD_TYPES,
    OUT_TYPE,
    QKV_TYPE,
    SCORE_TYPES,
    SEQS_TYPE,
    prepare,
    prepare_varlen,
    with_score_terms,
)
from common.tile import masks, mods, softmax, tiles
from common.tile.mbarrier_ring import ring
from common.tile.pingpong import turns
from common.tile.scheduler import divider, divmod_by, tile_scheduler, work_items
from variants import fp8

HEAD_DIMS = tiles.HEAD_DIMS     # multiples of 8 from 32 to 256, in tiles of whole 64-column panels
PRODUCERS = ("tma", "cp_async")
O_STORES = ("threads", "bulk", "tma")
O_BULK_PAD = 8          # o_store="bulk": O's staged rows 8 elements (16 bytes) apart beyond d, so
                        # that the staging's 4-byte stores of a warp fall in 32 distinct banks
FP8_HEAD_DIMS = (128, 256)   # d=64 has 64-byte e4m3 rows: the 64-byte swizzle, not modelled yet
P_LOG2_SHIFT = 8        # FP8: P~ = 2^8 exp(S - m) in [0, 256]: the smallest probabilities that
                        # matter (~2^-8 of a row's largest) land on e4m3 normals (>= 2^-6), not
                        # subnormals (FA3.md: "P scaled before its cast to e4m3")
WG_ROWS = 64            # query rows of one consumer warpgroup: the M of wgmma.m64nNk16
WG_THREADS = 128
BARRIER_BYTES = 256     # room for 32 mbarriers ahead of the tiles (22 at 4 stages)
TRANSPOSE_V = ("prepass", "producer")
V_UNIT = fp8.V_UNIT_KEYS   # keys of V the producer transposes at a time: one 128-byte-wide
                           # panel of V^T (a k32 wgmma step reads 32 of its keys)
TRANSPOSERS = 3         # producer warps that transpose V (the fourth issues the copies)
TMAP_TYPE = types.Array(types.uint64, 2, "C")
SCALES_TYPE = types.Array(types.float32, 3, "C")
COMPILE_CC = (9, 0, "a")   # wgmma and setmaxnreg: sm_90a (experiments/compile_report.py)


@dataclass(frozen=True)
class Config:
    """Compile-time shape of the kernel. block_m = B_r (64 per consumer warpgroup), block_n = B_c."""
    head_dim: int
    element: Element        # the 16-bit type of the inputs, or of the output for FP8 inputs
    causal: bool
    fp8: bool = False       # e4m3 inputs (k32 wgmmas, V read K-major: V^T)
    k_block_scales: bool = False   # FP8: K's descale varies by key block (one factor a block)
    block_m: int = 128      # B_r: 64 query rows per consumer warpgroup
    block_n: int = 128      # B_c: keys per step (the N of the QK^T wgmma)
    stages: int = 2         # K/V buffers in the ring (2: the copy of K_{j+1}, V_{j+1} overlaps step j)
    intra_overlap: bool = False  # softmax of S_j overlaps O += P~_{j-1} V_{j-1} (FA3 Alg.2)
    setmaxnreg: bool = True      # a producer warpgroup that gives its registers to the consumers
    pingpong: bool = True        # named barriers make the consumer warpgroups take turns at the
                                 # tensor cores (no effect with one consumer warpgroup)
    back_to_back: bool = False   # a turn issues O += P~_{j-1} V_{j-1} and S_j = Q K_j^T with no
                                 # wait between (FA3's ping-pong); False: O is waited for first
    persistent: bool = True      # one block a SM loops over the tiles (FA3's tile scheduler): the
                                 # producer loads the next tile's Q, K, V during this one's epilogue
    producer: str = "tma"        # how the producer copies Q, K, V: "tma" (one thread issues bulk
                                 # tensor copies, counted in bytes on the full mbarriers) or
                                 # "cp_async" (each producer thread issues 16-byte cp.async copies
                                 # to swizzled addresses it computes, and signals the full mbarrier
                                 # when they land: cp.async.mbarrier.arrive)
    window: bool = False         # the band has a left edge (a sliding window): its test compiled in
    softcap: bool = False        # scores soft-capped (Gemma 2): S <- cap tanh(S / cap) (16-bit)
    alibi: bool = False          # ALiBi's bias by distance (alibi_slopes; 16-bit)
    sinks: bool = False          # an attention sink a head (gpt-oss; 16-bit)
    mods: object = None          # a user's score_mod / mask_mod (common/host/mods.py ScoreMods;
                                 # 16-bit), applied to S_j after the soft cap and ALiBi
    varlen: bool = False         # a packed batch of sequences (forward_varlen): bounds per tile
    bottom_right: bool = True    # varlen: the band's diagonal at each sequence's bottom-right
    transpose_v: str = "prepass" # FP8: who makes V^T, the K-major V that the e4m3 P V wgmma
                                 # reads: "prepass" (a kernel before, fp8.v_k_major, V^T in HBM)
                                 # or "producer" (FA3's: TMA brings V_j as it is into a staging
                                 # buffer, three producer warps transpose it into the ring's V^T
                                 # tile: no pre-pass, no V^T in HBM)
    v_staging: int = 2           # transpose_v="producer": staging buffers of V_UNIT keys (TMA
                                 # fills one while the transposers empty another)
    pdl: bool = True             # transpose_v="prepass": the kernel is launched as a programmatic
                                 # dependent of V's pre-pass (PDL, `after_prepass`): its blocks
                                 # start as the pre-pass's last blocks run, load Q_i and K_j, and
                                 # wait for the pre-pass's end (griddep_wait) only before their
                                 # first V_j^T; False: an ordinary launch, after the pre-pass ends
    poly_exp2: int = 0           # the exponentials of one 8-key column group of S in every
                                 # poly_exp2 by a polynomial on the FMA units (FA4's software exp2,
                                 # ptx.ex2_poly) instead of the MUFU unit; 0: all on the MUFU
    o_store: str = "threads"     # how O_i leaves shared memory: "threads" (16-byte loads and
                                 # stores by every consumer thread); "bulk" (the copy engine, one
                                 # bulk copy a row, no tensor map; rows staged unswizzled at a
                                 # padded pitch in O's own room, o_apart); or "tma" (FA3's
                                 # epilogue: a TMA tensor store a 64-column panel, issued by one
                                 # thread of the warpgroup, O staged as the map's swizzled box;
                                 # o_apart, not varlen; O's tensor map is made per output address,
                                 # as Q's, K's and V's are per input: tensormaps.tensor_maps'
                                 # CUDA-graph rule applies to the output too)

    @property
    def consumers(self):
        return self.block_m // WG_ROWS

    @property
    def tile_dim(self):
        """Columns of the Q, K, V tiles: head_dim in whole 128-byte panels (sm90.panel_columns: 96
        in 128, 40 in 64). The copies zero-fill the columns past head_dim (TMA: past its tensor
        map's innermost dimension), QK^T skips the k-steps that hold only zeros, P V computes
        zero columns of O that the store leaves out."""
        return sm90.panel_columns(self.head_dim, self.operand.bytes)

    @property
    def threads(self):   # the consumer warpgroups, then the producer warp (or warpgroup)
        return WG_THREADS * (self.consumers + 1) if self.setmaxnreg else WG_THREADS * self.consumers + 32

    @property
    def scheduled(self):
        """Ping-pong in effect: it orders two or more consumer warpgroups."""
        return self.pingpong and self.consumers > 1

    @property
    def cp_async(self):
        return self.producer == "cp_async"

    @property
    def producer_threads(self):
        """Threads that issue copies: one (TMA), or every thread of the producer warpgroup (warp
        without setmaxnreg) for cp.async, whose copies are 16 bytes each."""
        if not self.cp_async:
            return 1
        return WG_THREADS if self.setmaxnreg else 32

    @property
    def registers(self):
        """(consumer, producer) registers a thread after setmaxnreg (FA3's split): 65536 a block,
        a multiple of 8, the producer warpgroup down to what issuing copies needs (cp.async's
        address arithmetic: FA3 gives it 40 with two consumer warpgroups)."""
        if self.cp_async and self.consumers == 2:
            return 224, 40
        if self.v_in_producer and self.consumers == 2:
            # transpose_v="producer": three of its warps transpose V (fp8.unit_transposer); on 24
            # registers ptxas spilled 220 bytes there, on 40 it spills 36 (56 causal; and the
            # consumers, on 232, one value outside their K/V loop)
            return 232, 40
        return {1: (256, 56), 2: (240, 24), 3: (160, 32)}[self.consumers]

    @property
    def operand(self):
        """The element type of Q, K, V as the wgmmas read them: e4m3 with fp8, else `element`."""
        return E4M3_FN if self.fp8 else self.element

    @property
    def paired(self):
        """Causal tiles dealt in pairs (persistent): see `work_items`."""
        return self.causal and self.persistent

    def work_items(self, n_blocks, batch_heads):
        """What the persistent blocks are dealt in turn (`work_items`, the same in the kernel)."""
        return work_items(n_blocks, batch_heads, self.paired)

    @property
    def v_in_producer(self):
        """FP8 with V transposed by the producer warpgroup (`transpose_v="producer"`)."""
        return self.fp8 and self.transpose_v == "producer"

    @property
    def after_prepass(self):
        """FP8 with V's pre-pass, launched as its programmatic dependent (`pdl`): the producer
        waits for the pre-pass's end before its first copy of V^T."""
        return self.fp8 and not self.v_in_producer and self.pdl

    @property
    def staging_units(self):
        """Staging buffers of V_UNIT keys for the producer's transpose of V (`v_staging`), none
        without it."""
        return self.v_staging if self.v_in_producer else 0

    @property
    def kv_rows(self):
        """Rows of room a V_j tile takes: B_c, or in FP8 B_c rounded up to whole 128-key panels of
        V_j^T (a V^T box is 128 keys wide; with B_c = 192 its second panel also lands the next
        block's first 64 keys, which no wgmma reads). K_j's room is B_c rows."""
        return -(-self.block_n // V_UNIT) * V_UNIT if self.fp8 else self.block_n

    def ring_bytes(self):
        """Q_i's room (16-bit-sized in FP8 too: O_i may be staged there) and the stages x (K_j,
        V_j) after it; each tile panels of rows x 128 bytes (Q: per warpgroup, 64 rows a panel;
        FP8's V_j is V_j^T: d rows x 128 keys a panel), B_c rows for K_j, `kv_rows` for V_j."""
        return (2 * self.block_m + self.stages * (self.block_n + self.kv_rows)
                * self.operand.bytes) * self.tile_dim

    def unit_bytes(self):
        """A staging buffer of the producer's transpose: V_UNIT keys of V as TMA lands them (rows
        of head_dim e4m3 bytes, in 128-byte panels)."""
        return V_UNIT * self.tile_dim * self.operand.bytes

    @staticmethod
    def _fixed_bytes():   # the mbarriers and the worst-case alignment pad before the tiles
        return BARRIER_BYTES + sm90.SWIZZLE_ATOM_BYTES - 2

    @property
    def o_pitch(self):
        """Elements from one staged row of O_i to the next: the tile's (swizzled 16-byte chunks),
        or for o_store="bulk" unswizzled rows O_BULK_PAD further apart (the bulk copy reads a row
        as it lies)."""
        return self.tile_dim + (O_BULK_PAD if self.o_store == "bulk" else 0)

    @property
    def o_apart(self):
        """O_i is staged for its store in a room of its own after the ring when that fits (beside
        the staging buffers of V, when the producer transposes it), so that Q_{i+1} may land while
        O_i is written (persistent); else in Q_i's room, which is then released only after the
        store."""
        return (self._fixed_bytes() + self.ring_bytes() + self.staging_units * self.unit_bytes()
                + 2 * self.block_m * self.o_pitch) <= MAX_SHARED_BYTES

    def o_room_bytes(self):
        return 2 * self.block_m * self.o_pitch if self.o_apart else 0

    def tile_bytes(self):
        """Bytes of the tiles after the first 1024-aligned byte past the mbarriers: Q_i at 0, the
        K/V ring, O_i's staging room when it has its own (`o_apart`), then the staging buffers
        of V for the producer's transpose (`staging_units`)."""
        return self.ring_bytes() + self.o_room_bytes() + self.staging_units * self.unit_bytes()

    @configs.once_per_config
    def smem_bytes(self):   # the mbarriers, the worst-case alignment pad, the tiles
        return self._fixed_bytes() + self.tile_bytes()

    def validate(self):
        tiles.check_head_dim(self.head_dim, "fa3", HEAD_DIMS)
        if self.fp8 and self.head_dim not in FP8_HEAD_DIMS:
            raise ValueError(f"fa3 in FP8 supports head_dim in {FP8_HEAD_DIMS}, got "
                             f"{self.head_dim}")
        if self.fp8 and (self.block_n % 32 or not 128 <= self.block_n <= 256):
            raise ValueError(f"fa3 in FP8: block_n={self.block_n} must be a multiple of 32 from 128 "
                             "to 256 (whole k32 steps of the e4m3 P V wgmma; V^T's tile is whole "
                             "128-key panels)")
        if self.block_m % WG_ROWS or not 1 <= self.block_m // WG_ROWS <= 3:
            raise ValueError(f"block_m={self.block_m} must be 64, 128 or 192 (64 rows a consumer "
                             "warpgroup, at most 3)")
        if self.consumers == 3 and self.tile_dim > 64:
            raise ValueError(f"block_m=192 (three consumer warpgroups) does not fit head_dim "
                             f"{self.head_dim} (a {self.tile_dim}-column tile): its O and S accumulators and P~ (160 registers) "
                             "leave nothing of the 160 a consumer thread gets (152 without "
                             "setmaxnreg)")
        if self.block_n % 16 or not 64 <= self.block_n <= 256:
            raise ValueError(f"block_n={self.block_n} must be a multiple of 16 from 64 to 256 (the "
                             "N of the S wgmma, whole k16 steps of the P V wgmma, whole 8-row "
                             "swizzle atoms of the K and V tiles)")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"stages must be 1 to 4, got {self.stages}")
        if self.producer not in PRODUCERS:
            raise ValueError(f"producer must be one of {PRODUCERS}, got {self.producer!r}")
        if self.softcap and self.fp8:
            raise ValueError("fa3 in FP8 takes no softcap (the cap applies to descaled scores)")
        if (self.alibi or self.sinks) and self.fp8:
            raise ValueError("fa3 in FP8 takes no alibi_slopes or sinks yet (16-bit inputs do)")
        if self.transpose_v not in TRANSPOSE_V:
            raise ValueError(f"transpose_v must be one of {TRANSPOSE_V}, got {self.transpose_v!r}")
        if self.transpose_v == "producer" and not self.fp8:
            raise ValueError("transpose_v='producer' is for FP8 (e4m3) inputs: 16-bit V is read "
                             "as it is (the wgmma transposes 16-bit B operands itself)")
        if not 0 <= self.poly_exp2 <= self.block_n // 8:
            raise ValueError(f"poly_exp2 must be 0 (off) to block_n / 8 = {self.block_n // 8} (one "
                             f"8-key column group in every poly_exp2), got {self.poly_exp2}")
        if self.o_store not in O_STORES:
            raise ValueError(f"o_store must be one of {O_STORES}, got {self.o_store!r}")
        if self.o_store != "threads" and not self.o_apart:
            raise ValueError(
                f"o_store={self.o_store!r} needs O's own staging room (o_apart), which does not "
                f"fit in {MAX_SHARED_BYTES} bytes beside this configuration's ring (block_m="
                f"{self.block_m}, block_n={self.block_n}, stages={self.stages}, head_dim "
                f"{self.head_dim}); use o_store='threads', fewer stages or a smaller block_n")
        if self.o_store == "tma" and self.varlen:
            raise ValueError("o_store='tma' stores whole boxes of rows, clipped at the packed "
                             "tensor's end only: in a packed batch (varlen) they would write over "
                             "the next sequence's rows; use o_store='threads' or 'bulk'")
        if not 1 <= self.v_staging <= 4:
            raise ValueError(f"v_staging must be 1 to 4, got {self.v_staging}")
        if self.v_in_producer and self.head_dim != 128:
            raise ValueError(
                f"transpose_v='producer' is for head_dim 128, got {self.head_dim}: at 256 the "
                "consumers' 240 registers leave the transposing warps 24, on which ptxas spills "
                "680 bytes (416 of stack), and 232 make it serialise the consumers' wgmmas; use "
                "transpose_v='prepass'")
        if self.v_in_producer and not self.setmaxnreg:
            raise ValueError("transpose_v='producer' needs the producer warpgroup "
                             "(setmaxnreg=True): three of its warps transpose V")
        if self.cp_async and self.fp8:
            raise ValueError("fa3 in FP8 copies with TMA only (producer='tma'): V^T's zero "
                             "fill past the last key is the copy engine's")
        if self.smem_bytes() > MAX_SHARED_BYTES:
            staging = f", v_staging={self.v_staging}" if self.v_in_producer else ""
            raise ValueError(f"fa3 block_m={self.block_m}, block_n={self.block_n}, stages="
                             f"{self.stages}{staging} at head_dim {self.head_dim} needs "
                             f"{self.smem_bytes()} bytes of shared memory; the limit is "
                             f"{MAX_SHARED_BYTES}")
        return self


OPTIONS = configs.options_of(Config)

# B_r = 128 (two consumer warpgroups), B_c = 128, two stages: FA3's own tile for head_dim 128
# (flash_attn/cute flash_fwd_sm90); 160 KB of shared memory at d=128. The schedule, measured on an
# H100 (docs/results/fa3_pingpong_h100.txt: bf16, TFLOP/s at 4k / 16k, non-causal | causal):
#   d=128  ping-pong 645 / 612 | 545 / 582;  both 589 / 628 | 553 / 603;
#          intra_overlap 623 / 619 | 545 / 610;  neither 552 / 571 | 504 / 563
#   d=64   ping-pong 444 / 459 | 378 / 443;  both 429 / 450 | 377 / 443;  neither 423 / 455
# Either overlap is worth 8-17% at d=128; the three ways of having one are within 1% of each other
# on average. Ping-pong alone is the default: the best at 4k non-causal and at d=64.
# Since the persistent scheduler (docs/results/fa3_persistent_h100.txt, same run, TFLOP/s at
# 1k / 4k / 16k, d=128 non-causal): persistent 553 / 609 / 621 against 478 / 617 / 586; the
# intra-warpgroup overlap on top 563 / 630 / 622; back_to_back 550 / 580 / 610 (slower: O waited
# for inside the turn is the default). d=64 non-causal: B_r = 192 (three consumer warpgroups, as
# FA3) 399 / 495 / 497 against B_r = 128's 385 / 431 / 454 (causal: equal at 4k and 16k, 6% lower
# at 1k, so B_r = 128 there).
DEFAULTS = {64: dict(block_m=128, block_n=128, stages=2),
            (64, False): dict(block_m=192),
            128: dict(block_m=128, block_n=128, stages=2),
            # FP8 at d=128: B_c = 256 measured fastest (TFLOP/s, H100, one scale a head,
            # non-causal | causal, 2k / 8k / 16k, docs/results/fp8_configs_h100.txt):
            #   B_c 128: 534 / 749 / 776 | 420 / 621 / 753;  B_c 256: 626 / 830 / 860 | 428 / 721 / 812
            #   B_c 128 + intra_overlap: 602 / 783 / 837 | 422 / 664 / 762;  B_c 256 + it: lower
            # (back_to_back would hold S_j, 128 registers at B_c = 256, O and P~ at once: ptxas
            # serialises the wgmmas for want of registers, C7512). B_c between panels (V^T's room
            # whole panels, K's B_c rows; H100, docs/results/fp8_block_n_h100.txt part 3, TFLOP/s
            # at 4k / 16k, non-causal | causal): 256 848 / 903 | 714 / 873; 192 795 / 889 | 698 /
            # 840 (a second copy, placed after bf16: 774 / 866 | 670 / 831); 192 with 3 stages
            # 783 / 867 | 654 / 802
            (128, "fp8"): dict(block_n=256),
            # d=256 (docs/results/fa3_d256_h200.txt, H200, bf16, TFLOP/s at 2k / 8k, non-causal |
            # causal): B_c = 80 (two stages fit beside Q; O staged in Q's room) with both overlaps
            # 690 / 696 | 575 / 713; intra-warpgroup overlap alone (FA3's own choice at d=256)
            # 698 / 702 | 572 / 689; ping-pong alone 626 / 615 | 517 / 573; B_c = 64 613 / 600 |
            # 506 / 558; B_c = 128, one stage 661 / 675 | 555 / 661; B_r = 64, B_c = 96 469 / 510
            # | 403 / 478; cuDNN 698 / 694 | 550 / 635
            256: dict(block_m=128, block_n=80, stages=2, intra_overlap=True),
            # d=192: FA3's own tile (hopper/tile_size.h: B_c = 112, the intra-warpgroup overlap),
            # the largest B_c whose two stages fit beside Q (221 KB); not tuned here yet
            192: dict(block_m=128, block_n=112, stages=2, intra_overlap=True),
            # FP8 at d=256: B_c = 128 (whole 128-key rows of V^T; 2 stages fit beside Q)
            (256, "fp8"): dict(block_n=128)}
# Every other head_dim runs in the tile of the panels above it (Config.tile_dim: d=96 in 128
# columns, 40 in 64, 160 in 192) and takes that tile's defaults.
for _d in HEAD_DIMS:
    _t = sm90.panel_columns(_d)
    if _d != _t:
        DEFAULTS[_d] = DEFAULTS[_t]
        if (_t, False) in DEFAULTS:
            DEFAULTS[_d, False] = DEFAULTS[_t, False]

default_config = configs.default_config_function("fa3", Config, DEFAULTS, OPTIONS, HEAD_DIMS)

LOG2E = float32(softmax.LOG2E)
LN2 = float32(math.log(2))
STAMP_PHASES = 13       # build(cfg, stamps=True): a consumer warp's cycles in 13 phases of its
STAMP_MARK = -12345.0   # tiles, left over its LSE rows after this marker (no LSE is this): the
                        # record experiments/probes/fa3_phases.py reads


# The kernel's parts, each a builder closed over one configuration's constants (Config): where
# the tiles lie (_layout), the mbarrier rings (_rings), a tile's sequence and K/V blocks
# (_tile_bounds), the producer's role (_producer), the pieces of a consumer's step (_step_parts)
# and O_i's store (_epilogue). build(cfg) is the algorithm over them: the roles, the tile loop and
# the step loops (FA3's Alg.1 and 2, with their line numbers). All inlined into one kernel.

Layout = namedtuple("Layout", "row panel panels wg_q_elems k0 k_elems stage_elems stage_bytes v0 "
                              "q_bytes k_bytes v_bytes o_room o_pitch wg_o_elems staging0")


@lru_cache(maxsize=None)
def _layout(cfg):
    """Shared memory past the mbarriers, in 16-bit elements from `tiles0` (its first 1024-aligned
    byte: the swizzle's period): Q_i at 0 (64 rows a consumer warpgroup), the ring's stages (K_j,
    then V_j: B_c and cfg.kv_rows rows, FP8's V^T in whole 128-key panels), O_i's own staging room
    (o_apart), the staging buffers of the producer's transpose of V; every tile in panels of rows
    of 128 swizzled bytes (`row` elements, `panel` columns). Bytes: what a tile's copies land."""
    D, EB = cfg.tile_dim, cfg.operand.bytes
    q_bytes, k_bytes, v_bytes = cfg.block_m * D * EB, cfg.block_n * D * EB, cfg.kv_rows * D * EB
    wg_q_elems = WG_ROWS * D                    # a warpgroup's room for Q_i (16-bit elements:
                                                # its O_i may be staged there at the end)
    k0 = cfg.consumers * wg_q_elems             # stage 0's K tile
    k_elems, v_elems = k_bytes // 2, v_bytes // 2
    stage_elems = k_elems + v_elems             # a stage: K_j, then V_j k_elems on
    panel = sm90.SWIZZLE_BYTES // EB            # a panel's columns: 64 (16-bit) or 128 (e4m3)
    return Layout(row=sm90.SWIZZLE_BYTES // 2, panel=panel, panels=D // panel,
                  wg_q_elems=wg_q_elems, k0=k0, k_elems=k_elems, stage_elems=stage_elems,
                  stage_bytes=2 * stage_elems, v0=k0 + k_elems, q_bytes=q_bytes,
                  k_bytes=k_bytes, v_bytes=v_bytes, o_room=cfg.ring_bytes() // 2,
                  o_pitch=cfg.o_pitch, wg_o_elems=WG_ROWS * cfg.o_pitch,
                  staging0=(cfg.ring_bytes() + cfg.o_room_bytes()) // 2)


Rings = namedtuple("Rings", "q k v staged")


@lru_cache(maxsize=None)
def _rings(cfg):
    """The mbarrier rings (common/tile/mbarrier_ring.py; 8 bytes = 4 elements an mbarrier from
    shared element 0): Q full, Q empty (Q's ring, one stage: a tile's Q_i), then per stage K full,
    V full, K empty, V empty (K's and V's rings of cfg.stages, which go round together), then the
    staging buffers' full and empty ones (transpose_v="producer"). A fill: the TMA thread's
    arrive.expect_tx (its copies' bytes complete it), or one cp.async.mbarrier.arrive a producer
    thread, whose generic-proxy writes the consumers fence for wgmma's async proxy after their
    wait; with the producer's transpose, V_j^T's fill is one arrival a transposer warp (a staging
    buffer's: TMA's bytes; its release: one arrival a transposer warp). A release: one arrival a
    consumer warp. K and V are released apart (K once S has landed, V once O has): a turn of the
    ping-pong and the intra-warpgroup overlap both need K_{j+1} while V_j is still being read. Q
    is released once the tile's last S has landed (or, when O_i is staged in its room, once O_i is
    stored), so that the producer loads the next tile's Q."""
    STAGES, RELEASE, CP_ASYNC = cfg.stages, 4 * cfg.consumers, cfg.cp_async
    FULL = cfg.producer_threads
    VS = max(cfg.staging_units, 1)
    return Rings(ring(1, 0, 4, FULL, RELEASE, CP_ASYNC),
                 ring(STAGES, 8, 8 + 8 * STAGES, FULL, RELEASE, CP_ASYNC),
                 ring(STAGES, 8 + 4 * STAGES, 8 + 12 * STAGES,
                      TRANSPOSERS if cfg.v_in_producer else FULL, RELEASE, CP_ASYNC),
                 ring(VS, 8 + 16 * STAGES, 8 + 16 * STAGES + 4 * VS, 1, TRANSPOSERS))


@lru_cache(maxsize=None)
def _tile_bounds(cfg):
    """(sequence, steps): a tile's batch entry (its packed sequence, VARLEN) and K/V blocks."""
    BR, BC, CAUSAL = cfg.block_m, cfg.block_n, cfg.causal
    VARLEN, SHIFT = cfg.varlen, cfg.varlen and cfg.bottom_right

    @device_function
    def sequence(b, n_q, n_k, lo, hi, cu_q, cu_k):
        """(bb, first_q, first_k, n_q, n_k, lo, hi) of batch entry b: the batch index of the views
        and where its rows and keys start in them, its lengths and band. VARLEN: sequence b of the
        packed batch (one batch entry of total rows; its band moved to its own bottom-right corner
        when SHIFT), as fa2's forward reads it."""
        if VARLEN:
            first_q, first_k = cu_q[b], cu_k[b]
            nq, nk = int32(cu_q[b + 1] - first_q), int32(cu_k[b + 1] - first_k)
            if SHIFT:
                lo, hi = int32(lo + (nk - nq)), int32(hi + (nk - nq))
            return int32(0), int32(first_q), int32(first_k), nq, nk, lo, hi
        return b, int32(0), int32(0), n_q, n_k, lo, hi

    @device_function
    def steps(row0, n_q, n_k, lo, hi):
        """(j0, T_c) of a tile: its first K/V block and how many it visits (causal, a window:
        those holding a key of its rows' band, common/tile/masks.py; T_c = 0: its rows see no key)."""
        if CAUSAL:
            j0, j1 = masks.key_blocks(row0, BR, n_q, n_k, BC, lo, hi)
            return j0, max(int32(j1 - j0), int32(0))
        return int32(0), int32((n_k + BC - 1) // BC)

    return sequence, steps


@lru_cache(maxsize=None)
def _producer(cfg):
    """(produce, ring_blocks, transpose_v): the producer's role (Alg.1 l.3-9)."""
    D, BR, BC, NWG = cfg.tile_dim, cfg.block_m, cfg.block_n, cfg.consumers
    HEAD_DIM, FP8, CP_ASYNC, VARLEN = cfg.head_dim, cfg.fp8, cfg.cp_async, cfg.varlen
    L = _layout(cfg)
    ROW, PANEL, PANELS, WG_Q_ELEMS = L.row, L.panel, L.panels, L.wg_q_elems
    K0, K_ELEMS, STAGE_ELEMS, V0, STAGING0 = L.k0, L.k_elems, L.stage_elems, L.v0, L.staging0
    Q_BYTES, K_BYTES, V_BYTES = L.q_bytes, L.k_bytes, L.v_bytes
    # columns of the last panel that hold data (0: all of them), for the copies (cp.async) that
    # zero-fill the rest
    LAST_PANEL_COLS = HEAD_DIM - (PANELS - 1) * PANEL if HEAD_DIM < D else 0
    V_PANELS_T = cfg.kv_rows // V_UNIT if FP8 else 0   # FP8: V_j^T's panels of 128 keys
    PRODUCER_THREADS = cfg.producer_threads
    # transpose_v="producer" (FP8): V_j comes in V_UNIT-key units, each landed by TMA in a staging
    # buffer and transposed by TRANSPOSERS warps into panel u of the stage's V^T tile. Units a
    # block: V_j^T's whole panels (at B_c = 192 the second unit's last 64 keys are the next
    # block's, transposed and never read).
    TRANSPOSE, UNITS = cfg.v_in_producer, cfg.kv_rows // V_UNIT
    AFTER_PREPASS = cfg.after_prepass   # V^T is the pre-pass's, which may still run (PDL)
    UNIT_BYTES = cfg.unit_bytes()
    TRANSPOSE_UNIT = fp8.unit_transposer(D, TRANSPOSERS) if TRANSPOSE else None
    Q_RING, K_RING, V_RING, STAGED = _rings(cfg)
    slot, acquire_q = K_RING.slot, Q_RING.acquire   # K's and V's rings go round together
    acquire_k, acquire_v = K_RING.acquire, V_RING.acquire
    arm_q, q_landed, q_full = Q_RING.arm, Q_RING.arrive_when_landed, Q_RING.full
    v_transposed = V_RING.arrive_full           # a transposer warp's panels of V_j^T are written
    staged_slot, staged_acquire, arm_staged = STAGED.slot, STAGED.acquire, STAGED.arm
    staged_full, wait_staged, staged_read = STAGED.full, STAGED.wait_full, STAGED.arrive_empty
    SCHEDULER = tile_scheduler(BR, cfg.paired, cfg.causal)
    tile_plan, next_tile = SCHEDULER.plan, SCHEDULER.next_tile
    sequence, steps = _tile_bounds(cfg)

    @device_function
    def panel_cols(p):
        """valid_cols of panel p's copy (cp.async): the last panel's columns of d, 0 for whole."""
        return LAST_PANEL_COLS if p == PANELS - 1 else 0

    @device_function
    def load_q(smem, tiles0, tmaps, q_h, row0, n_q, first_q, b, h, ptid):
        """Alg.1 l.5: Q_i, a 64-row room a consumer warpgroup, each PANEL columns a panel. q_h:
        the sequence's rows (cp.async); TMA reads rows first_q + row0.. of batch entry b (past a
        packed sequence's end: the next one's rows, whose results are not stored)."""
        if CP_ASYNC:
            for w in range(NWG):
                for p in range(PANELS):
                    dst = tiles0 + w * WG_Q_ELEMS + p * WG_ROWS * ROW
                    tiles.load_tile_async(smem[dst:dst + WG_ROWS * ROW], q_h,
                                          row0 + w * WG_ROWS, n_q, p * PANEL, WG_ROWS, PANEL,
                                          PANEL, True, ptid, PRODUCER_THREADS, False,
                                          panel_cols(p))
            q_landed(smem, 0)
        else:
            arm_q(smem, 0, Q_BYTES)
            for w in range(NWG):
                for p in range(PANELS):
                    sm90.tma_load_4d(smem, tiles0 + w * WG_Q_ELEMS + p * WG_ROWS * ROW, tmaps, 0,
                                     p * PANEL, first_q + row0 + w * WG_ROWS, h, b, smem,
                                     q_full(0))

    def kv_loader(M, kv_ring, NBYTES):
        """load_k (M = 1: tensor map 1, K's ring) or load_v (M = 2: V's)."""
        arm, landed, full = kv_ring.arm, kv_ring.arrive_when_landed, kv_ring.full

        @device_function
        def load(smem, dst0, tmaps, src, key0, n_k, first_k, b, h_kv, stage, ptid):
            """Alg.1 l.8: K_j or V_j, B_c rows from key0, into the tile at dst0 (16-bit units) of
            ring stage `stage`. FP8's V_j^T (TMA only): d rows x 128 keys a box. src: the
            sequence's keys (cp.async); TMA reads keys first_k + key0.. of batch entry b (past a
            packed sequence's end: the next one's, masked as past n_k, their V rows zeroed by the
            consumers: `clear_v_tail`)."""
            if CP_ASYNC:
                for p in range(PANELS):
                    dst = dst0 + p * BC * ROW
                    tiles.load_tile_async(smem[dst:dst + BC * ROW], src, key0, n_k, p * PANEL, BC,
                                          PANEL, PANEL, True, ptid, PRODUCER_THREADS, False,
                                          panel_cols(p))
                landed(smem, stage)
                return
            arm(smem, stage, NBYTES)
            if FP8 and M == 2:
                for p in range(V_PANELS_T):
                    sm90.tma_load_4d(smem, dst0 + p * D * ROW, tmaps, 2,
                                     first_k + key0 + p * PANEL, 0, h_kv, b, smem, full(stage))
            else:
                for p in range(PANELS):
                    sm90.tma_load_4d(smem, dst0 + p * BC * ROW, tmaps, M, p * PANEL,
                                     first_k + key0, h_kv, b, smem, full(stage))
        return load

    load_k, load_v = kv_loader(1, K_RING, K_BYTES), kv_loader(2, V_RING, V_BYTES)

    @device_function
    def load_v_units(smem, tiles0, tmaps, it, key0, first_k, b, h_kv):
        """transpose_v="producer": V_j as it is, V_UNIT keys at a time, each into the next staging
        buffer once the transposers have read what it held."""
        for u in range(UNITS):
            unit, parity = staged_slot(it * UNITS + u)
            staged_acquire(smem, it * UNITS + u, unit, parity)
            arm_staged(smem, unit, UNIT_BYTES)
            dst = tiles0 + STAGING0 + unit * (UNIT_BYTES // 2)
            for p in range(PANELS):
                sm90.tma_load_4d(smem, dst + p * V_UNIT * ROW, tmaps, 2, p * PANEL,
                                 first_k + key0 + u * V_UNIT, h_kv, b, smem,
                                 staged_full(unit))

    @device_function
    def transpose_v(smem, tiles0, n, twarp, lane):
        """transpose_v="producer", a transposer warp: the units of V_UNIT keys of this block's n
        K/V blocks, one after another as TMA lands them in the staging buffers, into their panel
        of V_j^T in ring stage j % STAGES (`fp8.unit_transposer`: the K-major, key-ordered
        128-byte swizzled panel that the e4m3 P V wgmma reads), once the consumers have released
        that stage's V (l.7). A unit's writes are fenced for the async proxy (wgmma reads through
        it) before the warp hands its staging buffer back; after a block's last unit the warp
        arrives on the stage's V full mbarrier. One flat loop, so that the producer's 40
        registers a thread hold one unit's state."""
        for step in range(n * UNITS):
            it, u = step // UNITS, step % UNITS
            stage, parity = slot(it)
            if u == 0:
                acquire_v(smem, it, stage, parity)
            unit, unit_parity = staged_slot(step)
            wait_staged(smem, unit, unit_parity)
            TRANSPOSE_UNIT(smem, tiles0 + STAGING0 + unit * (UNIT_BYTES // 2),
                           tiles0 + V0 + stage * STAGE_ELEMS + u * D * ROW,
                           twarp, lane)
            ptx.fence_proxy_async_shared()
            ptx.syncwarp()
            if lane == 0:
                staged_read(smem, unit)
                if u == UNITS - 1:
                    v_transposed(smem, stage)

    @device_function
    def ring_blocks(n_q, n_k, heads, batch_heads, lo, hi, cu_q, cu_k):
        """The K/V blocks that go through this block's ring, over all its tiles (as `produce`
        loads them): what the transposers follow, without the tiles' state in their registers
        (the producer warpgroup has 40 a thread)."""
        plan = tile_plan(n_q, heads, batch_heads, int32(1))
        total = int32(0)
        for t in range(plan[0]):
            go, i, b, _, _ = next_tile(t, plan)
            if go < 0:
                break
            if go > 0:
                _, _, _, nq, nk, lo_b, hi_b = sequence(b, n_q, n_k, lo, hi, cu_q, cu_k)
                if not VARLEN or i * BR < nq:
                    total += steps(i * BR, nq, nk, lo_b, hi_b)[1]
        return total

    @device_function
    def produce(smem, tiles0, tmaps, q, k, v, n_q, n_k, kv_group, heads, batch_heads, lo, hi,
                cu_q, cu_k, ptid):
        """The producer (one thread for TMA, every producer thread for cp.async): for each of the
        block's tiles, Q_i once the previous tile has released its Q, then K_j, V_j into the ring's
        next stage once it is free (with transpose_v="producer": V_j into staging buffers)."""
        if not CP_ASYNC:
            for m in range(3):
                sm90.tensormap_acquire(tmaps, m)
        plan = tile_plan(n_q, heads, batch_heads, kv_group)
        it = int32(0)       # K/V blocks through the ring so far
        done = int32(0)     # tiles so far
        for t in range(plan[0]):
            go, i, b, h, _ = next_tile(t, plan)
            if go < 0:
                break
            if go == 0:
                continue
            h_kv = divmod_by(h, plan[5])[0]
            row0 = i * BR
            bb, first_q, first_k, nq, nk, lo_b, hi_b = sequence(b, n_q, n_k, lo, hi, cu_q, cu_k)
            if VARLEN and row0 >= nq:   # past a packed sequence's end: no tile (consumers too)
                continue
            acquire_q(smem, done, 0, done & 1)   # the last tile's Q read for the last time
            q_h = q[bb, h, first_q:first_q + nq] if VARLEN else q[b, h]
            load_q(smem, tiles0, tmaps, q_h, row0, nq, first_q, bb, h, ptid)       # Alg.1 l.5
            j0, t_c = steps(row0, nq, nk, lo_b, hi_b)
            for jj in range(t_c):                                                  # l.6
                key0 = (j0 + jj) * BC
                stage, parity = slot(it)
                acquire_k(smem, it, stage, parity)   # l.7: the block STAGES before's K released
                k0 = tiles0 + K0 + stage * STAGE_ELEMS
                k_h = k[bb, h_kv, first_k:first_k + nk] if VARLEN else k[b, h_kv]
                load_k(smem, k0, tmaps, k_h, key0, nk, first_k, bb, h_kv, stage, ptid)   # l.8
                if TRANSPOSE:      # ... and its V, for the transposers
                    load_v_units(smem, tiles0, tmaps, it, key0, first_k, bb, h_kv)
                else:
                    acquire_v(smem, it, stage, parity)   # ... and its V
                    if AFTER_PREPASS and it == 0:   # V^T: once the pre-pass has ended (PDL; Q_i
                        sm90.griddep_wait()         # and K_j are copied while it may still run)
                    v_h = v[bb, h_kv, first_k:first_k + nk] if VARLEN else v[b, h_kv]
                    load_v(smem, k0 + K_ELEMS, tmaps, v_h, key0, nk, first_k, bb, h_kv, stage,
                           ptid)
                it = int32(it + 1)
            done = int32(done + 1)

    return produce, ring_blocks, transpose_v


StepParts = namedtuple("StepParts", "scores values key_factor logits exponentiate "
                                    "exponentiate_deferred to_a clear_v_tail softmax_step")


@lru_cache(maxsize=None)
def _step_parts(cfg):
    """The pieces of a consumer warpgroup's K/V step: the GEMMs issued (scores: S = Q_i K_j^T,
    values: O += P~ V_j), S_j as the softmax takes it (key_factor, logits), the online softmax
    (exponentiate, exponentiate_deferred), P~ into the A registers (to_a), a packed sequence's V
    tail zeroed (clear_v_tail), and a step's releases and softmax back to back (softmax_step)."""
    D, BC, FP8, K_BLOCK_SCALES = cfg.tile_dim, cfg.block_n, cfg.fp8, cfg.k_block_scales
    HEAD_DIM, EB, OPERAND = cfg.head_dim, cfg.operand.bytes, cfg.operand.code
    CAUSAL, WINDOW, SOFTCAP, ALIBI = cfg.causal, cfg.window, cfg.softcap, cfg.alibi
    MODS, APPLY_MODS, _, _ = mods.for_kernel(cfg.mods, False, (1, 1, 1))   # (no grad here)
    L = _layout(cfg)
    PANELS, STAGE_ELEMS, STAGE_BYTES, V0 = L.panels, L.stage_elems, L.stage_bytes, L.v0
    # wgmma descriptors: K-major panels (Q, K) step 32 bytes per 16 columns inside a 128-byte row
    # and one panel (rows x 128 bytes) per 64 columns; V (MN-major) one 2 KB row group per 16 keys,
    # its d/64 panels LBO apart.
    # FP8: V_j^T (d rows x B_c keys, K-major like K_j), panels of 128 keys d x 128 bytes apart.
    K_QK = -(-HEAD_DIM * EB // 32)              # wgmma k-steps of S = Q K^T (32 bytes of d each;
                                                # none over the zero columns past d)
    K_PV = BC // cfg.operand.k_step             # ... of O += P~ V (16 or 32 keys each)
    MMA_S = sm90.wgmma_ss(BC, cfg.operand.ptx)  # S = Q K^T         (m64 n=B_c k16 / k32)
    MMA_O = sm90.wgmma_rs(D, cfg.operand.ptx, not FP8)   # O += P~ V (m64 n=d, V transposed / V^T)
    P_SHIFT = float32(P_LOG2_SHIFT if FP8 else 0)
    POLY = cfg.poly_exp2                        # exponentials on the FMA units: softmax.exp2
    O_APART = cfg.o_apart
    V_ROW_WORDS = sm90.SWIZZLE_BYTES // 4       # a 128-byte row of a V panel in 32-bit words
    V_PANEL_WORDS = BC * V_ROW_WORDS            # a panel: B_c rows (keys) x 64 columns
    Q_RING, K_RING, V_RING, _ = _rings(cfg)
    slot, release_q, release_k, release_v = (K_RING.slot, Q_RING.release, K_RING.release,
                                             V_RING.release)

    @device_function
    def scores(s, q_desc, k_desc0, stage):
        """Issue S = Q_i K_j^T, K_j in ring stage `stage`: d/16 SS-wgmma k-steps (the first
        overwrites S), one commit group. q_desc, k_desc0: the descriptors of this warpgroup's Q_i
        and of stage 0's K tile, advanced (one add each) rather than rebuilt a k-step."""
        k_desc = sm90.descriptor_advance(k_desc0, stage * STAGE_BYTES)
        for kk in range(K_QK):
            MMA_S(s, sm90.descriptor_advance(q_desc, (kk >> 2) * WG_ROWS * 128 + (kk & 3) * 32),
                  sm90.descriptor_advance(k_desc, (kk >> 2) * BC * 128 + (kk & 3) * 32), kk)
        sm90.wgmma_commit()

    @device_function
    def values(o_acc, p, v_desc0, stage):
        """Issue O += P~ V_j, V_j in ring stage `stage`: RS-wgmma k-steps (16 or 32 keys each), one
        commit group. v_desc0: the descriptor of stage 0's V tile."""
        v_desc = sm90.descriptor_advance(v_desc0, stage * STAGE_BYTES)
        for kk in range(K_PV):
            if FP8:
                desc = sm90.descriptor_advance(v_desc, (kk >> 2) * D * 128 + (kk & 3) * 32)
            else:
                desc = sm90.descriptor_advance(v_desc, kk * 16 * 128)
            MMA_O(o_acc, p[0, kk, 0], p[0, kk, 1], p[0, kk, 2], p[0, kk, 3], desc, 1)
        sm90.wgmma_commit()

    @device_function
    def mask(s, j, n_k, lo, hi, wg_row0, warp_row, lane):
        """-inf where block j's keys run past n_k or (causal, a window) out of a row's band
        lo <= key - query <= hi (common/tile/masks.py)."""
        col0 = j * BC
        if masks.block_is_partial(wg_row0, WG_ROWS, col0, BC, n_k, CAUSAL, lo, hi, WINDOW):
            tiles.mask_scores(s, warp_row, col0, n_k, CAUSAL, lo, hi, lane, WINDOW)

    @device_function
    def key_factor(k_descale, b, h_kv, j, by_k_blocks):
        """FP8 with descales per block of keys: block j's descale_k (a scale block holds whole key
        blocks, by_k_blocks = divider(k_scale_rows / B_c): `_run` checks it). Loaded as S_j's
        wgmmas are issued, so that its latency passes under the GEMM, not before the softmax."""
        if K_BLOCK_SCALES:
            return k_descale[b, h_kv, divmod_by(j, by_k_blocks)[0]]
        return float32(0)

    @device_function
    def logits(s, j, n_k, lo, hi, terms, wg_row0, warp_row, lane):
        """S_j as the softmax takes it: Gemma 2's soft cap on raw scores, ALiBi's bias, a user's
        score_mod and mask_mod, then -inf outside the mask; terms: (cap, ALiBi's slope on raw
        scores, its diagonal's shift, and for the mods (b, h, aux, softmax_scale, its inverse,
        n_q): the tile's batch entry (a packed batch's sequence), query head, the call's aux).
        (FP8's per-block K descale joins the softmax's scale: `exponentiate`.)"""
        cap, slope, shift, b, h, aux, scale, inv_scale, n_q = terms
        if SOFTCAP:
            softmax.softcap_scores(s, cap)
        if ALIBI:
            tiles.add_alibi(s, warp_row + shift, j * BC, slope, lane)
        if MODS:   # the user's score_mod, then mask_mod (common/tile/mods.py)
            APPLY_MODS(s, s, warp_row, j * BC, n_q, n_k, b, h, aux, scale, inv_scale, lane, False)
        mask(s, j, n_k, lo, hi, wg_row0, warp_row, lane)

    @device_function
    def exponentiate(s, f, m_i, l_i, o_acc, sl2):
        """l.16-17 on S_j: m_i, P~_j = exp(S_j - m_i), l_i, O_i rescaled; with FP8's per-block K
        descales S_j is f times the wgmmas' S, f folded into the max and the exponent's scale."""
        if K_BLOCK_SCALES:
            softmax.online_softmax_scaled(s, f, m_i, l_i, o_acc, sl2, P_SHIFT, POLY)
        else:
            softmax.online_softmax(s, m_i, l_i, o_acc, sl2, P_SHIFT, POLY)

    @device_function
    def exponentiate_deferred(s, f, m_i, l_i, alpha, sl2):
        """`exponentiate` with O's rescale left in alpha (the intra-warpgroup overlap)."""
        if K_BLOCK_SCALES:
            softmax.online_softmax_deferred_scaled(s, f, m_i, l_i, alpha, sl2, P_SHIFT, POLY)
        else:
            softmax.online_softmax_deferred(s, m_i, l_i, alpha, sl2, P_SHIFT, POLY)

    @device_function
    def to_a(p, s):
        """P~ from the S accumulator into the A registers of the P V wgmma."""
        tiles.accumulator_to_a(p, s, OPERAND)

    @device_function
    def clear_v_tail(tiles0, stage, key0, n_k, wg, wg_tid):
        """CLEAR_V_TAIL: if the key block from key0 in ring stage `stage` runs past n_k, zero its
        V rows n_k - key0 .. B_c - 1 (whole 128-byte rows of each 64-column panel: the swizzle
        permutes 16-byte chunks inside a row only), then fence the writes for the async proxy and
        meet the warpgroup, so that its P V wgmma reads the zeros. Every consumer warpgroup zeroes
        the rows before its own wgmma (the same zeros: a second warpgroup's writes change nothing
        the first one's wgmma reads); the stage is released after the wgmma, so the producer's next
        copy into it comes after the writes. Only a tile's last block can run past n_k (`steps`
        ends at the block of key n_k - 1); key0 < n_k."""
        if key0 + BC > n_k:
            f32 = cuda.shared.array(0, float32)
            first = int32(n_k - key0) * V_ROW_WORDS + 4 * wg_tid
            zero = float32(0)
            for panel in range(PANELS):
                base = ((tiles0 + V0 + stage * STAGE_ELEMS) >> 1) + panel * V_PANEL_WORDS
                for w in range(first, V_PANEL_WORDS, 4 * WG_THREADS):
                    ptx.st_shared_v4_f32(f32, base + w, zero, zero, zero, zero)
            ptx.fence_proxy_async_shared()
            ptx.bar_sync(1 + wg, WG_THREADS)

    @device_function
    def softmax_step(smem, s, f, o_acc, p, m_i, l_i, sl2, it, j, j0, t_c, n_k, lo, hi, terms,
                     wg_row0, warp_row, lane):
        """Back to back, once S_j (and O += P~_{j-1} V_{j-1}) have landed: release K_j (and
        V_{j-1}; Q after the last S), then l.16-17: m_i, P~_i = exp(S - m_i), l_i, O_i rescaled,
        and P~ into the A registers of the P V wgmma."""
        release_k(smem, slot(it + j)[0], lane)
        if j > 0:
            release_v(smem, slot(it + j - 1)[0], lane)                             # l.19
        if O_APART and j == t_c - 1:   # Q_i read for the last time
            release_q(smem, 0, lane)
        logits(s, j0 + j, n_k, lo, hi, terms, wg_row0, warp_row, lane)
        exponentiate(s, f, m_i, l_i, o_acc, sl2)
        to_a(p, s)

    return StepParts(scores, values, key_factor, logits, exponentiate, exponentiate_deferred,
                     to_a, clear_v_tail, softmax_step)


@lru_cache(maxsize=None)
def _epilogue(cfg, stamps):
    """store_o: Alg.1 l.22, O_i (scaled by 1/l, in the accumulator) written to o, staged in
    shared memory by the warpgroup: by its threads' 16-byte stores, or (o_store) the copy engine's
    bulk copies (a row each) or TMA tensor stores (a panel each). With `stamps`, the cycles to the
    end of the staging are summed into phase 8 ("stage O")."""
    D, BR, HEAD_DIM, VARLEN, ELEM = (cfg.tile_dim, cfg.block_m, cfg.head_dim, cfg.varlen,
                                     cfg.element.code)
    L = _layout(cfg)
    O_ROOM, O_PITCH, WG_O_ELEMS = L.o_room, L.o_pitch, L.wg_o_elems
    O_COLS = HEAD_DIM if HEAD_DIM < D else 0    # O's columns of d (0: all): the store leaves the
                                                # tile's zero columns past d out
    O_BULK = cfg.o_store == "bulk"              # O_i stored by bulk copies, a row each
    O_TMA = cfg.o_store == "tma"                # ... or by TMA tensor stores, a panel each
    O_PANEL = sm90.SWIZZLE_BYTES // 2           # O_TMA: a panel of O, 64 16-bit columns (FP8 too),
    O_PANELS, O_WORDS = D // O_PANEL, O_PANEL // 2   # ... D / 64 of them; its columns as 32-bit words
    O_ROW_BYTES = 2 * HEAD_DIM                  # a bulk copy: a row of O, its columns past d left out
    stamp = stamper(stamps)[1]

    @device_function
    def store_o(o, smem, tmaps, stage32, o_acc, tiles0, o_start, bb, b, h, i, first_q, nq, wg,
                wg_warp, wg_tid, warp, wg_row0, lane, tl, tl_t):
        """O_i of this warpgroup's rows (wg_row0.., this warp's from 16 wg_warp) of tile i of
        batch entry bb (b, h: the map's), staged at o_start (stage32: its 32-bit words); returns
        tl_t, the last stamp."""
        if O_BULK:
            # FA3's store by the copy engine, without a tensor map: a bulk copy a row. A warp
            # stages its own 16 rows of O (unswizzled, O_PITCH apart) and its lane 0 issues
            # their copies; the warps go on while they run. (The warpgroup's barriers, not
            # the warp's: with syncwarps here ptxas took the step loop's descriptor
            # arithmetic off the uniform datapath, 1 001 -> 1 020 instructions a step.)
            if lane == 0:
                ptx.bulk_wait_read(0)   # the warp's last copies have read its rows of the room
            ptx.bar_sync(1 + wg, WG_THREADS)
            tiles.stage_accumulator(stage32, o_acc, 16 * wg_warp, lane, O_PITCH, False, ELEM)
            ptx.fence_proxy_async_shared()   # the stores before the copy engine's reads
            ptx.bar_sync(1 + wg, WG_THREADS)
            tl_t = stamp(tl, 8, tl_t)
            o_h = o[bb, h, first_q:first_q + nq] if VARLEN else o[b, h]
            # the warp's index from lane 0, so that ptxas knows it the same in every lane
            # and builds the copies' operands in uniform registers; the warp's first row
            # and its address made once, then moved by whole rows
            bw = int32(ptx.broadcast_u32(uint32(warp)))
            row0 = int32(i * BR + 16 * bw)   # bw = 4 wg + wg_warp
            words = int32((((tiles0 + O_ROOM) >> 1) + (bw >> 2) * (WG_O_ELEMS >> 1))
                          + 16 * (bw & 3) * (O_PITCH >> 1))   # its first staged row
            if lane == 0:
                smem32 = cuda.shared.array(0, uint32)
                address = ptx.global_address(o_h, min(row0, int32(nq - 1)), int32(0))
                for r in range(16):
                    if int32(row0 + r) < nq:
                        ptx.bulk_store(address + r * o_h.strides[0], smem32,
                                       int32(words + r * (O_PITCH >> 1)), O_ROW_BYTES)
                ptx.bulk_commit()
        elif O_TMA:
            # FA3's epilogue: the warpgroup stages its 64 rows as the O map's boxes (a panel of
            # 64 columns each, 128-byte swizzled, as TMA lands Q), and one thread issues a
            # tensor store a panel; the copy engine clips rows past N and columns past d.
            if wg_tid == 0:
                ptx.bulk_wait_read(0)   # the last tile's stores have read the room
            ptx.bar_sync(1 + wg, WG_THREADS)
            tiles.stage_accumulator_panels(stage32, o_acc, 16 * wg_warp, lane, WG_ROWS, ELEM)
            ptx.fence_proxy_async_shared()   # the stores before the copy engine's reads
            ptx.bar_sync(1 + wg, WG_THREADS)
            tl_t = stamp(tl, 8, tl_t)
            if wg_tid == 0:
                for p_ in range(O_PANELS):
                    sm90.tma_store_4d(tmaps, 3, p_ * O_WORDS, wg_row0, h, b, smem,
                                      o_start + p_ * WG_ROWS * O_PANEL)
                ptx.bulk_commit()
        else:
            # 16-byte stores by every thread of the warpgroup (the barrier before: every
            # thread of it is done reading the room, the previous tile's O or, in Q's room,
            # the last QK^T wgmma has completed)
            ptx.bar_sync(1 + wg, WG_THREADS)
            tiles.stage_accumulator(stage32, o_acc, 16 * wg_warp, lane, D, True, ELEM)
            ptx.bar_sync(1 + wg, WG_THREADS)
            tl_t = stamp(tl, 8, tl_t)
            o_h = o[bb, h, first_q:first_q + nq] if VARLEN else o[b, h]
            tiles.store_tile(o_h, stage32, wg_row0, nq, WG_ROWS, D, D, True, wg_tid,
                             WG_THREADS, O_COLS)
        return tl_t

    return store_o


@device_function
def stamp_record(lse, tl, bb, h, rec, warp, tiles_done, steps_done):
    """build(cfg, stamps=True): a consumer warp's record over its 16 LSE rows from row rec of
    (bb, h): STAMP_MARK; its block, warp and tiles packed (8 + 4 + 12 bits, exact in float32); its
    K/V steps; the STAMP_PHASES sums of its cycles (experiments/probes/fa3_phases.py)."""
    lse[bb, h, rec] = float32(STAMP_MARK)
    lse[bb, h, rec + 1] = float32((cuda.blockIdx.x * 16 + warp) * 4096 + tiles_done)
    lse[bb, h, rec + 2] = float32(steps_done)
    for q_ in range(STAMP_PHASES):
        lse[bb, h, rec + 3 + q_] = float32(tl[q_])


@lru_cache(maxsize=None)
def build(cfg, stamps=False):
    """The kernel of one configuration: FA3's Alg.1 (the producer, l.3-9; the consumers, l.10-22)
    over the builders' parts, their compile-time constants closed over. stamps: a probe's timing
    stamps compiled in (experiments/probes/fa3_phases.py launches `forward` with
    build(cfg, stamps=True): a consumer warp's cycles in STAMP_PHASES phases of the default step
    loop and of its tiles, left over its LSE rows at the block's last tile by `stamp_record`);
    without them the PTX has no trace of them."""
    D, BR, BC, STAGES, NWG = cfg.tile_dim, cfg.block_m, cfg.block_n, cfg.stages, cfg.consumers
    FP8, K_BLOCK_SCALES, VARLEN = cfg.fp8, cfg.k_block_scales, cfg.varlen
    ALIBI, SINKS, SHIFT_ALIBI = cfg.alibi, cfg.sinks, cfg.varlen and cfg.bottom_right
    MODS = cfg.mods is not None
    L = _layout(cfg)
    K0, WG_Q_ELEMS, K_BYTES, O_ROOM, WG_O_ELEMS = L.k0, L.wg_q_elems, L.k_bytes, L.o_room, \
        L.wg_o_elems
    PRODUCER_WARP, PRODUCER_THREADS = 4 * NWG, cfg.producer_threads
    SETMAXNREG, TRANSPOSE = cfg.setmaxnreg, cfg.v_in_producer
    TAKE_REGISTERS = sm90.setmaxnreg("inc", cfg.registers[0])
    GIVE_REGISTERS = sm90.setmaxnreg("dec", cfg.registers[1])
    O_APART, O_BULK, O_TMA = cfg.o_apart, cfg.o_store == "bulk", cfg.o_store == "tma"
    # wgmma descriptors: K-major Q and K (SBO: 8 rows of 128 bytes), V MN-major (its d/64 panels
    # V_LBO apart; FP8's V^T K-major)
    SBO = 8 * sm90.SWIZZLE_BYTES
    V_LBO = BC * sm90.SWIZZLE_BYTES
    K_PV = BC // cfg.operand.k_step             # k-steps of O += P~ V (16 or 32 keys each)
    WAIT_S = sm90.wgmma_wait(0, BC // 2)        # S has landed
    WAIT1_S = sm90.wgmma_wait(1, BC // 2)       # S has landed, the P V issued after it may run on
    WAIT_OP = sm90.wgmma_wait(0, D // 2, 4 * K_PV)   # O has landed and P~'s registers are free
    WAIT_ALL = sm90.wgmma_wait(0, BC // 2, D // 2, 4 * K_PV)   # S, O and P~'s registers
    S_ACC, O_ACC, P_FRAG = (1, BC // 8, 4), (1, D // 8, 4), (1, K_PV, 4)
    P_SHIFT = float32(P_LOG2_SHIFT if FP8 else 0)
    INTRA_OVERLAP, BACK_TO_BACK = cfg.intra_overlap, cfg.back_to_back
    # VARLEN with TMA: a tile's last key block, when it runs past its sequence's n_k keys, holds
    # the next sequence's rows (TMA zero-fills past the whole packed tensor only). Their scores are
    # masked (P~ = 0), but 0 x inf = NaN in P V: the consumers zero those V rows before the P V
    # wgmma. (cp.async zero-fills past n_k itself; FP8 is not taken packed.)
    CLEAR_V_TAIL = VARLEN and not cfg.cp_async and not FP8
    # Ping-pong (FA3 section 3.1, common/tile/pingpong.py): the turns on named barriers 4 + w (1
    # .. NWG are the epilogue's), when two or more consumer warpgroups take them (cfg.scheduled)
    begin_turns, wait_turn, pass_turn, hand_on = turns(NWG, 4, cfg.scheduled)
    Q_RING, K_RING, V_RING, STAGED = _rings(cfg)
    slot, wait_q, wait_k, wait_v = K_RING.slot, Q_RING.wait_full, K_RING.wait_full, \
        V_RING.wait_full
    release_q, release_k, release_v = Q_RING.release, K_RING.release, V_RING.release
    init_q, init_k_full, init_k_empty = Q_RING.init, K_RING.init_full, K_RING.init_empty
    init_v_full, init_v_empty, init_staged = V_RING.init_full, V_RING.init_empty, STAGED.init
    SCHEDULER = tile_scheduler(BR, cfg.paired, cfg.causal)   # common/tile/scheduler.py
    tile_plan, next_tile = SCHEDULER.plan, SCHEDULER.next_tile
    sequence, steps = _tile_bounds(cfg)
    produce, ring_blocks, transpose_v = _producer(cfg)
    scores, values, key_factor, logits, exponentiate, exponentiate_deferred, to_a, \
        clear_v_tail, softmax_step = _step_parts(cfg)
    store_o = _epilogue(cfg, stamps)
    STAMPS = stamps
    stamps_begin, stamp = stamper(stamps)

    @kernel_for_one_block_per_sm(cfg.threads)
    def fa3_forward(tmaps, q, k, v, o, lse, n_q, n_k, kv_group, heads, batch_heads, lo, hi, cap,
                    softmax_scale, scale_log2, q_descale, k_descale, v_descale, q_scale_rows,
                    k_scale_rows, cu_q, cu_k, alibi, alibi_stride, alibi_shift, sinks, aux):
        """tmaps: (3, 16) tensor maps of q, k, v (FP8: V^T), read by producer="tma", and with
        o_store="tma" a fourth, of o (32-bit words: 16-bit pairs); q, k, v:
        (B, H, N, d) uint16 views, read by producer="cp_async" (FP8: unread); o: (B, H, N_q, d/2)
        uint32 view; lse: (B, H, N_q); heads: H, batch_heads: B H; lo, hi: the band of keys a query
        sees (lo <= key - query <= hi; causal, a window); cap: the soft cap on raw scores
        (softcap / softmax_scale, when SOFTCAP). FP8: descales (B, H or H_kv, blocks), a
        block q_scale_rows (Q) or k_scale_rows (K) rows; unread for 16-bit inputs. The grid: a
        block a tile, or (persistent) fewer, each looping over tiles (`tile`). VARLEN: B = 1 and
        batch entry b of the tiles is the sequence of rows cu_q[b] .. cu_q[b+1] - 1 (keys: cu_k),
        n_q the longest (the tiles cover it), lo and hi relative to its top-left corner; a tile
        past its sequence's end is skipped. alibi, alibi_stride, alibi_shift, sinks: the score
        terms (16-bit; common/host/problem.py: score_args), as fa2's forward reads them. aux: the
        arrays a score_mod / mask_mod reads (cfg.mods; an empty tuple without)."""
        tid = int32(cuda.threadIdx.x)
        warp, lane = tid >> 5, tid & 31

        smem = cuda.shared.array(0, uint16)
        base = sm90.shared_address(smem, 0)
        # the tiles start 1024-byte aligned (the swizzle's period), after the mbarriers
        aligned = (base + uint32(BARRIER_BYTES + 1023)) & uint32(0xFFFFFC00)
        tiles0 = int32(aligned - base) >> 1

        if tid == 0:
            init_q(smem)
            for s in range(STAGES):
                init_k_full(smem, s)
                init_v_full(smem, s)
                init_k_empty(smem, s)
                init_v_empty(smem, s)
            if TRANSPOSE:
                init_staged(smem)
            sm90.fence_mbarrier_init()
        cuda.syncthreads()

        if warp >= PRODUCER_WARP:
            if SETMAXNREG:
                GIVE_REGISTERS()   # the whole producer warpgroup (TMA: then 3 of its warps leave,
                                   # or transpose V)
            ptid = tid - WG_THREADS * NWG
            if ptid < PRODUCER_THREADS:
                produce(smem, tiles0, tmaps, q, k, v, n_q, n_k, kv_group, heads, batch_heads, lo,
                        hi, cu_q, cu_k, ptid)
            elif TRANSPOSE and ptid >= 32:   # the other producer warps: V_j^T, block after block
                transpose_v(smem, tiles0, ring_blocks(n_q, n_k, heads, batch_heads, lo, hi, cu_q,
                                                      cu_k), (ptid >> 5) - 1, lane)
            return
        if SETMAXNREG:
            TAKE_REGISTERS()

        # ---- a consumer warpgroup: 64 rows of each tile's Q_i
        wg, wg_warp = warp >> 2, warp & 3
        wg_tid = tid & (WG_THREADS - 1)
        if O_TMA and wg_tid == 0:   # the thread that issues the warpgroup's stores of O
            sm90.tensormap_acquire(tmaps, 3)
        kv_addr = sm90.shared_address(smem, tiles0 + K0)
        # Q's room, its address broadcast from lane 0 so that the compiler knows it is the same in
        # every lane: the descriptors derived from it are then built in the uniform registers that
        # wgmma reads (CUTLASS's canonical_warp_group_idx does this for the warpgroup's index)
        q_desc = sm90.smem_descriptor(
            ptx.broadcast_u32(sm90.shared_address(smem, tiles0 + wg * WG_Q_ELEMS)), 16, SBO)
        k_desc0 = sm90.smem_descriptor(kv_addr, 16, SBO)
        v_desc0 = sm90.smem_descriptor(kv_addr + K_BYTES, 16 if FP8 else V_LBO, SBO)
        # O_i's staging room (16-bit pairs): its own after the ring, or this warpgroup's Q room
        o_start = ((tiles0 + O_ROOM) if O_APART else tiles0) + wg * WG_O_ELEMS
        stage32 = cuda.shared.array(0, uint32)[o_start >> 1:(o_start >> 1) + WG_O_ELEMS // 2]

        o_acc = cuda.local.array(O_ACC, float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)
        s = cuda.local.array(S_ACC, float32)
        p = cuda.local.array(P_FRAG, uint32)
        alpha = cuda.local.array(2, float32)
        inv_l = cuda.local.array(2, float32)
        lse_rows = cuda.local.array(2, float32)
        inv_scale = float32(1) / softmax_scale if MODS else float32(0)   # (the mods' unscale)

        plan = tile_plan(n_q, heads, batch_heads, kv_group)
        by_q_rows = divider(q_scale_rows) if FP8 else divider(int32(1))   # FP8: Q's scale blocks
        by_k_blocks = divider(k_scale_rows // BC if K_BLOCK_SCALES else int32(1))   # ... K's
        it = int32(0)       # K/V blocks through the ring so far (as the producer counts them)
        done = int32(0)     # tiles so far (Q's phases)
        turned = False      # VARLEN: warpgroup 0 has given itself the first turn
        tl = cuda.local.array(STAMP_PHASES, uint32)   # stamps: each phase's cycles (the probe's)
        tl_t = stamps_begin(tl)
        stamped = False     # stamps: the default step loop ran (else no record: not timed)
        for k in range(plan[0]):
            go, i, b, h, final = next_tile(k, plan)
            if go < 0:
                break
            if go == 0:
                continue
            h_kv = divmod_by(h, plan[5])[0]
            bb, first_q, first_k, nq, nk, lo_b, hi_b = sequence(b, n_q, n_k, lo, hi, cu_q, cu_k)
            if VARLEN:
                begin_turns(wg, not turned)   # (below, without VARLEN)
                turned = True
                if i * BR >= nq:
                    # past a packed sequence's end: no Q, no step, no output (the producer skips
                    # it); the turn goes round as for a tile of no step, so that `final` still
                    # names the block's last turn
                    wait_turn(wg)
                    hand_on(wg, final)
                    continue
            wg_row0 = int32(i * BR + wg * WG_ROWS)  # this warpgroup's first query row
            warp_row = int32(wg_row0 + 16 * wg_warp)   # this warp's first row (mask, LSE)
            j0, t_c = steps(int32(i * BR), nq, nk, lo_b, hi_b)

            tiles.fill(o_acc, float32(0))                                          # l.11
            if SINKS:   # the sink as a column already seen: m_i = s_h, l_i = 1
                softmax.init_rows_with_sink(m_i, l_i, sinks[h] / softmax_scale, lane)
            else:
                softmax.init_rows(m_i, l_i)
            # the score terms of this tile's head: (cap, ALiBi's slope, its diagonal's shift), and
            # what a score_mod / mask_mod is passed (`logits`)
            terms = (cap, alibi[b * alibi_stride + h] / softmax_scale if ALIBI else float32(0),
                     int32(nk - nq) if VARLEN and SHIFT_ALIBI else alibi_shift, int32(b),
                     int32(h), aux, softmax_scale, inv_scale, nq)
            # FP8: S = descale_q descale_k Q8 K8^T; the factors join the softmax scale (K's per
            # block: in the loop, `exponentiate`), V's joins 1/l at the end (loaded here, with
            # the others, before the wait for Q: no descale load's latency is waited out).
            eff_scale = softmax_scale
            v_scale = float32(1)
            if FP8:
                q_block = min(divmod_by(wg_row0, by_q_rows)[0], int32(q_descale.shape[2] - 1))
                eff_scale = softmax_scale * q_descale[b, h, q_block]
                if not K_BLOCK_SCALES:
                    eff_scale *= k_descale[b, h_kv, 0]
                v_scale = v_descale[b, h_kv, 0]
            sl2 = eff_scale * LOG2E if FP8 else scale_log2

            tl_t = stamp(tl, 10, tl_t)
            wait_q(smem, 0, done & 1)                                              # l.13
            tl_t = stamp(tl, 11, tl_t)
            # Ping-pong: warpgroup 0 takes the first turn; each turn is "O += P~_{j-1} V_{j-1}
            # (or the first S), S_j = Q K_j^T issued", so one warpgroup's GEMMs run while the
            # other's softmax does. The turn goes round without a break from tile to tile: the
            # last warpgroup's last turn of a tile hands it to warpgroup 0's first of the next
            # (were warpgroup 0 to give itself that turn, it could hand on two turns before the
            # next warpgroup took one, and the turns would drift a phase apart). At the block's
            # last tile the last warpgroup passes no turn at the end: nobody waits for it. (A
            # packed batch gives warpgroup 0 its first turn above, before any tile is skipped.)
            if not VARLEN:
                begin_turns(wg, done == 0)
            wait_turn(wg)
            if t_c == 0:
                # no key in its rows' band (bottom-right causal with N_q > N_k): O = 0, LSE = -inf
                # from the epilogue; Q is handed back and the turn passed on as after a loop
                if O_APART:
                    # every lane past its wait for Q first (no wgmma has converged them): else
                    # Q_{i+1} could land, completing the barrier's next phase, before a lane has
                    # seen this one
                    ptx.syncwarp()
                    release_q(smem, 0, lane)
                hand_on(wg, final)
            elif not INTRA_OVERLAP and BACK_TO_BACK:
                # A turn issues O += P~_{j-1} V_{j-1} and S_j = Q K_j^T back to back (FA3 section
                # 3.1), so that the tensor cores go from one to the other without waiting for this
                # warpgroup; both are waited for after the turn has passed. (Nothing may be in
                # flight across the loop's back edge, nor a branch sit between two wgmmas: ptxas
                # would serialise every wgmma. Hence the first S and the last P V apart.)
                stage, parity = slot(it)
                wait_k(smem, stage, parity)
                sm90.wgmma_fence()
                scores(s, q_desc, k_desc0, stage)                              # l.15: S_0
                f = key_factor(k_descale, b, h_kv, j0, by_k_blocks)
                pass_turn(wg)
                WAIT_S(s)
                softmax_step(smem, s, f, o_acc, p, m_i, l_i, sl2, it, 0, j0, t_c, nk, lo_b, hi_b,
                             terms, wg_row0, warp_row, lane)                       # l.16-17
                for j in range(1, t_c):                                            # l.14
                    stage, parity = slot(it + j)
                    prev, prev_parity = slot(it + j - 1)
                    wait_v(smem, prev, prev_parity)
                    wait_k(smem, stage, parity)
                    wait_turn(wg)
                    sm90.wgmma_fence()
                    values(o_acc, p, v_desc0, prev)                            # l.18, block j-1
                    scores(s, q_desc, k_desc0, stage)                          # l.15, block j
                    f = key_factor(k_descale, b, h_kv, j0 + j, by_k_blocks)
                    pass_turn(wg)
                    WAIT_ALL(s, o_acc, p)     # S_j and O += P~_{j-1} V_{j-1} have landed
                    softmax_step(smem, s, f, o_acc, p, m_i, l_i, sl2, it, j, j0, t_c, nk, lo_b,
                                 hi_b, terms, wg_row0, warp_row, lane)             # l.16-17
                stage, parity = slot(it + t_c - 1)
                wait_v(smem, stage, parity)
                if CLEAR_V_TAIL:   # the last block (the loop's never runs past n_k)
                    clear_v_tail(tiles0, stage, (j0 + t_c - 1) * BC, nk, wg, wg_tid)
                wait_turn(wg)
                sm90.wgmma_fence()
                values(o_acc, p, v_desc0, stage)                               # l.18, the last
                WAIT_OP(o_acc, p)
                release_v(smem, stage, lane)                                       # l.19
                hand_on(wg, final)
            elif not INTRA_OVERLAP:
                # The same with O waited for inside the turn, before S_{j+1} is issued.
                tl_t = stamp(tl, 12, tl_t)
                stamped = True
                for j in range(t_c):                                               # l.14
                    stage, parity = slot(it + j)
                    wait_k(smem, stage, parity)
                    tl_t = stamp(tl, 0, tl_t)
                    sm90.wgmma_fence()
                    scores(s, q_desc, k_desc0, stage)                              # l.15
                    f = key_factor(k_descale, b, h_kv, j0 + j, by_k_blocks)
                    pass_turn(wg)
                    tl_t = stamp(tl, 1, tl_t)
                    WAIT_S(s)
                    tl_t = stamp(tl, 2, tl_t)
                    release_k(smem, stage, lane)
                    if O_APART and j == t_c - 1:
                        release_q(smem, 0, lane)
                    logits(s, j0 + j, nk, lo_b, hi_b, terms, wg_row0, warp_row, lane)
                    exponentiate(s, f, m_i, l_i, o_acc, sl2)                       # l.16-17
                    to_a(p, s)
                    tl_t = stamp(tl, 3, tl_t)
                    wait_v(smem, stage, parity)
                    if CLEAR_V_TAIL:
                        clear_v_tail(tiles0, stage, (j0 + j) * BC, nk, wg, wg_tid)
                    tl_t = stamp(tl, 4, tl_t)
                    wait_turn(wg)
                    tl_t = stamp(tl, 5, tl_t)
                    sm90.wgmma_fence()
                    values(o_acc, p, v_desc0, stage)                               # l.18
                    WAIT_OP(o_acc, p)
                    release_v(smem, stage, lane)                                   # l.19
                    tl_t = stamp(tl, 6, tl_t)
                hand_on(wg, final)
            else:
                # FA3 Alg.2 (intra-warpgroup overlap): S_{j} = Q K_j^T is issued together with
                # O += P~_{j-1} V_{j-1}, and the softmax of S_j runs while the tensor cores do the
                # P V product; O is rescaled once that product has landed.
                stage, parity = slot(it)
                wait_k(smem, stage, parity)
                sm90.wgmma_fence()
                scores(s, q_desc, k_desc0, stage)
                f = key_factor(k_descale, b, h_kv, j0, by_k_blocks)
                pass_turn(wg)
                WAIT_S(s)
                release_k(smem, stage, lane)
                if O_APART and t_c == 1:
                    release_q(smem, 0, lane)
                logits(s, j0, nk, lo_b, hi_b, terms, wg_row0, warp_row, lane)
                # O = 0: nothing to defer
                exponentiate(s, f, m_i, l_i, o_acc, sl2)
                to_a(p, s)
                for j in range(1, t_c):
                    stage, parity = slot(it + j)
                    prev, prev_parity = slot(it + j - 1)
                    wait_k(smem, stage, parity)
                    wait_v(smem, prev, prev_parity)
                    wait_turn(wg)
                    sm90.wgmma_fence()
                    scores(s, q_desc, k_desc0, stage)                          # S_j
                    values(o_acc, p, v_desc0, prev)                        # O += P~_{j-1} V_{j-1}
                    f = key_factor(k_descale, b, h_kv, j0 + j, by_k_blocks)
                    pass_turn(wg)
                    WAIT1_S(s)                # S_j has landed; the P V product may still run
                    release_k(smem, stage, lane)
                    if O_APART and j == t_c - 1:
                        release_q(smem, 0, lane)
                    logits(s, j0 + j, nk, lo_b, hi_b, terms, wg_row0, warp_row, lane)
                    exponentiate_deferred(s, f, m_i, l_i, alpha, sl2)
                    WAIT_OP(o_acc, p)         # ... now it has: O and P~_{j-1}'s registers free
                    release_v(smem, prev, lane)
                    tiles.scale_rows(o_acc, alpha)
                    to_a(p, s)
                last, last_parity = slot(it + t_c - 1)
                wait_v(smem, last, last_parity)
                if CLEAR_V_TAIL:   # the last block (the loop's never runs past n_k)
                    clear_v_tail(tiles0, last, (j0 + t_c - 1) * BC, nk, wg, wg_tid)
                wait_turn(wg)
                sm90.wgmma_fence()
                values(o_acc, p, v_desc0, last)
                WAIT_OP(o_acc, p)
                release_v(smem, last, lane)
                hand_on(wg, final)
            it = int32(it + t_c)

            # l.20-21: O_i = diag(l_i)^-1 O_i, L_i = m_i + log(l_i).
            softmax.finalize(m_i, l_i, inv_l, lse_rows, eff_scale)
            if FP8:   # O = descale_v P~ V8 / l, and L without P~'s 2^P_SHIFT
                for r in range(2):
                    inv_l[r] *= v_scale
                    lse_rows[r] -= P_SHIFT * LN2
            tiles.scale_rows(o_acc, inv_l)
            tl_t = stamp(tl, 7, tl_t)
            tl_t = store_o(o, smem, tmaps, stage32, o_acc, tiles0, o_start, bb, b, h, i, first_q,
                           nq, wg, wg_warp, wg_tid, warp, wg_row0, lane, tl, tl_t)         # l.22
            if not O_APART:   # O_i has left Q's room: the next Q may land there
                ptx.bar_sync(1 + wg, WG_THREADS)
                release_q(smem, 0, lane)
            if lane & 3 == 0:
                for r in range(2):
                    row = warp_row + (lane >> 2) + 8 * r
                    if row < nq:
                        lse[bb, h, first_q + row] = lse_rows[r]
            done = int32(done + 1)
            tl_t = stamp(tl, 9, tl_t)
            if STAMPS:   # one record a warp, at the block's last tile: no store in a timed phase
                ptx.syncwarp()   # the warp's LSE stores above land before lane 0 writes over them
                if final and stamped and lane == 0 and warp_row + 16 <= nq:   # its 16 LSE rows
                    stamp_record(lse, tl, bb, h, first_q + warp_row, warp, done, it)
        if (O_BULK and lane == 0) or (O_TMA and wg_tid == 0):
            ptx.bulk_wait(0)   # the last tile's copies done while the block's shared memory lives

    return fa3_forward


@replay.replayed(3)
def forward(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
            align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, out=None, q_descale=None,
            k_descale=None, v_descale=None, scale_block=fp8.DEFAULT_BLOCK, out_dtype="bfloat16",
            score_mod=None, mask_mod=None, score_mod_grad=None, aux=None, block_mask=None,
            **options):
    """FA3 forward (Hopper: sm_90a). q: (B, N_q, H, d), k, v: (B, N_k, H_kv, d) in flash_attn_func's
    layout, on the GPU (CuPy, Numba or torch), fp16 or bf16 — or e4m3 (torch float8_e4m3fn, or
    uint8 bits) with float32 descales (`variants.fp8.quantize_fp8` makes both): q_descale
    (B, H, nb_q), k_descale and v_descale (B, H_kv, nb), x ~= descale[b, h, row // scale_block] x8,
    nb = 1 for one scale a head (V: always one a head); the output is then `out_dtype`. FP8's V may
    come K-major, as the P V wgmma reads it (`fp8.KMajorV`, from `fp8.v_k_major` or
    `fp8.quantize_fp8(v, block=None, k_major=True)`; FA3's V_colmajor): the call then runs no
    pre-pass. Returns
    (o, lse) with o like q (FP8: out_dtype) and lse (B, H, N_q) fp32. options: see Config and
    OPTIONS. Masks (common/tile/masks.py, flash_attn's conventions): causal (bottom-right, or
    align="top_left"), sliding windows, softcap; alibi_slopes and sinks (problem.with_score_terms;
    16-bit inputs); score_mod, mask_mod and their aux (16-bit inputs; common/host/mods.py,
    docs/score_mods.md; score_mod_grad is the backward's, which runs FA2's kernels for them;
    block masks are fa2's for now)."""
    if options.pop("dropout_p", 0):
        raise ValueError("fa3 has no dropout (FA3's kernels have none either): variant='fa2' "
                         "takes dropout_p (flash_attn's functions route it there)")
    descales = (q_descale, k_descale, v_descale)
    fp8_in = arrays.describe(q, "q").dtype in FP8_DTYPES
    vt_given = isinstance(v, fp8.KMajorV)   # V^T made before the call: no pre-pass in it
    if vt_given and not fp8_in:
        raise ValueError("a K-major V (fp8.KMajorV) is for e4m3 (FP8) inputs: 16-bit V is read as "
                         "it is")
    # K stands for a K-major V's geometry in the checks (V's head_dim is K's), V^T checked after
    prob = prepare(q, k, k if vt_given else v, causal=causal, softmax_scale=softmax_scale, out=out,
                   head_dims=FP8_HEAD_DIMS if fp8_in else HEAD_DIMS, variant="fa3",
                   dtypes=FP8_DTYPES if fp8_in else HALF_DTYPES,
                   out_dtype=out_dtype if fp8_in else None, window_size=window_size,
                   softcap=softcap, align=align)
    with_score_terms(prob, alibi_slopes, sinks, align)
    _with_mods(prob, score_mod, mask_mod, score_mod_grad, aux, block_mask)
    if fp8_in:
        scales, k_block_scales, rows = _fp8_scales(prob, descales, scale_block)
        if vt_given:
            v.check(arrays.describe(k, "k"))

        def v_view(cfg):   # what the V tensor map reads: V itself, V^T given, or V^T from the
            if cfg.v_in_producer:   # pre-pass, with its launch, made after the maps
                if vt_given:
                    raise ValueError("transpose_v='producer' transposes V in the kernel, but V came "
                                     "K-major (fp8.KMajorV): pass V itself, or drop transpose_v")
                return prob.v, None
            if vt_given:
                return arrays.bits_view(arrays.describe(v.data), np.uint8), None
            vt, prepass = fp8.v_k_major_deferred(v, stream=prob.stream)
            return arrays.bits_view(arrays.describe(vt), np.uint8), prepass
        problem = (("fp8", True), ("k_block_scales", k_block_scales))
        qkv = tuple(arrays.bits_view(arrays.describe(x), np.uint16, (0, 2, 1, 3),
                                     last_dim_divisor=2)
                    for x in (q, k, k))   # unread: FP8 copies by TMA
    else:
        if any(x is not None for x in descales):
            raise ValueError("q_descale, k_descale, v_descale are for e4m3 (FP8) inputs; q, k, v "
                             f"are {prob.dtype}")
        scales, rows, problem = (arrays.placeholder(prob.library, 3, prob.like),) * 3, (1, 1), ()
        v_view = prob.v
        qkv = (prob.q, prob.k, prob.v)
    return _run(prob, qkv, v_view, scales, rows, problem, options)


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                   causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                   align=masks.BOTTOM_RIGHT, alibi_slopes=None, sinks=None, out=None,
                   score_mod=None, mask_mod=None, score_mod_grad=None, aux=None, block_mask=None,
                   **options):
    """FA3 forward over a packed batch of sequences, as flash_attn_varlen_func (and fa2's
    forward_varlen): q (total_q, H, d), k, v (total_k, H_kv, d) fp16/bf16, sequence b being rows
    cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1 (int32 device arrays, batch + 1 entries). Returns o
    (total_q, H, d) and lse (H, total_q) fp32. The tiles cover max_seqlen_q rows of every
    sequence; one past its sequence's end is skipped by the producer and the consumers alike, so a
    short sequence costs its own tiles only. TMA reads a tile's rows from the packed tensors: past
    a sequence's end they are the next sequence's, masked (keys) or not stored (queries), and the
    consumers zero such V rows before the P V product, so that an inf or NaN there does not reach
    the output through 0 x inf (producer="cp_async" zero-fills them in its copies). FP8 inputs are
    not taken packed (`forward` takes them, with their descales)."""
    stray = sorted(set(options) & {"q_descale", "k_descale", "v_descale", "scale_block"})
    if stray:
        raise ValueError(f"fa3's forward_varlen takes 16-bit inputs, not FP8 ({', '.join(stray)}): "
                         "FP8 runs through forward (a batch of equal lengths)")
    prob = prepare_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          causal=causal, softmax_scale=softmax_scale, out=out,
                          head_dims=HEAD_DIMS, variant="fa3", window_size=window_size,
                          softcap=softcap, align=align)
    with_score_terms(prob, alibi_slopes, sinks, align)
    _with_mods(prob, score_mod, mask_mod, score_mod_grad, aux, block_mask)
    scales = (arrays.placeholder(prob.library, 3, prob.like),) * 3
    return _run(prob, (prob.q, prob.k, prob.v), prob.v, scales, (1, 1), (), options)


def _with_mods(prob, score_mod, mask_mod, score_mod_grad, aux, block_mask):
    """The call's score_mod / mask_mod on prob (common/host/mods.py with_mods), or the error that
    names what fa3 does not take."""
    if block_mask is not None:
        raise ValueError("block_mask: fa3 visits the band's blocks (its producer and consumers "
                         "walk the same steps); a BlockMask's lists are fa2's for now: "
                         "variant='fa2', or fa3 with the mask_mod alone")
    with_mods(prob, score_mod, mask_mod, score_mod_grad, aux, variant="fa3")


def _run(prob, qkv, v_view, scales, rows, problem, options):
    """Launch the problem's configuration: a block a tile, or (persistent) one a SM. FP8:
    v_view(cfg) gives the view the V tensor map reads and the launch of V's pre-pass that fills it
    (or None), run after the maps are made (a new map's upload is a synchronous copy) and right
    before the kernel, its programmatic dependent (Config.pdl)."""
    problem += configs.mask_fields(prob)   # ("window", True) for a sliding window; varlen's fields
    cfg = default_config(prob.head_dim, prob.element, prob.band.banded, problem, **options)
    if cfg.k_block_scales and rows[1] % cfg.block_n:
        raise ValueError(f"scale_block={rows[1]}: K's descales must cover whole key blocks of fa3's "
                         f"FP8 kernel (block_n = B_c = {cfg.block_n}, one factor a block): use a "
                         f"multiple of {cfg.block_n}, or a block_n that divides {rows[1]}")
    seqs = prob.varlen
    box = sm90.SWIZZLE_BYTES // cfg.operand.bytes
    prepass = None
    if cfg.fp8:   # V^T (head_dim rows of 128 keys a box), or V for the producer's transpose
        (v_view, prepass), v_rows = v_view(cfg), (V_UNIT if cfg.v_in_producer else prob.head_dim)
    else:
        v_rows = cfg.block_n
    # the maps depend on the inputs' addresses: a replayed call makes them for its own
    boxes = ((prob.q, WG_ROWS, box), (prob.k, cfg.block_n, box), (v_view, v_rows, box))
    if cfg.o_store == "tma":   # o32's words: a box of 64 rows x 128 bytes, as the room stages it
        boxes += ((prob.o32, WG_ROWS, sm90.SWIZZLE_BYTES // 4),)
    tmaps = replay.derived(tensormaps.tensor_maps, boxes, prob.stream)
    n_q, n_k = (prob.n_q, prob.n_k) if seqs is None else (seqs.max_q, seqs.max_k)
    cu_q, cu_k = (seqs.cu_q, seqs.cu_k) if seqs is not None else \
        (arrays.placeholder(prob.library, 1, prob.like, "int32"),) * 2
    n_items = cfg.work_items((n_q + cfg.block_m - 1) // cfg.block_m, prob.batch * prob.heads)
    grid = min(n_items, target.multiprocessor_count()) if cfg.persistent else n_items
    if prepass is not None:
        prepass()
    launch(build(cfg), grid, cfg.threads, cfg.smem_bytes(), prob.stream,
           tmaps, *qkv, prob.o32, prob.lse, np.int32(n_q), np.int32(n_k),
           np.int32(prob.kv_group), np.int32(prob.heads), np.int32(prob.batch * prob.heads),
           *prob.mask_args(), np.float32(prob.softmax_scale),
           np.float32(prob.softmax_scale * math.log2(math.e)), *scales,
           np.int32(rows[0]), np.int32(rows[1]), cu_q, cu_k, *prob.score_args(), prob.aux,
           programmatic=cfg.after_prepass and prepass is not None)
    return prob.result()


def _fp8_scales(prob, descales, block):
    """The descales as kernel arguments, whether K's vary by block, and the rows a Q and a K scale
    cover; or the error that names what is wrong with them."""
    if any(x is None for x in descales):
        raise ValueError("e4m3 (FP8) q, k, v need their descale factors: q_descale, k_descale, "
                         "v_descale (variants.fp8.quantize_fp8 returns each tensor's)")
    if int(block) != block or block < 1:
        raise ValueError(f"scale_block must be a positive number of rows, got {block!r}")
    views, counts = [], []
    for x, name, heads, n in ((descales[0], "q_descale", prob.heads, prob.n_q),
                              (descales[1], "k_descale", prob.heads_kv, prob.n_k),
                              (descales[2], "v_descale", prob.heads_kv, prob.n_k)):
        d = arrays.describe(x, name)
        blocks = -(-n // block)
        if d.dtype != "float32" or len(d.shape) != 3 or d.shape[:2] != (prob.batch, heads) \
                or d.shape[2] not in (1, blocks):
            raise ValueError(f"{name} must be float32 of shape ({prob.batch}, {heads}, 1) (a scale "
                             f"a head) or ({prob.batch}, {heads}, {blocks}) (a scale per "
                             f"scale_block={block} rows), got {d.dtype} {d.shape}")
        if d.strides != (d.shape[1] * d.shape[2] * 4, d.shape[2] * 4, 4):
            raise ValueError(f"{name} must be contiguous")
        views.append(arrays.bits_view(d, np.float32))
        counts.append(d.shape[2])
    if counts[2] != 1:
        raise ValueError("v_descale must have one scale a head (shape (B, H_kv, 1)): V's scale "
                         "multiplies the whole P V sum, so quantise V with block=None or "
                         "block=seqlen")
    if counts[0] > 1 and block % WG_ROWS:
        raise ValueError(f"scale_block={block}: Q's scales must cover whole 64-row warpgroup "
                         "tiles (a multiple of 64)")
    return views, counts[1] > 1, (block if counts[0] > 1 else 1 << 30, block)


BACKWARD_KERNELS = ("wgmma", "fa2")


def backward_kernel(head_dim, softcap=0.0, kernel=None, mods=False):
    """The backward `backward` runs: `kernel` if given, else "wgmma" (fa3's own) where it takes
    the problem (its head dims, no softcap, no score_mod / mask_mod), else "fa2"."""
    if kernel is not None:
        if kernel == "wgmma" and mods:
            raise ValueError("score_mod / mask_mod: fa3's wgmma backward does not compile them in "
                             "yet; kernel='fa2' (or None) runs FA2's backward kernels, which do")
        return kernel
    from variants import fa3_backward
    return "wgmma" if head_dim in fa3_backward.HEAD_DIMS and not softcap and not mods else "fa2"


def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, kernel=None, **options):
    """fa3's backward from its o and lse: `kernel="wgmma"` (variants/fa3_backward.py: FA2's
    Algorithm 2 with wgmma, TMA and a producer warp, head_dim 32 to 128; options: its
    BackwardConfig) or "fa2" (FA2's kernels, variants/fa2_backward.py, which also take softcap and
    every head_dim; options: fa2's BackwardConfig). None: "wgmma" where it takes the problem, else
    "fa2" (head dims past 128, softcap, score_mod / mask_mod: fa3 has a forward only for them)."""
    from variants import fa3_backward
    kernel = backward_kernel(arrays.describe(q, "q").shape[-1], options.get("softcap"), kernel,
                             any(options.get(n) is not None for n in ("score_mod", "mask_mod")))
    if kernel == "fa2":
        from variants import fa2_backward
        return fa2_backward.backward(do, q, k, v, o, lse, causal=causal,
                                     softmax_scale=softmax_scale, **options)
    if kernel != "wgmma":
        raise ValueError(f"fa3's backward kernel must be one of {BACKWARD_KERNELS} (or None: the "
                         f"one that takes the problem), got {kernel!r}")
    return fa3_backward.backward(do, q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                                 **options)


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    *, kernel=None, **options):
    """The backward of forward_varlen: FA2's kernels for a packed batch
    (variants/fa2_backward.py: backward_varlen; fa3's own backward takes no packed batch yet)."""
    if kernel not in (None, "fa2"):
        raise ValueError(f"fa3's backward of a packed batch runs FA2's kernels (kernel=None or "
                         f"'fa2'), got kernel={kernel!r}")
    from variants import fa2_backward
    return fa2_backward.backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                        max_seqlen_q, max_seqlen_k, **options)


# The head dims the compile report covers: d=192 is d=256's code with three panels a tile, not four
# (fa3 d=192: 168 registers, no spills, 38 HGMMA, like d=256's 42)
REPORTED_HEAD_DIMS = (64, 128, 256)


def compile_targets():
    """(name, kernel, argument types, wgmma count in its PTX) of every configuration `forward`
    launches by default in bf16 (fp16 changes only the wgmma type: d=64 non-causal), d=96 (a
    padded tile) non-causal, FP8 at d=128
    non-causal (one scale a head; V^T from the pre-pass and from the producer), the cp.async producer, Gemma 2's band (a causal window with a
    softcap), a packed batch (varlen, causal), and the backward's (variants/fa3_backward.py)."""
    argtypes = (TMAP_TYPE, QKV_TYPE, QKV_TYPE, QKV_TYPE, OUT_TYPE, LSE_TYPE) + (types.int32,) * 7 \
        + (types.float32,) * 3 + (SCALES_TYPE, SCALES_TYPE, SCALES_TYPE, types.int32, types.int32,
           SEQS_TYPE, SEQS_TYPE) + SCORE_TYPES + MOD_TYPES
    # (head_dim, element, causal, problem fields, options)
    cases = [(d, element, causal, (), {}) for d in REPORTED_HEAD_DIMS
             for element in (BFLOAT16, FLOAT16)
             for causal in (False, True) if element == BFLOAT16 or (d == 64 and not causal)]
    cases += [(96, BFLOAT16, False, (), {}),   # the tile of d=128 with 32 zero columns
              (128, BFLOAT16, False, (("fp8", True), ("k_block_scales", False)), {}),
              (128, BFLOAT16, False, (("fp8", True), ("k_block_scales", False)),
               dict(transpose_v="producer")),
              (128, BFLOAT16, False, (), dict(producer="cp_async")),
              (128, BFLOAT16, True, (("window", True), ("softcap", True)), {}),
              (128, BFLOAT16, True, (("varlen", True), ("bottom_right", True)), {}),
              (128, BFLOAT16, True, (("alibi", True), ("sinks", True)), {})]
    # a user's score_mod and mask_mod (ALiBi, a document mask; 16-bit, causal)
    from variants import score_mods
    example, aux_types = score_mods.compile_example()
    cases += [(128, BFLOAT16, True, (("mods", example),), {})]
    for head_dim, element, causal, problem, options in cases:
        cfg = default_config(head_dim, element, causal, problem, **options)
        # Q K^T: d/k wgmma, P V: B_c/k a step (k = 16, or 32 for e4m3); with the intra-warpgroup
        # overlap or back to back each appears twice (the loop's and the first S / last P V
        # outside it)
        k = cfg.operand.k_step
        qk, pv = -(-head_dim // k), cfg.block_n // k
        total = (2 if cfg.intra_overlap or cfg.back_to_back else 1) * (qk + pv)
        tag = "".join(f" {f}" for f, on in problem
                      if on is True and f in ("window", "softcap", "varlen", "alibi", "sinks")) + \
            "".join(f" {o}={v}" for o, v in options.items())
        args = argtypes
        if cfg.mods is not None:
            tag += " score_mod mask_mod"
            args = argtypes[:-1] + aux_types
        yield f"fa3 d={head_dim} {cfg.operand.tag} causal={causal}{tag}", build(cfg), args, \
            (total, qk + pv)
    from variants import fa3_backward
    yield from fa3_backward.compile_targets()
