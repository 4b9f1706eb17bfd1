"""Decoding: attention of a few new tokens against a long KV cache, split over the keys
(Flash-Decoding: Dao, Haziza, Massa, Sizov 2023), on the tile layer of `common/`.

    o, lse = variants.decode(q, k_cache, v_cache, cache_seqlens, block_table=..., k=..., v=...)

With one query token a sequence, FA2's grid (one thread block per query block, batch and head) has
batch x heads blocks and leaves most SMs idle, while the work is reading the cache: it is bound by
HBM bandwidth, not by the tensor cores. Flash-Decoding's three steps:
1. split the keys and values of each sequence into `num_splits` parts (here: part s holds K/V
   tiles s, s + num_splits, s + 2 num_splits, ..., so that where a part starts does not depend on
   the sequence's length and its first table entries are read beside the length);
2. attend to each part in parallel, one thread block each, writing the part's O (normalised by
   its own l) and its log-sum-exp L;
3. combine: L = log sum_s e^(L_s), O = sum_s e^(L_s - L) O_s: a second, small kernel
   (`combine="kernel"`), or (`combine="fused"`) the split kernel itself, in whichever of a
   (sequence, K/V head)'s split blocks finishes last, which one atomic counter a (sequence, K/V
   head) elects: one launch a decoding step, not two (the protocol: `build`, after step 2).
`split_kv=False` (the ablation) runs step 2 over the whole sequence and writes O, L directly.

What the thread block does (decode_split): grouped-query heads share their K/V head, so the G
query heads of one K/V head and the N_q new tokens are packed into the rows of one query tile
(row r = i * G + g: token i, head g of the group), and each K/V byte is read once per group, not
once per query head. The tile is tiny (G * N_q rows, padded to 16), so instead of splitting the
rows the warps split the keys: each K/V tile of `block_n` keys (cp.async, `stages` tiles in flight,
from the pages of a paged cache) is cut into one slice per warp, each warp runs FA2's inner loop
(S = Q K^T, online softmax, O += P~ V: mma.m16n8k16) over its slices with its own m, l, O, and the
warps' states are merged once at the end, as the splits' are: the same LSE algebra one level down
(in the block, or with `merge_warps="combine"` by step 3 itself, each warp's state a part of its
own).
"""
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from numba import cuda, float32, int32, types, uint16, uint32

from common.hardware import ptx, sm90, target
from common.hardware.elements import BFLOAT16, Element
from common.hardware.stamps import timer_stamper
from common.hardware.target import device_function, kernel
from common.host import arrays, configs, kvcache
from common.host.launching import launch
from common.host.replay import replayed
from common.tile import softmax, splitk, tiles
from common.tile.paging import checked_page, clamp_page, table_entry
from common.tile.smem import SharedLayout
from variants import rotary

# every multiple of 8 from 32 to 256 (tiles of tiles.tile_columns(d) columns, zero past d); past 128
# Q is streamed from its tile (Config.q_held): with Q held, d=256 took 255 registers and spilled 184
# bytes; streamed, 255 and no spill (ptxas, sm_90)
HEAD_DIMS = tuple(range(32, 257, 8))
MAX_ROWS = 64          # query rows of a tile: kv_group * N_q (4 m16 tiles)
MAX_SPLITS = 128
COMBINES = ("kernel", "fused")   # step 3 in a second kernel, or in the split kernel's last block
MERGES = ("block", "combine")    # where a split block's warps are merged: in the block, or by step 3


@dataclass(frozen=True)
class Config:
    """Compile-time shape of the split kernel."""
    head_dim: int
    element: Element       # the 16-bit type of q, the caches and the output (common/hardware/elements.py)
    kv_group: int          # G: query heads per K/V head, packed into the tile's rows
    m_tiles: int           # m16 tiles of query rows: ceil(G * N_q / 16)
    causal: bool           # token i of N_q sees the keys up to its own position (bottom-right)
    paged: bool            # K/V pages looked up in a block table
    split: bool            # write per-split O, L for the combine kernel (False: O, L directly)
    block_n: int = 64      # keys a K/V tile holds (block_n / warps a warp)
    warps: int = 4
    stages: int = 2        # K/V tile buffers (cp.async groups): 2, double buffering, 1-9% faster
    #                        than 3 at B 1-8 (docs/results/decode_stages_h100.txt)
    combine: str = "kernel"  # SPLIT: merge the splits in a second kernel ("kernel") or in the
    #                          split kernel's last block to finish a (sequence, K/V head) ("fused")
    pdl: bool = False      # combine="kernel": launch the combine kernel as a programmatic
    #                        dependent of the split kernel (its blocks ready before the split ends),
    #                        as FA3 does. decode() turns it on by default from sm_90
    #                        (`pdl_by_default`): 0-1 points of the copy rate at B=1 on H100s, in
    #                        every run of 2026-11-27 (decode_warp_parts_h100.txt); none before
    merge_warps: str = "block"   # the block merges its warps' (O, L) and writes one part a split
    #                        (as combine="fused" always does); "combine" (combine="kernel" only):
    #                        each warp writes its own part, splits x warps of them merged by the
    #                        combine kernel. The split kernel is 0.7 us shorter, the combine
    #                        0.5 us longer, a step 0.3-0.8 us slower at B=1 16k, the same at B=4-8
    #                        (decode_warp_parts_h100.txt)
    # flash_attn_with_kvcache's options, each compiled in only where a call passes it (the
    # kernel without them is the one measured above, its PTX unchanged):
    leftpad: bool = False  # cache_leftpad: sequence b's keys start at cache_leftpad[b]
    windowed: bool = False  # window_size: token i (position p) sees keys p - left .. p + right
    softcap: bool = False  # softcap: raw scores S <- cap * tanh(S / cap) (Gemma 2)
    batch_idx: bool = False  # cache_batch_idx: sequence b reads (and appends to) cache row
    #                          cache_batch_idx[b] of a contiguous cache
    alibi: bool = False    # alibi_slopes: S -= slope_h |p - key| (raw: slope / softmax_scale)

    @property
    def q_held(self):
        """Q's A fragments stay in registers through the loop (d <= 128); past that they are read
        from Q's tile at every K/V tile (FA2's Q reload: DT / 16 ldmatrix more a tile), which
        leaves the registers to the O accumulator (d=256: 128 a thread)."""
        return self.tile_dim <= 128

    @property
    def key_floor(self):
        """Whether a sequence's first key can be past 0 (left padding, a window's left edge): its
        splits then start at the tile holding it, and tiles below are never read."""
        return self.leftpad or self.windowed

    @property
    def warp_parts(self):
        """Each warp writes its own part (merge_warps="combine"): splits x warps parts a row."""
        return self.split and self.combine == "kernel" and self.merge_warps == "combine"

    @property
    def parts_per_split(self):
        return self.warps if self.warp_parts else 1

    @property
    def fused(self):
        return self.split and self.combine == "fused"

    @property
    def dependent_combine(self):
        """The combine kernel follows by programmatic dependent launch (`pdl`)."""
        return self.split and self.combine == "kernel" and self.pdl

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def rows(self):
        return 16 * self.m_tiles

    @property
    def keys_per_warp(self):
        return self.block_n // self.warps

    @property
    def tile_dim(self):
        """Columns of a Q, K or V tile: head_dim rounded up to a whole k16 step, the rest zeros."""
        return tiles.tile_columns(self.head_dim)

    @property
    def swizzle(self):
        """Swizzled tiles (64 and 128 columns); the other widths take padded rows."""
        return tiles.swizzle_fits(self.tile_dim)

    @property
    def out_stride(self):
        """Floats a row of the one row-major fp32 O buffer the warps add into where their own
        buffers do not fit (`warp_buffers`; 8 mod 32: no bank conflicts between the 8 row groups
        of a lane's stores)."""
        return self.tile_dim + 8 + self.tile_dim % 32

    @property
    def warp_buffers(self):
        """After the loop each warp stores its O accumulator in its own fp32 buffer in the K/V
        tiles' memory, in fragment order (16-byte stores, no bank conflicts:
        tiles.stage_accumulator_fragments_f32), where W of them fit (one m16 tile at the
        defaults), and the output adds them; otherwise the warps add into one row-major buffer
        one after another, a barrier each. The one-at-a-time way, unrolled W times over 64-bit
        signed index arithmetic, was most of the ~3 us a block took from its last tile to its
        stores (decode_epilogue_h100.txt)."""
        kv = self.smem_layout().regions["kv"].bytes
        return self.warps * self.rows * self.tile_dim * 4 <= kv

    @configs.once_per_config
    def smem_layout(self):
        """Q | stages x (K, V) | the warps' row statistics (m, l). After the loop the K/V region
        holds the fp32 O buffer the warps add into."""
        d = tiles.tile_row_stride(self.tile_dim, self.swizzle)
        return SharedLayout(("q", self.rows * d, 2), ("kv", 2 * self.stages * self.block_n * d, 2),
                            ("stats", 2 * self.warps * self.rows, 4))

    def validate(self):
        if self.combine not in COMBINES:
            raise ValueError(f"combine must be one of {', '.join(COMBINES)}, got {self.combine!r}")
        if self.merge_warps not in MERGES:
            raise ValueError(f"merge_warps must be one of {', '.join(MERGES)}, got "
                             f"{self.merge_warps!r}")
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"decode supports head_dim in {HEAD_DIMS} (multiples of 8 from 32 to "
                             f"256), got {self.head_dim}")
        if self.keys_per_warp % 16 or self.keys_per_warp < 16:
            raise ValueError(f"block_n={self.block_n} must give each of the {self.warps} warps "
                             "a multiple of 16 keys")
        if self.stages < 2:
            raise ValueError(f"stages must be at least 2, got {self.stages}")
        if self.batch_idx and self.paged:
            raise ValueError("cache_batch_idx picks rows of a contiguous cache; a paged cache's "
                             "block_table already says where each sequence lies")
        if not 1 <= self.m_tiles <= MAX_ROWS // 16:
            raise ValueError(f"kv_group x seqlen_q must be at most {MAX_ROWS} rows")
        tiles.check_tile_copy(self.block_n, self.tile_dim, self.threads)
        layout = self.smem_layout()
        if self.rows * self.out_stride * 4 > layout.regions["kv"].bytes:
            raise ValueError("the K/V tiles are too small to hold the merged O: raise block_n")
        if self.fused and merge_scratch_floats(self.head_dim, self.threads) * 4 > \
                layout.regions["kv"].bytes:
            raise ValueError("the K/V tiles are too small to hold the fused merge's scratch: "
                             "raise block_n")
        if layout.bytes > target.MAX_SHARED_BYTES:
            raise ValueError(f"{layout.bytes} bytes of shared memory: lower stages or block_n")
        return self


OPTIONS = ("block_n", "warps", "stages", "combine", "pdl", "merge_warps")


def make_config(head_dim, element, kv_group, n_q, causal, paged, split, *, leftpad=False,
                windowed=False, softcap=False, batch_idx=False, alibi=False, **options):
    """The Config of a call: the problem's shape and options (leftpad ... batch_idx: which of
    flash_attn_with_kvcache's options it passes), then the tuning `options` (OPTIONS)."""
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise ValueError(f"decode has no option {', '.join(sorted(unknown))}; its options: "
                         f"{', '.join(OPTIONS)}")
    rows = kv_group * n_q
    if rows > MAX_ROWS:
        raise ValueError(f"decode packs heads / heads_kv x seqlen_q = {kv_group} x {n_q} query "
                         f"rows into one tile: at most {MAX_ROWS}; use variants.forward for long "
                         "queries")
    chosen = {k: v for k, v in options.items() if v is not None}
    if not split and chosen.get("combine") in COMBINES:
        chosen.pop("combine")   # nothing to combine: one kernel whichever way
    kernel = split and chosen.get("combine", Config.combine) == "kernel"
    if "pdl" in chosen:   # only a combine kernel can be a dependent launch: elsewhere the same kernel
        chosen["pdl"] = bool(chosen["pdl"])
        if not kernel:
            chosen.pop("pdl")
    if not kernel and chosen.get("merge_warps") in MERGES:
        chosen.pop("merge_warps")   # no combine kernel to merge the warps: the block does
    terms = tuple(name for name, on in (("leftpad", leftpad), ("windowed", windowed),
                                        ("softcap", softcap), ("batch_idx", batch_idx),
                                        ("alibi", alibi)) if on)
    return _config(head_dim, element, kv_group, (rows + 15) // 16, causal, paged, split,
                   tuple(sorted(chosen.items())), terms)


@lru_cache(maxsize=None)
def _config(head_dim, element, kv_group, m_tiles, causal, paged, split, chosen, terms=()):
    return Config(head_dim, element, kv_group, m_tiles, causal, paged, split,
                  **dict(chosen), **{name: True for name in terms}).validate()


@lru_cache(maxsize=4096)   # a function of ints, asked every decoding step (a loop over up to 128)
def num_splits_heuristic(batch, heads_kv, max_seqlen_k, sm_count, block_n, blocks_per_sm=2):
    """Splits a sequence's keys are cut into: the fewest whose thread blocks fill the GPU's slots
    (sm_count x blocks_per_sm) in whole waves, >= 95% of the last wave busy, as FA2's heuristic
    weighs waves; no split shorter than two K/V tiles. Measured on an H100
    (docs/results/decode_h100.txt): 5 splits of 64 blocks (1.2 waves) ran at 60% of the copy
    bandwidth where 8 (1.9 waves) ran at 94%. Two blocks fit a SM: with two K/V stages (the
    default since decode_stages_h100.txt) 70 KB of shared memory would let three, but not 174
    registers a thread; at B=1 16k 48 splits ran 6% slower than 32 (decode_stages_h100.txt)."""
    blocks = batch * heads_kv
    slots = sm_count * blocks_per_sm
    most = max(1, min(MAX_SPLITS, max(1, -(-max_seqlen_k // block_n)) // 2))
    if blocks >= slots or most == 1:
        return 1

    def busy(splits):   # the fraction of the slots busy over the waves
        waves = blocks * splits / slots
        return waves / math.ceil(waves)

    best = max(busy(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if busy(s) >= 0.95 * best)


@device_function
def fragment_offset(row, col, n_tiles):
    """Where element (row, col) of a warp's m16n8 accumulator tiles (n_tiles across) lies in the
    fragment-order buffer of tiles.stage_accumulator_fragments_f32: lane 4 (row % 8) + (col % 8)
    / 2 of tile (row / 16, col / 8) holds it in register 2 ((row % 16) / 8) + col % 2. row, col
    unsigned; col even gives (col, col + 1) as two adjacent floats."""
    lane = ((row & uint32(7)) << uint32(2)) | ((col & uint32(7)) >> uint32(1))
    k = (row >> uint32(4)) * uint32(n_tiles) + (col >> uint32(3))
    return (((k << uint32(5)) + lane) << uint32(2)) + (((row >> uint32(3)) & uint32(1)) << uint32(1)) \
        + (col & uint32(1))


if target.SIMULATOR:   # the simulator has one coherent memory and no ld.global.cg
    @device_function
    def load_through_l2(a, at):
        return a[at]
else:
    # numba's cuda.ldcg is an @overload (compiled as a device function, which asks for a current
    # device: no compile_ptx without a GPU) and emits its asm without side effects, which LLVM may
    # move across the fence before it; this one is volatile, as common/hardware/_inline_asm.py's loads are.
    from numba.core import cgutils
    from numba.cuda.extending import intrinsic

    from common.hardware._inline_asm import _asm, _f32, _global_address

    @intrinsic
    def load_through_l2(typingctx, a, at):
        """a[at] (float32, `at` a tuple of int32 indices) by ld.global.cg: cached in L2 only. The
        fused combine reads partials that blocks on other SMs stored during this launch; a SM's
        L1 is not coherent with their stores and may hold a line of lse_part that an earlier
        merge on this SM read before they landed."""
        sig = types.float32(a, at)

        def codegen(context, builder, sig, args):
            aryty, atty = sig.args
            indices = cgutils.unpack_tuple(builder, args[1], atty.count)
            addr = _global_address(context, builder, aryty, args[0], indices,
                                   [atty.dtype] * atty.count)
            return _asm(builder, _f32, [addr], "ld.global.cg.f32 $0, [$1];", "=f,l",
                        side_effect=True)

        return sig, codegen


@lru_cache(maxsize=None)
def build_merge(through_l2, head_dim, threads, element):
    """Step 3 for one row (b, h, i) by a whole thread block: O = sum_s e^(L_s - L) O_s over the
    splits' o_part, lse_part, L = log sum_s e^(L_s), written to o32, lse. The combine kernel's
    loads are ordinary, the fused combine's go through L2 (`load_through_l2`); one arithmetic for
    both paths, so combine="fused" gives combine="kernel"'s bits.

    The splits are spread over the warps, not walked by each thread: every warp reads the row's
    L_s (a lane each), takes their max and sum by shuffles and keeps its weights e^(L_s - max) in
    shared memory; warp w then adds up splits w, w + W, ... over all d columns (lane + 32 k), U
    splits' loads in flight at once (the first U's issued before the L_s loads, so that up to U W
    splits cost one round trip to L2), and the W partial sums meet in shared memory. A thread that
    walked all S splits itself (one column pair a thread, the first version) paid S / 4 rounds of
    L2 latency in a row: 8.7 us at 32 splits for a 64 MB cache whose K/V read takes 22 us
    (docs/results/decode_combine_h100.txt)."""
    D, THREADS, ELEM = head_dim, threads, element.code
    W, CPL, U, NK = threads // 32, -(-head_dim // 32), 8, MAX_SPLITS // 32
    WTS, PART = 0, W * MAX_SPLITS       # scratch: the warps' weights, then their partial O rows

    @device_function
    def load(a, at):
        if through_l2:
            return load_through_l2(a, at)
        return a[at]

    @device_function
    def load_round(got, o_part, b, h, i, s0, lane, n_splits):
        """got[u, k] = O_s[lane + 32 k] of splits s = s0 + u W (zero past the last split and
        past d)."""
        for u in range(U):
            s = uint32(s0 + u * W)
            for k in range(CPL):
                col = uint32(lane + 32 * k)
                got[u, k] = load(o_part, (s, b, h, i, col)) \
                    if s < n_splits and (D % 32 == 0 or col < D) else float32(0)

    @device_function
    def merge_row(o_part, lse_part, o32, lse, b, h, i, n_splits, scratch, tid):
        """scratch: float32 shared memory of `merge_scratch_floats(head_dim, threads)`, free for
        this call; every thread of the block calls (it has barriers); the block's own earlier
        stores to scratch are done (a barrier before, as between two rows)."""
        # unsigned indices: no negative-index wrap-around arithmetic for every load
        b, h, i, n_splits = uint32(b), uint32(h), uint32(i), uint32(n_splits)
        warp, lane = tid >> 5, tid & 31
        got = cuda.local.array((U, CPL), float32)
        load_round(got, o_part, b, h, i, warp, lane, n_splits)   # in flight with the L_s loads
        lse_s = cuda.local.array(NK, float32)
        mx = float32(-math.inf)
        for k in range(NK):
            s = uint32(lane + 32 * k)
            lse_s[k] = load(lse_part, (s, b, h, i)) if s < n_splits else float32(-math.inf)
            mx = max(mx, lse_s[k])
        for k in range(5):
            mx = max(mx, ptx.shfl_xor_f32(mx, int32(1 << k)))
        total = float32(0)
        wts = scratch[WTS + warp * MAX_SPLITS:WTS + (warp + 1) * MAX_SPLITS]
        for k in range(NK):
            w = float32(0) if lse_s[k] == float32(-math.inf) else math.exp(lse_s[k] - mx)
            wts[lane + 32 * k] = w
            total += w
        for k in range(5):
            total += ptx.shfl_xor_f32(total, int32(1 << k))
        ptx.syncwarp()
        acc = cuda.local.array(CPL, float32)
        for k in range(CPL):
            acc[k] = float32(0)
        for s0 in range(warp, int32(n_splits), U * W):     # U of this warp's splits a round
            if s0 != warp:
                load_round(got, o_part, b, h, i, s0, lane, n_splits)
            for u in range(U):
                s = uint32(s0 + u * W)
                if s < n_splits:
                    for k in range(CPL):
                        acc[k] += wts[s] * got[u, k]
        for k in range(CPL):
            if D % 32 == 0 or lane + 32 * k < D:
                scratch[uint32(PART + warp * D + lane + 32 * k)] = acc[k]
        cuda.syncthreads()
        inv = float32(1) / total if total > float32(0) else float32(0)
        for c2 in range(tid, D // 2, THREADS):
            y0, y1 = float32(0), float32(0)
            for w in range(W):
                y0 += scratch[uint32(PART + w * D + 2 * c2)]
                y1 += scratch[uint32(PART + w * D + 2 * c2 + 1)]
            o32[b, i, h, uint32(c2)] = tiles.pack_pair(y0 * inv, y1 * inv, ELEM)
        if tid == 0:
            lse[b, h, i] = mx + math.log(total) if total > float32(0) else float32(-math.inf)
        cuda.syncthreads()

    return merge_row


def merge_scratch_floats(head_dim, threads):
    """Shared float32 words a block's merge_row uses: W x MAX_SPLITS weights, W x d partial O."""
    return threads // 32 * (MAX_SPLITS + head_dim)


STAMP_LAST_WORDS = 8   # build(cfg, stamps=True): the words a (sequence, K/V head)'s last block stamps


def stamp_offsets(groups, splits):
    """Where build(cfg, stamps=True) writes its stamps (%globaltimer_lo, ns mod 2^32) in the fused
    combine's counters (int32), for `groups` = batch x heads_kv (sequence, K/V head)s of `splits`
    blocks each, block (split, b, h_kv) numbered (b heads_kv + h_kv) splits + split: after the
    `groups` tickets, from `pairs` each block's start and the end of its step 2 (its partials
    stored and fenced: (b), (c)), 2 words a block; from `last` each group's last block's 8 words
    (its start, loop end, partials stored, fenced, ticket taken, fence (f), merge end, and its
    split); from `first` each block's first K/V tile landed (its start where it had none).
    Returns (pairs, last, first, words in all)."""
    blocks = groups * splits
    pairs = groups
    last = pairs + 2 * blocks
    first = last + STAMP_LAST_WORDS * groups
    return pairs, last, first, first + blocks


@device_function
def stamp_words(b, h_kv, split):
    """build(cfg, stamps=True): split block (split, b, h_kv)'s words in the counters, as
    stamp_offsets lays them out over the grid (splits, batch, heads_kv): its (start, fenced) pair,
    its group's last block's 8, its first tile's."""
    groups = int32(cuda.gridDim.y * cuda.gridDim.z)
    group = b * int32(cuda.gridDim.z) + h_kv
    block = group * int32(cuda.gridDim.x) + split
    last = groups + 2 * int32(cuda.gridDim.x) * groups
    return groups + 2 * block, last + STAMP_LAST_WORDS * group, \
        last + STAMP_LAST_WORDS * groups + block


def _loaders(cfg):
    """The split kernel's copies into shared memory, for one configuration: (load_q, load_kv,
    tile_entry)."""
    D, BN, THREADS, RT, G = cfg.head_dim, cfg.block_n, cfg.threads, cfg.rows, cfg.kv_group
    PAGED = cfg.paged
    # tiles of DT = tile_columns(d) columns, swizzled at 64 and 128 (SWZ), zero past d (VALID: the
    # valid columns for load_tile_async's zero fill, 0 when every column is d's)
    DT, SWZ = cfg.tile_dim, cfg.swizzle
    VALID, CH = (0 if DT == D else D), DT // 8
    # a thread keeps one column of 16-byte chunks (tiles.copy_split) when a row's chunks divide
    # the threads; otherwise (d = 96: 12 chunks, or a zero-filled tail) chunks dealt out in order
    BY_COLUMNS = THREADS % CH == 0 and DT == D
    STRIDE = tiles.tile_row_stride(DT, SWZ)
    # a K/V tile lies in one page when pages hold >= B_n keys (a runtime test on page_shift)
    TILE_IN_PAGE, BN_SHIFT = BN & (BN - 1) == 0, BN.bit_length() - 1

    @device_function
    def load_q(q_s, q, b, h_kv, n_q, tid):
        """Row r = i * G + g of the tile: token i of query head h_kv * G + g (zeros past N_q
        and past d)."""
        if BY_COLUMNS:
            r, col, row_step = tiles.copy_split(tid, D, THREADS)
            for it in range(RT // row_step if RT >= row_step else 1):
                row = r + it * row_step
                if row < RT:
                    i = row // G
                    inside = i < n_q
                    src = q[b, :, h_kv * G + row - i * G]       # (N_q, d): the head's tokens
                    ptx.cp_async_16(q_s, tiles.smem_offset(row, col, STRIDE, SWZ), src,
                                    i if inside else 0, col, 16 if inside else 0)
            return
        for c in range(tid, RT * CH, THREADS):
            row, col = tiles.chunk_position(c, DT)
            i = row // G
            inside = i < n_q and col < D
            src = q[b, :, h_kv * G + row - i * G]
            ptx.cp_async_16(q_s, tiles.smem_offset(row, col, STRIDE, SWZ), src,
                            i if inside else 0, col if inside else 0, 16 if inside else 0)

    @device_function
    def load_kv(tile, cache, block_table, b, h_kv, key0, n_k, page_shift, entry, tid):
        """Keys key0 .. key0 + B_n - 1 of sequence b (zeros past n_k) from its pages: key t is
        slot t mod page_size of page block_table[b, t / page_size] (a contiguous cache: of
        page b), clamped into the cache so that no table entry can send a read outside it.
        Where one page holds the whole tile (pages of >= B_n keys: tiles start at multiples of
        B_n, both powers of two), the tile's table entry `entry` was read ahead by the caller
        (`tile_entry`), and each thread's 64-bit row address is computed once and moved by whole
        row pitches (tiles.load_tile_async), as for a contiguous cache; per key, the entry lookup
        and the cache's 4-D index arithmetic were most of the kernel's instructions
        (docs/results/decode_page_once_h100.txt)."""
        if not PAGED:
            tiles.load_tile_async(tile, cache[b, :, h_kv], key0, n_k, 0, BN, DT, STRIDE, SWZ, tid,
                                  THREADS, True, VALID)
            return
        last_page = int32(cache.shape[0] - 1)
        if TILE_IN_PAGE and page_shift >= BN_SHIFT:
            page = clamp_page(entry, last_page)
            slot0 = key0 & int32((1 << page_shift) - 1)
            tiles.load_tile_async(tile, cache[page, :, h_kv], slot0, int32(slot0 + n_k - key0), 0,
                                  BN, DT, STRIDE, SWZ, tid, THREADS, True, VALID)
            return
        if BY_COLUMNS:
            r, col, row_step = tiles.copy_split(tid, D, THREADS)
            for it in range(BN // row_step):
                row = r + it * row_step
                key = int32(key0 + row)
                inside = key < n_k
                page = checked_page(block_table, b, key, page_shift, last_page) if inside \
                    else int32(0)
                slot = key & int32((1 << page_shift) - 1)
                ptx.cp_async_16(tile, tiles.smem_offset(row, col, STRIDE, SWZ),
                                cache[page, :, h_kv], slot if inside else 0, col,
                                16 if inside else 0)
            return
        for c in range(tid, BN * CH, THREADS):
            row, col = tiles.chunk_position(c, DT)
            key = int32(key0 + row)
            inside = key < n_k
            page = checked_page(block_table, b, key, page_shift, last_page) if inside else int32(0)
            slot = key & int32((1 << page_shift) - 1)
            copy = inside and col < D
            ptx.cp_async_16(tile, tiles.smem_offset(row, col, STRIDE, SWZ), cache[page, :, h_kv],
                            slot if inside else 0, col if copy else 0, 16 if copy else 0)

    @device_function
    def tile_entry(block_table, b, t, page_shift):
        """The block-table entry of K/V tile t of sequence b (0 for a contiguous cache), read
        ahead of the tile's load_kv so that its latency is not paid just before the copy (for
        pages smaller than a tile load_kv looks each key up itself and ignores it)."""
        if not PAGED:
            return int32(0)
        return table_entry(block_table, b, int32(t * BN), page_shift)

    return load_q, load_kv, tile_entry


@lru_cache(maxsize=None)
def build(cfg, stamps=False):
    """The split kernel of one configuration (steps 1-2; with combine="fused", step 3 too).
    stamps (combine="fused" only): a probe's %globaltimer_lo stamps compiled in, stored into
    spare words of the counters past the tickets (`stamp_offsets` says where; the counters must
    hold that many: split_counters(..., needed)); experiments/probes/decode_stamps.py launches
    `decode` with build(cfg, stamps=True). Without them the PTX has no trace of them."""
    if stamps and not cfg.fused:
        raise ValueError("decoding's stamps go into the fused combine's counters: they need "
                         "split=True, combine='fused'")
    now, put = timer_stamper(stamps)
    STAMPS = stamps
    D, BN, THREADS, W = cfg.head_dim, cfg.block_n, cfg.threads, cfg.warps
    M, RT, G, KPW = cfg.m_tiles, cfg.rows, cfg.kv_group, cfg.keys_per_warp
    ELEM, CAUSAL, SPLIT, STAGES = cfg.element.code, cfg.causal, cfg.split, cfg.stages
    FUSED, TRIGGER, WARP_PARTS = cfg.fused, cfg.dependent_combine, cfg.warp_parts
    LEFTPAD, WINDOWED, SOFTCAP, BATCH_IDX = cfg.leftpad, cfg.windowed, cfg.softcap, cfg.batch_idx
    FLOOR, ALIBI = cfg.key_floor, cfg.alibi
    merge_row = build_merge(True, D, THREADS, cfg.element)
    MERGE_FLOATS = merge_scratch_floats(D, THREADS)
    DT, SWZ = cfg.tile_dim, cfg.swizzle   # tiles of DT = tile_columns(d) columns (_loaders)
    STRIDE = tiles.tile_row_stride(DT, SWZ)
    Q_TILE, KV_TILE = RT * STRIDE, BN * STRIDE
    LAYOUT = cfg.smem_layout()
    Q0, KV0, STATS0 = LAYOUT.start("q"), LAYOUT.start("kv"), LAYOUT.start("stats")
    O0, OSTRIDE = LAYOUT.start("kv", 4), cfg.out_stride
    WARP_BUFFERS, WARP_FLOATS = cfg.warp_buffers, cfg.rows * DT
    # Q's A fragments held in registers for the whole loop (d <= 128), or streamed from its tile one
    # k-step at a time (`q_held`: past 128 columns, held Q and the O accumulator would spill)
    HELD = cfg.q_held
    Q_FRAG = (M, DT // 16 if HELD else 1, 4)
    S_ACC, P_FRAG, O_ACC = (M, KPW // 8, 4), (M, KPW // 16, 4), (M, DT // 8, 4)
    ROWS = 2 * M
    HALF = D // 2
    # cp.async groups left in flight (literals, as the wait instruction wants): Q's group is the
    # oldest after the prologue; in the loop, tile t's once `stages - 2` newer ones are pending
    Q_LANDED, TILE_LANDED = STAGES - 1, STAGES - 2
    load_q, load_kv, tile_entry = _loaders(cfg)

    @device_function
    def mask_keys(s, key0, n_k, n_q, first_key, window_left, window_right, lane):
        """-inf where key >= n_k or (CAUSAL) key is after row r's token: token i = r / G of N_q
        sits at key position p = n_k - N_q + i (bottom-right); (LEFTPAD) where key < first_key,
        the sequence's left padding; (WINDOWED) outside p - window_left .. p + window_right."""
        for m in range(M):
            for n in range(KPW // 8):
                for j in range(4):
                    r, c = tiles.accumulator_position(m, n, j, lane)
                    limit = n_k
                    if CAUSAL:
                        limit = min(n_k, int32(n_k - n_q + 1 + r // G))
                    floor = first_key
                    if WINDOWED:
                        p = int32(n_k - n_q + r // G)
                        floor = max(floor, int32(p - window_left))
                        limit = min(limit, int32(p + window_right + 1))
                    key = int32(key0 + c)
                    if key >= limit or (FLOOR and key < floor):
                        s[m, n, j] = float32(-math.inf)

    @device_function
    def add_alibi(s, key0, n_k, n_q, slopes, lane):
        """S -= slope_r |p - key| on raw scores (slopes[2m + h]: row r's slope over the softmax
        scale, for the thread's rows r = 16m + lane / 4 + 8h); token i = r / G at position
        p = n_k - N_q + i."""
        for m in range(M):
            for n in range(KPW // 8):
                for j in range(4):
                    r, c = tiles.accumulator_position(m, n, j, lane)
                    far = float32(int32(n_k - n_q + r // G - key0 - c))
                    s[m, n, j] -= slopes[2 * m + (j >> 1)] * abs(far)

    @device_function
    def row_slopes(slopes, alibi, alibi_stride, b, h_kv, n_q, inv_scale, lane):
        """slopes[2m + h] <- the slope of the thread's row r = 16m + lane / 4 + 8h (head
        h_kv G + r mod G of sequence b) over the softmax scale; 0 for rows past G N_q."""
        for m in range(M):
            for hh in range(2):
                r = int32(16 * m + (lane >> 2) + 8 * hh)
                slopes[2 * m + hh] = alibi[b * alibi_stride + h_kv * G + r % G] * inv_scale \
                    if r < G * n_q else float32(0)

    @device_function
    def row_totals(stats, row, scale_log2):
        """The merged (max, sum of e^(s - max)) of a row over the warps' statistics."""
        mx = float32(-math.inf)
        for w in range(W):
            mx = max(mx, stats[STATS0 + w * RT + row])
        base = softmax.exp2_base(mx, scale_log2)
        total = float32(0)
        for w in range(W):
            total += stats[STATS0 + (W + w) * RT + row] * \
                ptx.ex2_approx(stats[STATS0 + w * RT + row] * scale_log2 - base)
        return mx, base, total

    @kernel
    def decode_split(q, k_cache, v_cache, block_table, cache_seqlens, cache_leftpad,
                     cache_batch_idx, alibi, o32, lse, o_part, lse_part, counters, n_q, n_new,
                     page_shift, softmax_scale, scale_log2, window_left, window_right,
                     softcap_raw, alibi_stride):
        """q: (B, N_q, H, d) uint16; k_cache, v_cache: (pages, page_size, H_kv, d) uint16;
        block_table (B, max_blocks) int32 (PAGED); cache_seqlens (B,) int32; cache_leftpad (B,)
        int32 (LEFTPAD: sequence b's first key); cache_batch_idx (B,) int32 (BATCH_IDX: sequence
        b's row of the cache); window_left, window_right (WINDOWED; >= 0, 2^30 for none);
        softcap_raw = softcap / softmax_scale (SOFTCAP); alibi (ALIBI) fp32 slopes, sequence b's
        from b * alibi_stride. Writes o32 (B, N_q,
        H, d/2) uint32 pairs and lse (B, H, N_q), or (SPLIT) o_part (S, B, H, N_q, d) fp32 and
        lse_part (S, B, H, N_q) for split s = blockIdx.x of the keys, and then (FUSED) the last
        split block of (b, h_kv) to finish merges them into o32, lse; counters (>= B * H_kv,)
        int32, zero between launches (FUSED only)."""
        if TRIGGER:   # the combine kernel's blocks may start now: they wait (griddep_wait)
            sm90.griddep_launch_dependents()   # for this grid's end before reading its output
        tid = int32(cuda.threadIdx.x)
        t_start = now()           # stamps (a probe's; off: 0, and nothing stored): the start
        warp, lane = tid >> 5, tid & 31
        split, b, h_kv = int32(cuda.blockIdx.x), int32(cuda.blockIdx.y), int32(cuda.blockIdx.z)
        # Step 1: this split's K/V tiles: split, split + S, split + 2 S, ... below the sequence's
        # n_tiles (S = gridDim.x splits). Where a split starts does not depend on the sequence's
        # length, so the table entries of its first tile and of the first one the loop will ask
        # for are read beside cache_seqlens[b] (three loads in flight, not two in a row), and Q's
        # copy is under way before the length is known.
        n_splits = int32(cuda.gridDim.x)
        ahead = int32((STAGES - 1) * n_splits)    # the loop asks for tile t + ahead at tile t
        # the sequence's row of a contiguous cache (clamped: an unchecked bad index stays inside)
        cache_row = clamp_page(cache_batch_idx[b], int32(k_cache.shape[0] - 1)) if BATCH_IDX \
            else b
        if FLOOR:
            # the sequence's keys start at first_key (left padding) and no token sees a key below
            # its window's left edge: the splits share out the tiles from the one holding the
            # lowest key any token sees (t0), and the table entries wait for the lengths
            n_k = int32(cache_seqlens[b] + n_new)
            # clamped into 0 .. n_k: an unchecked bad padding leaves no key, never a far tile
            first_key = min(max(int32(cache_leftpad[b]), int32(0)), n_k) if LEFTPAD \
                else int32(0)
            lowest = first_key
            if WINDOWED:
                lowest = max(lowest, int32(n_k - n_q - window_left))
            t0 = int32(split + uint32(max(lowest, int32(0))) // uint32(BN))
            entry0 = tile_entry(block_table, b, t0, page_shift)
            entry_next = tile_entry(block_table, b, int32(t0 + ahead), page_shift)
        else:
            t0 = split
            first_key = int32(0)
            entry0 = tile_entry(block_table, b, split, page_shift)
            entry_next = tile_entry(block_table, b, int32(split + ahead), page_shift)
            n_k = int32(cache_seqlens[b] + n_new)

        smem = cuda.shared.array(0, uint16)
        stats = cuda.shared.array(0, float32)
        q_s = smem[Q0:Q0 + Q_TILE]
        load_q(q_s, q, b, h_kv, n_q, tid)
        ptx.cp_async_commit()
        n_tiles = int32(uint32(n_k + BN - 1) // uint32(BN))
        for st in range(STAGES - 1):    # the first stages - 1 tiles in flight
            t = int32(t0 + st * n_splits)
            if t < n_tiles:
                kv = KV0 + st * 2 * KV_TILE
                entry = entry0 if st == 0 else tile_entry(block_table, b, t, page_shift)
                load_kv(smem[kv:kv + KV_TILE], k_cache, block_table, cache_row, h_kv,
                        int32(t * BN), n_k, page_shift, entry, tid)
                load_kv(smem[kv + KV_TILE:kv + 2 * KV_TILE], v_cache, block_table, cache_row,
                        h_kv, int32(t * BN), n_k, page_shift, entry, tid)
            ptx.cp_async_commit()
        ptx.cp_async_wait(Q_LANDED)      # Q (the oldest group) has landed
        cuda.syncthreads()
        q_frag = cuda.local.array(Q_FRAG, uint32)
        if HELD:
            for m in range(M):
                tiles.load_a_fragments(q_frag, m, q_s, 16 * m, lane, STRIDE, SWZ)

        # Step 2: FA2's inner loop (Alg.1 l.6-10), each warp over its slice of every tile.
        o_acc = cuda.local.array(O_ACC, float32)
        tiles.fill(o_acc, float32(0))
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        softmax.init_rows(m_i, l_i)
        s = cuda.local.array(S_ACC, float32)
        p = cuda.local.array(P_FRAG, uint32)
        slopes = cuda.local.array(ROWS, float32)
        if ALIBI:
            row_slopes(slopes, alibi, alibi_stride, b, h_kv, n_q, float32(1) / softmax_scale,
                       lane)
        key_w = warp * KPW                     # the warp's first key in a tile
        t_tile = t_start                       # stamps: the first tile landed (none: the start)
        t = t0                                 # this split's k-th tile, in buffer k mod stages
        k = int32(0)
        # a tile is masked where it reaches past the lowest row's last key (n_k; causal: token
        # 0's) or below the highest first key (the left padding; the last token's window edge)
        mask_above = int32(n_k - n_q + 1) if CAUSAL else n_k
        if WINDOWED:
            mask_above = min(mask_above, int32(n_k - n_q + 1 + window_right))
        mask_below = first_key
        if WINDOWED:
            mask_below = max(mask_below, int32(n_k - 1 - window_left))
        while t < n_tiles:
            ptx.cp_async_wait(TILE_LANDED)     # tile t has landed ...
            cuda.syncthreads()                 # ... and every warp is done with the one before
            if k == 0:
                t_tile = now()
            nxt = int32(t + ahead)             # refill that one's buffers with tile t + ahead,
            if nxt < n_tiles:                  # whose table entry was read an iteration ago
                kv = KV0 + int32(uint32(k + STAGES - 1) % uint32(STAGES)) * 2 * KV_TILE
                load_kv(smem[kv:kv + KV_TILE], k_cache, block_table, cache_row, h_kv,
                        int32(nxt * BN), n_k, page_shift, entry_next, tid)
                load_kv(smem[kv + KV_TILE:kv + 2 * KV_TILE], v_cache, block_table, cache_row,
                        h_kv, int32(nxt * BN), n_k, page_shift, entry_next, tid)
            ptx.cp_async_commit()
            entry_next = tile_entry(block_table, b, int32(nxt + n_splits), page_shift)  # the next
            kv = KV0 + int32(uint32(k) % uint32(STAGES)) * 2 * KV_TILE + key_w * STRIDE
            k_w = smem[kv:kv + KPW * STRIDE]
            v_w = smem[kv + KV_TILE:kv + KV_TILE + KPW * STRIDE]
            key0 = int32(t * BN + key_w)
            # l.8: S = Q K^T over the warp's keys; l.9-10: online softmax, O += P~ V.
            tiles.fill(s, float32(0))
            tiles.gemm_abt_held_or_streamed(s, q_frag, HELD, q_s, 0, DT // 16, k_w, lane, STRIDE,
                                            SWZ, ELEM)
            if SOFTCAP:
                softmax.softcap_scores(s, softcap_raw)
            if ALIBI:
                add_alibi(s, key0, n_k, n_q, slopes, lane)
            if int32(t * BN + BN) > mask_above or (FLOOR and int32(t * BN) < mask_below):
                mask_keys(s, key0, n_k, n_q, first_key, window_left, window_right, lane)
            softmax.online_softmax(s, m_i, l_i, o_acc, scale_log2, float32(0), 0)
            tiles.accumulator_to_a(p, s, ELEM)
            tiles.gemm_ab(o_acc, p, v_w, lane, STRIDE, SWZ, ELEM)
            t = int32(t + n_splits)
            k = int32(k + 1)

        if WARP_PARTS:
            # merge_warps="combine": no merge here. Each warp's (O_w / l_w, L_w) over the keys it
            # saw is a part of its own, p = split * W + warp, which the combine kernel merges with
            # every other (step 3's algebra does not care whether two parts came from two blocks
            # or two warps): the block's last barrier, the staging of W fp32 O tiles through
            # shared memory and their sums are gone from the end of every split block, where
            # nothing else runs. It trades them for W times the parts to write and merge
            # (decode_warp_parts_h100.txt: a step no faster; not the default).
            part = uint32(split * W + warp)
            n_rows = uint32(G * n_q)
            for m in range(M):
                for hh in range(2):
                    l_w = softmax.quad_sum(l_i[2 * m + hh])
                    row = uint32(16 * m + 8 * hh) + uint32(lane >> 2)
                    if row < n_rows:
                        i = row // uint32(G)
                        h = uint32(h_kv * G) + row - i * uint32(G)
                        inv = float32(1) / l_w if l_w > float32(0) else float32(0)
                        if lane & 3 == 0:
                            lse_part[part, uint32(b), h, i] = \
                                m_i[2 * m + hh] * softmax_scale + math.log(l_w) \
                                if l_w > float32(0) else float32(-math.inf)
                        for n in range(DT // 8):
                            c = uint32(8 * n + 2 * (lane & 3))
                            if DT == D or c < uint32(D):
                                o_part[part, uint32(b), h, i, c] = o_acc[m, n, 2 * hh] * inv
                                o_part[part, uint32(b), h, i, c + uint32(1)] = \
                                    o_acc[m, n, 2 * hh + 1] * inv
            return

        t_loop = now()                         # stamps: the loop's end
        # Merge the warps (as step 3 merges the splits). Each warp's row statistics (m, l) go to
        # their own region; after one barrier every copy has landed, every warp is done with the
        # tiles, whose memory now holds the fp32 O buffers, and every warp's statistics are there.
        if lane & 3 == 0:
            for r in range(ROWS):
                stats[STATS0 + warp * RT + splitk.block_row(r, lane)] = m_i[r]
        for r in range(ROWS):
            total = softmax.quad_sum(l_i[r])
            if lane & 3 == 0:
                stats[STATS0 + (W + warp) * RT + splitk.block_row(r, lane)] = total
        ptx.cp_async_wait(0)
        cuda.syncthreads()
        scale = cuda.local.array(ROWS, float32)   # e^(m_w - m) / l: the warp's share of a row
        for r in range(ROWS):
            mx, base, total = row_totals(stats, splitk.block_row(r, lane), scale_log2)
            scale[r] = ptx.ex2_approx(m_i[r] * scale_log2 - base) / total \
                if total > float32(0) else float32(0)
        tiles.scale_rows(o_acc, scale)
        n_rows = int32(G * n_q)                # the tile's real rows (token i < N_q)
        o_buf = stats[O0:O0 + (W * WARP_FLOATS if WARP_BUFFERS else RT * OSTRIDE)]
        if WARP_BUFFERS:   # each warp its own buffer, all at once (16-byte stores), one barrier
            tiles.stage_accumulator_fragments_f32(o_buf[warp * WARP_FLOATS:], o_acc, lane)
            cuda.syncthreads()
        else:              # one buffer, the warps adding into it one at a time
            for w in range(W):
                if warp == w:
                    for m in range(M):
                        for n in range(DT // 8):
                            for j in range(4):
                                r, c = tiles.accumulator_position(m, n, j, lane)
                                at = r * OSTRIDE + c
                                o_buf[at] = o_acc[m, n, j] if w == 0 \
                                    else o_buf[at] + o_acc[m, n, j]
                cuda.syncthreads()

        # Out: the real rows of the tile, in q's layout (SPLIT: this split's), the warps' shares
        # added in warp order (either way above: the same sums in the same order).
        at = uint32(tid)
        while at < uint32(n_rows * HALF):
            row = at // uint32(HALF)
            c2 = at - row * uint32(HALF)
            i = row // uint32(G)
            h = uint32(h_kv * G) + row - i * uint32(G)
            if WARP_BUFFERS:
                f = fragment_offset(row, c2 + c2, DT // 8)
                x0, x1 = o_buf[f], o_buf[f + uint32(1)]
                for w in range(1, W):
                    x0 += o_buf[uint32(w * WARP_FLOATS) + f]
                    x1 += o_buf[uint32(w * WARP_FLOATS + 1) + f]
            else:
                x0, x1 = o_buf[row * OSTRIDE + 2 * c2], o_buf[row * OSTRIDE + 2 * c2 + 1]
            if SPLIT:   # unsigned indices: no negative-index wrap-around arithmetic
                o_part[uint32(split), uint32(b), h, i, c2 + c2] = x0
                o_part[uint32(split), uint32(b), h, i, c2 + c2 + uint32(1)] = x1
            else:
                o32[uint32(b), i, h, c2] = tiles.pack_pair(x0, x1, ELEM)
            at = uint32(at + uint32(THREADS))
        if tid < RT:
            i = tid // G
            if i < n_q:
                h = h_kv * G + tid - i * G
                mx, base, total = row_totals(stats, tid, scale_log2)
                value = mx * softmax_scale + math.log(total) if total > float32(0) \
                    else float32(-math.inf)
                if SPLIT:
                    lse_part[split, b, h, i] = value
                else:
                    lse[b, h, i] = value

        if FUSED:
            # Step 3 in the split kernel (combine="fused"; Flash-Decoding's second kernel folded
            # into the first, as CUDA's threadFenceReduction sample folds a reduction's last pass):
            # the S split blocks of (b, h_kv) each take a ticket from counters[b, h_kv] once their
            # O_s, L_s are stored; the block that draws ticket S - 1 is the last to finish, sees
            # every split's O_s, L_s, and merges them. The protocol, on a GPU's memory model:
            # (a) each thread has stored its share of O_s, L_s above (st.global);
            # (b) every thread fences (membar.gl / fence.sc.gpu): its stores are visible to the
            #     whole GPU before anything it does next (the release half);
            # (c) the block barrier: every thread's fence comes before (d);
            # (d) thread 0 takes the ticket (atom.add, in L2) and publishes "last" in shared
            #     memory; the last block resets the counter to 0 (every ticket is taken, nothing in
            #     this launch touches it again, and the next launch on the stream, or the next
            #     node of a CUDA graph, starts after this one ends): no memset, no host sync;
            # (e) the block barrier broadcasts "last" to the block;
            # (f) the last block's threads fence again (the acquire half: the other blocks' stores,
            #     ordered before their tickets by their fences (b), come before its loads) and read
            #     every split's partials through L2 (ld.global.cg: another block on this SM may
            #     have cached a line of lse_part in L1 before they landed), then merge exactly as
            #     the combine kernel does (build_merge).
            # The other S - 1 blocks return without waiting: no block ever spins on another.
            flag = cuda.shared.array(0, int32)                 # stats' first word, free after (c)
            t_stored = now()                   # stamps: the partials stored ...
            cuda.threadfence()                                                        # (b)
            cuda.syncthreads()                                                        # (c)
            t_fenced = now()                   # ... and fenced
            if STAMPS and tid == 0:
                stamp_at = stamp_words(b, h_kv, split)
                put(counters, stamp_at[0], t_start)
                put(counters, stamp_at[0] + 1, t_fenced)
                put(counters, stamp_at[2], t_tile)
            if tid == 0:                                                              # (d)
                slot = b * int32(cuda.gridDim.z) + h_kv
                ticket = cuda.atomic.add(counters, slot, int32(1))
                last = ticket == int32(cuda.gridDim.x) - int32(1)
                flag[STATS0] = int32(1) if last else int32(0)
                if last:
                    counters[slot] = int32(0)
            cuda.syncthreads()                                                        # (e)
            if flag[STATS0] != int32(0):
                t_ticket = now()               # stamps: the ticket taken and broadcast
                cuda.threadfence()                                                    # (f)
                t_acquired = now()             # stamps: the second fence
                scratch = stats[O0:O0 + MERGE_FLOATS]   # the K/V tiles' memory, free again
                for row in range(int32(G * n_q)):          # one query row at a time, the
                    i = row // G                            # block together (merge_row's
                    merge_row(o_part, lse_part, o32, lse, b,   # barriers)
                              h_kv * G + row - i * G, i, cuda.gridDim.x, scratch, tid)
                t_merged = now()               # stamps: the merge's end
                if STAMPS and tid == 0:
                    last_at = stamp_words(b, h_kv, split)[1]
                    put(counters, last_at, t_start)
                    put(counters, last_at + 1, t_loop)
                    put(counters, last_at + 2, t_stored)
                    put(counters, last_at + 3, t_fenced)
                    put(counters, last_at + 4, t_ticket)
                    put(counters, last_at + 5, t_acquired)
                    put(counters, last_at + 6, t_merged)
                    put(counters, last_at + 7, split)

    return decode_split


@lru_cache(maxsize=None)
def build_combine(head_dim, element, dependent=False, threads=128):
    """Step 3: O = sum_s e^(L_s - L) O_s, L = log sum_s e^(L_s); one thread block a row (b, h, i)
    of `threads` threads (build_merge says how they share the splits; the split kernel's thread
    count, so that the fused combine, which merges with the split block's threads, adds up in the
    same order and gives the same bits). dependent: launched
    as a programmatic dependent of the split kernel (Config.pdl), its blocks are resident and
    their shared memory set up while the split kernel's last tiles are read, then wait for it to
    end (FA3 launches its split-KV combine kernel so: hopper/flash_fwd_combine_launch_template.h)."""
    merge_row = build_merge(False, head_dim, threads, element)
    SCRATCH = merge_scratch_floats(head_dim, threads)

    @kernel
    def decode_combine(o_part, lse_part, o32, lse, n_splits):
        i, h, b = int32(cuda.blockIdx.x), int32(cuda.blockIdx.y), int32(cuda.blockIdx.z)
        scratch = cuda.shared.array(SCRATCH, float32)
        if dependent:
            sm90.griddep_wait()   # the split kernel has ended and its o_part, lse_part are visible
        merge_row(o_part, lse_part, o32, lse, b, h, i, n_splits, scratch, int32(cuda.threadIdx.x))

    return decode_combine


PART_COLUMNS = 32   # columns of a row one combine_parts block merges: one a lane
PART_WARPS = 4      # warps of a combine_parts block, each over every 4th part
PART_ROUND = 32     # the most parts whose loads a warp has in flight at once: 128 a block, one
#                     round at the defaults' 32 splits x 4 warps


def parts_capacity(n_parts):
    """The combine_parts kernel built for n_parts parts a row: the next power of two from 32
    (a few builds, each sized to its parts: no lanes loading L_p that cannot exist)."""
    return max(32, 1 << (int(n_parts) - 1).bit_length())


@lru_cache(maxsize=None)
def build_combine_parts(head_dim, element, dependent, max_parts):
    """Step 3 over parts of one warp each (merge_warps="combine": splits x warps parts a row):
    O = sum_p e^(L_p - L) O_p, L = log sum_p e^(L_p). One thread block merges PART_COLUMNS
    columns of a row (b, h, i), so that a row's parts (4x a split's, 64 KB at 128 parts and
    d=128) are read by ceil(d / 32) blocks on as many SMs, not one: lane c of each warp reads
    column c of the parts p = warp, warp + 4, ... (PART_ROUND of them in flight, issued before
    the L_p loads), every warp takes the max and sum of all the L_p by shuffles and keeps its
    weights in shared memory, and the 4 warps' sums meet in shared memory. max_parts: the most
    parts a row (lanes hold ceil(max_parts / 32) L_p each). dependent: a programmatic dependent
    launch (build_combine)."""
    D, ELEM = head_dim, element.code
    CB, W, U = PART_COLUMNS, PART_WARPS, min(PART_ROUND, -(-max_parts // PART_WARPS))
    CHUNKS, NK = -(-D // CB), -(-max_parts // 32)
    WTS = 32 * NK       # a warp's weights: one for every L_p its lanes hold

    @device_function
    def load_round(got, parts, s0, col, last):
        """got[u] = column col of part s0 + u W, every load issued (no branch): a part past the
        last reads the last (its weight is never used), a column past d reads column d - 1 (its
        output is never written)."""
        for u in range(U):
            got[u] = parts[min(uint32(s0 + u * W), last), col]

    @kernel
    def decode_combine_parts(o_part, lse_part, o32, lse, n_parts):
        x, h, b = uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y), uint32(cuda.blockIdx.z)
        i = x // uint32(CHUNKS)
        chunk = x - i * uint32(CHUNKS)
        tid = uint32(cuda.threadIdx.x)
        warp, lane = tid >> uint32(5), tid & uint32(31)
        col = min(chunk * uint32(CB) + lane, uint32(D - 1))
        n = uint32(n_parts)
        last = uint32(n - uint32(1))
        parts, lses = o_part[:, b, h, i], lse_part[:, b, h, i]   # (parts, d), (parts,)
        wts = cuda.shared.array((W, WTS), float32)
        sums = cuda.shared.array((W, CB), float32)
        if dependent:
            sm90.griddep_wait()   # the split kernel has ended and its parts are visible
        got = cuda.local.array(U, float32)
        load_round(got, parts, warp, col, last)   # in flight with the L_p loads
        lse_p = cuda.local.array(NK, float32)
        mx = float32(-math.inf)
        for k in range(NK):
            s = uint32(lane + 32 * k)
            lse_p[k] = lses[min(s, last)]
            if s >= n:
                lse_p[k] = float32(-math.inf)
            mx = max(mx, lse_p[k])
        for k in range(5):
            mx = max(mx, ptx.shfl_xor_f32(mx, int32(1 << k)))
        total = float32(0)
        for k in range(NK):
            w = float32(0) if lse_p[k] == float32(-math.inf) else math.exp(lse_p[k] - mx)
            wts[warp, lane + uint32(32 * k)] = w
            total += w
        for k in range(5):
            total += ptx.shfl_xor_f32(total, int32(1 << k))
        ptx.syncwarp()
        acc = float32(0)
        s0 = warp
        while s0 < n:                    # U of this warp's parts a round
            if s0 != warp:
                load_round(got, parts, s0, col, last)
            for u in range(U):
                s = uint32(s0 + u * W)
                if s < n:
                    acc += wts[warp, s] * got[u]
            s0 = uint32(s0 + U * W)
        sums[warp, lane] = acc
        cuda.syncthreads()
        inv = float32(1) / total if total > float32(0) else float32(0)
        if tid < uint32(CB // 2):
            c = chunk * uint32(CB) + tid + tid      # this thread's column pair
            if D % CB == 0 or c < uint32(D):
                y0, y1 = float32(0), float32(0)
                for w in range(W):
                    y0 += sums[w, tid + tid]
                    y1 += sums[w, tid + tid + uint32(1)]
                o32[b, i, h, c >> uint32(1)] = tiles.pack_pair(y0 * inv, y1 * inv, ELEM)
        if chunk == uint32(0) and tid == uint32(0):
            lse[b, h, i] = mx + math.log(total) if total > float32(0) else float32(-math.inf)

    return decode_combine_parts


@lru_cache(maxsize=None)
def build_append(paged, batch_idx=False):
    """k, v (B, N_new, H_kv, d) into the caches at positions cache_seqlens[b] .. + N_new - 1
    (batch_idx: of cache row cache_batch_idx[b], clamped into the cache): one thread block a
    (token, sequence), 16 bytes a thread."""

    @kernel
    def decode_append(k_new, v_new, k_cache, v_cache, block_table, cache_seqlens, cache_batch_idx,
                      page_shift):
        t, b = cuda.blockIdx.x, cuda.blockIdx.y
        pos = int32(cache_seqlens[b] + t)
        page, slot = int32(b), pos
        if batch_idx:
            page = clamp_page(cache_batch_idx[b], int32(k_cache.shape[0] - 1))
        if paged:
            page = checked_page(block_table, b, pos, page_shift, int32(k_cache.shape[0] - 1))
            slot = pos & int32((1 << page_shift) - 1)
        chunks = k_new.shape[2] * (k_new.shape[3] // 8)
        for c in range(cuda.threadIdx.x, chunks, cuda.blockDim.x):
            h = c // (k_new.shape[3] // 8)
            col = 8 * (c - h * (k_new.shape[3] // 8))
            for e in range(8):
                k_cache[page, slot, h, col + e] = k_new[b, t, h, col + e]
                v_cache[page, slot, h, col + e] = v_new[b, t, h, col + e]

    return decode_append


_COUNTERS = {}        # (library, device) -> (kernel view, the array that owns it, its length)
MIN_COUNTERS = 4096   # 16 KB: enough for batch x heads_kv <= 4096 without growing


def _torch_capturing():
    import torch
    return torch.cuda.is_current_stream_capturing()


def split_counters(library, like, needed):
    """The fused combine's tickets (int32, >= `needed` = batch x heads_kv, zero between calls: the
    last block of each (sequence, K/V head) resets its own), made once per library and device and
    kept: a call allocates nothing, so a CUDA graph may capture it, and replays need no memset.
    For torch they are the driver's memory, not the caching allocator's (arrays.placeholder's
    reason). They are not allocated inside a stream capture, where the driver may not: the first
    call (a warm-up, as timing.capture_cuda_graph makes) must come before, at this batch or larger.
    One set a device: two fused decodes running at the same time on two streams of one device
    would mix their tickets (the same holds for two replays of one graph on two streams)."""
    device = like.device.index if library == "torch" else None
    key = (library, device)
    hit = _COUNTERS.get(key)
    if hit is None or hit[2] < needed:
        if library == "torch" and _torch_capturing():
            raise RuntimeError(
                f"decode(combine='fused') needs {needed} zeroed counters (batch x heads_kv) kept "
                "between calls; they are allocated at the first call and cannot be inside a CUDA "
                "graph capture: call decode once with this batch before capturing (a warm-up)")
        size = max(MIN_COUNTERS, 1 << (needed - 1).bit_length())
        if library == "torch":
            with cuda.gpus[device]:
                arr = cuda.to_device(np.zeros(size, dtype=np.int32))
        else:
            arr = arrays.zeros(library, (size,), "int32", like=like)
        hit = _COUNTERS[key] = (arrays.bits_view(arrays.describe(arr), np.int32), arr, size)
    return hit[0]


@lru_cache(maxsize=None)
def pdl_by_default():
    """`pdl`'s default: on where programmatic dependent launch exists (sm_90 on), off before it
    and in the simulator (where both launches run alike)."""
    if target.SIMULATOR:
        return False
    return tuple(cuda.get_current_device().compute_capability) >= (9, 0)


# a call with plain keywords and check=False (a generation step) replays its launches; check=True
# reads the lengths back: never recorded
@replayed(4, when=lambda options: options.get("check", True) is False)
def decode(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, causal=False,
           softmax_scale=None, num_splits=0, split_kv=True, check=True, out=None,
           cache_leftpad=None, cache_batch_idx=None, window_size=(-1, -1), softcap=0.0,
           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, alibi_slopes=None,
           **options):
    """Attention of q's N_q new tokens against each sequence's cache (common/host/kvcache.py has the
    shapes, as flash_attn_with_kvcache). k, v: appended to the cache first. causal: token i sees
    the keys up to its own position (the last N_q keys are the new tokens'). cache_leftpad,
    cache_batch_idx, window_size, softcap: flash_attn_with_kvcache's (kvcache.py); rotary_cos,
    rotary_sin, rotary_interleaved: RoPE applied to q and the appended k first (variants/rotary.py);
    alibi_slopes (H,) or (B, H) fp32. num_splits: 0 picks by `num_splits_heuristic` (over the keys
    a window leaves); split_kv=False runs one thread block a (sequence, K/V head) over all its
    keys. check: read the lengths, block table, left padding and cache rows back and refuse bad
    ones (False: no host read, e.g. inside a CUDA graph; then pass num_splits). Returns (o like q, lse (B, H, N_q)
    float32). options: Config's block_n, warps, stages, combine ("kernel": the splits merged by
    a second kernel; "fused": by the split kernel's last block of a sequence and K/V head, one
    launch; `split_counters` says what that keeps between calls), pdl (True: the combine kernel
    launched as a programmatic dependent of the split kernel; None or absent: `pdl_by_default`),
    merge_warps ("block": each split block merges its warps; "combine": the combine kernel)."""
    cache_seqlens, block_table, cache_leftpad, cache_batch_idx = (
        kvcache.as_int32(x) for x in (cache_seqlens, block_table, cache_leftpad, cache_batch_idx))
    prob = kvcache.prepare_decode(q, k_cache, v_cache, cache_seqlens, k=k, v=v,
                                  block_table=block_table, causal=causal,
                                  softmax_scale=softmax_scale, head_dims=HEAD_DIMS, check=check,
                                  cache_leftpad=cache_leftpad, cache_batch_idx=cache_batch_idx,
                                  window_size=window_size, softcap=softcap,
                                  alibi_slopes=alibi_slopes)
    rotated = _rotate(prob, rotary_cos, rotary_sin, rotary_interleaved, check)  # noqa: F841 (kept
    #                                                  alive until the kernels are enqueued)
    if prob.n_new:   # append the new tokens first (same stream: the split kernel sees them)
        launch(build_append(prob.paged, prob.batch_idx), (prob.n_new, prob.batch), 128, 0,
               prob.stream, prob.k_new, prob.v_new, prob.k_cache, prob.v_cache, prob.block_table,
               prob.cache_seqlens, prob.cache_batch_idx, np.int32(prob.page_shift))
    splits = 1
    if split_kv:
        block_n = options.get("block_n") or Config.block_n
        splits = int(num_splits) if num_splits else num_splits_heuristic(
            prob.batch, prob.heads_kv, prob.keys_seen, target.multiprocessor_count(), block_n)
        if not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be 1 .. {MAX_SPLITS}, got {num_splits}")
    if options.get("pdl") is None:
        options["pdl"] = pdl_by_default()
    cfg = make_config(prob.head_dim, prob.element, prob.kv_group, prob.n_q, prob.causal,
                      prob.paged, splits > 1, leftpad=prob.leftpad, windowed=prob.windowed,
                      softcap=bool(prob.softcap), batch_idx=prob.batch_idx,
                      alibi=prob.has_alibi, **options)
    lib, like = prob.library, prob.like
    dtype = prob.dtype
    want = (prob.batch, prob.n_q, prob.heads, prob.head_dim)
    if out is None:
        o, o32 = arrays.empty_with_view(lib, want, dtype, np.uint32, like, last_dim_divisor=2)
        lse, lse_v = arrays.empty_with_view(lib, (prob.batch, prob.heads, prob.n_q), "float32",
                                            np.float32, like)
    else:
        o, lse = out
        do, dl = arrays.describe(o, "out[0]"), arrays.describe(lse, "out[1]")
        if do.shape != want or do.dtype != dtype or dl.shape != want[:1] + (prob.heads, prob.n_q) \
                or dl.dtype != "float32":
            raise ValueError(f"out must be (o: {dtype} {want}, lse: float32 "
                             f"{(prob.batch, prob.heads, prob.n_q)}), got {do.dtype} {do.shape} "
                             f"and {dl.dtype} {dl.shape}")
        o32 = arrays.bits_view(do, np.uint32, None, 2)
        lse_v = arrays.bits_view(dl, np.float32)
    scale = np.float32(prob.softmax_scale)
    scale_log2 = np.float32(prob.softmax_scale * math.log2(math.e))
    grid = (splits, prob.batch, prob.heads_kv)
    args = (prob.q, prob.k_cache, prob.v_cache, prob.block_table, prob.cache_seqlens,
            prob.cache_leftpad, prob.cache_batch_idx, prob.alibi)
    scalars = (np.int32(prob.n_q), np.int32(prob.n_new), np.int32(prob.page_shift), scale,
               scale_log2, np.int32(prob.window_left), np.int32(prob.window_right),
               np.float32(prob.softcap_raw), np.int32(prob.alibi_stride))
    counters = split_counters(lib, like, prob.batch * prob.heads_kv) if cfg.fused \
        else arrays.placeholder(lib, 1, like, "int32")
    if splits == 1:
        part = arrays.placeholder(lib, 5, like)
        launch(build(cfg), grid, cfg.threads, cfg.smem_layout().bytes, prob.stream, *args, o32,
               lse_v, part, arrays.placeholder(lib, 4, like), counters, *scalars)
    else:
        rows = (splits * cfg.parts_per_split, prob.batch, prob.heads, prob.n_q)
        part, lse_part = arrays.empty_views(lib, ((rows + (prob.head_dim,), np.float32),
                                                  (rows, np.float32)), like=like)
        launch(build(cfg), grid, cfg.threads, cfg.smem_layout().bytes, prob.stream, *args, o32,
               lse_v, part, lse_part, counters, *scalars)
        if cfg.warp_parts:
            launch(build_combine_parts(prob.head_dim, prob.element, cfg.pdl,
                                       parts_capacity(splits * cfg.warps)),
                   (prob.n_q * -(-prob.head_dim // PART_COLUMNS), prob.heads, prob.batch),
                   32 * PART_WARPS, 0, prob.stream, part, lse_part, o32, lse_v,
                   np.int32(splits * cfg.warps), programmatic=cfg.pdl)
        elif not cfg.fused:
            launch(build_combine(prob.head_dim, prob.element, cfg.pdl, cfg.threads),
                   (prob.n_q, prob.heads, prob.batch), cfg.threads, 0, prob.stream, part,
                   lse_part, o32, lse_v, np.int32(splits), programmatic=cfg.pdl)
    return o, lse


def _rotate(prob, rotary_cos, rotary_sin, interleaved, check):
    """RoPE on the call's q and appended k, in place of prob's views (variants/rotary.py): the
    keys at their positions cache_seqlens[b] + t, the queries at cache_seqlens[b] + i when causal
    or windowed (else all at cache_seqlens[b]), as flash_attn_with_kvcache places them. Returns
    the new arrays (the caller keeps them alive), or () without rotary tables."""
    if rotary_cos is None and rotary_sin is None:
        return ()
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("pass both rotary_cos and rotary_sin, or neither")
    tables = rotary.check_tables(rotary_cos, rotary_sin, prob.head_dim, prob.dtype)
    per_token = prob.causal or prob.windowed
    if check:   # prob.max_seqlen_k was read back: the last position either rotates
        last = prob.max_seqlen_k - prob.n_new + max(prob.n_new, prob.n_q if per_token else 1)
        if last > tables[0].shape[0]:
            raise ValueError(f"rotary_cos holds {tables[0].shape[0]} positions; this call rotates "
                             f"up to position {last - 1}")
    q, prob.q = rotary.rotated(prob.q, tables, prob.cache_seqlens, per_token, interleaved,
                               prob.element, prob)
    if not prob.n_new:
        return (q,)
    k, prob.k_new = rotary.rotated(prob.k_new, tables, prob.cache_seqlens, True, interleaved,
                                   prob.element, prob)
    return q, k


def compile_targets():
    """(name, kernel, argument types, mma count a K/V tile) of the split kernel as decoding
    Llama-3-8B's shapes runs it (32 query heads on 8 K/V heads, one token, d=128, bf16, paged),
    with and without the split (the split with either combine), and the combine kernel."""
    u16_4 = types.Array(types.uint16, 4, "A")
    i32_2, i32_1 = types.Array(types.int32, 2, "A"), types.Array(types.int32, 1, "A")
    o32 = types.Array(types.uint32, 4, "A")
    f32 = {n: types.Array(types.float32, n, "A") for n in (3, 4, 5)}
    scalars = (types.int32, types.int32, types.int32, types.float32, types.float32, types.int32,
               types.int32, types.float32, types.int32)
    f32_1 = types.Array(types.float32, 1, "A")
    args = (u16_4, u16_4, u16_4, i32_2, i32_1, i32_1, i32_1, f32_1, o32, f32[3], f32[5], f32[4],
            i32_1) + scalars
    for split, combine in ((True, "kernel"), (True, "fused"), (False, "kernel")):
        cfg = make_config(128, BFLOAT16, 4, 1, False, True, split, combine=combine)
        # a warp's S = Q K^T and O += P~ V over its keys of a tile: m_tiles * d * keys / 64
        mma = cfg.m_tiles * 128 * cfg.keys_per_warp // 64
        name = f"decode d=128 bf16 G=4 paged split={split}" + (" combine=fused" if cfg.fused else "")
        yield name, build(cfg), args, mma
    # past 128 columns: Q streamed from its tile (Gemma's d=256)
    cfg = make_config(256, BFLOAT16, 4, 1, False, True, True)
    yield "decode d=256 bf16 G=4 paged split=True", build(cfg), args, \
        cfg.m_tiles * 256 * cfg.keys_per_warp // 64
    # flash_attn_with_kvcache's options together (a served Gemma 2's left-padded batch, say)
    cfg = make_config(128, BFLOAT16, 4, 1, True, False, True, leftpad=True, windowed=True,
                      softcap=True, batch_idx=True, alibi=True)
    yield "decode d=128 bf16 G=4 split=True leftpad window softcap batch_idx alibi", build(cfg), \
        args, cfg.m_tiles * 128 * cfg.keys_per_warp // 64
    yield "decode rotary bf16 interleaved=False", rotary.build(False, BFLOAT16), \
        (u16_4, u16_4, types.Array(types.uint16, 2, "A"), types.Array(types.uint16, 2, "A"),
         i32_1, types.int32), 0
    yield "decode combine d=128 bf16", build_combine(128, BFLOAT16), \
        (f32[5], f32[4], o32, f32[3], types.int32), 0
    yield "decode combine d=256 bf16", build_combine(256, BFLOAT16), \
        (f32[5], f32[4], o32, f32[3], types.int32), 0
    yield "decode combine parts d=128 bf16", build_combine_parts(128, BFLOAT16, False, 128), \
        (f32[5], f32[4], o32, f32[3], types.int32), 0
