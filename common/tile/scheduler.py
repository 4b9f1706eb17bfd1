"""The persistent tile scheduler (FA3's static tile scheduler; flash_attn/cute's
tile_scheduler.py): a grid of G blocks, fewer than the tiles (one a SM), each walking its share of
the (query block, batch, head) tiles of an attention problem, so that a block's producer loads the
next tile's Q and first K/V blocks while its consumers finish this one.

    work_items(n_blocks, batch_heads, paired)   what the blocks are dealt (host and kernel)
    divider(d), divmod_by(n, div)               n // d and n % d by a multiply and a shift
    s = tile_scheduler(block_m, paired, causal) (one per configuration)
    s.plan(n_q, heads, batch_heads, kv_group)   a block's walk, made once a block
    s.next_tile(k, plan)                        (go, i, b, h, final) of the block's k-th tile
    s.item(k, n_items)                          the block's k-th work item (-1 past the last)

The deal: round k gives items k G .. k G + G - 1 to the G blocks, forwards when k is even,
backwards when odd (a block late in one round is early in the next). An item is a tile, or
(`paired`, causal tiles) two of one head's query blocks, i and n_blocks - 1 - i, which see
n_blocks + 1 K/V blocks together whatever i is: items of equal work, dealt a head after another,
so that a head's items run side by side on neighbouring blocks and read its K and V from L2.
Without pairing a causal problem's tiles go longest first (every head's last query blocks, which
see the most keys, in the first rounds); a non-causal one's a head's query blocks together (they
share K and V in L2). A grid of a block a tile (no persistence) runs round 0 only.
Every index is int32 arithmetic, the divisions by the plan's dividers (Numba types Python's // and
% on int32 as int64 floor division: ~90 instructions each). Device functions are inlined; those of
a scheduler close over its constants (a kernel builder unpacks the ones it calls into names of its
own, which Numba inlines).
"""
from collections import namedtuple
from functools import lru_cache

from numba import cuda, int32, uint32, uint64

from common.hardware.target import device_function


def work_items(n_blocks, batch_heads, paired):
    """What the persistent blocks are dealt in turn (host and kernel): tiles, or (`paired`:
    causal) a pair of one head's query blocks i and n_blocks - 1 - i, which see n_blocks + 1 K/V
    blocks together whatever i is (an odd count's middle block alone). Equal items let the heads be
    dealt one after another, each head's items side by side on neighbouring blocks, which then
    read the same K and V from L2; a longest-first order over every head balances too, but each of
    its rounds reads as many heads' K and V as it has blocks (at 1k, 256 heads' 128 MB: every read
    went to DRAM)."""
    return (((n_blocks + 1) >> 1) if paired else n_blocks) * batch_heads


count_items = device_function(work_items)


@device_function
def divider(d):
    """(d, m, l): what `divmod_by` needs to divide by d (1 <= d < 2^31) with one multiply and a
    shift (Granlund and Montgomery's round-up method, as PyTorch's IntDivider has it; FA3's tile
    scheduler uses CUTLASS's FastDivmod, a variant of it): l = ceil(log2 d) and m =
    floor(2^32 (2^l - d) / d) + 1 < 2^32. A block makes its dividers once (one 64-bit division
    each); a tile's indices then cost a multiply-high each, not a division (~40 instructions and a
    MUFU round trip on the GPU, which has no integer divider)."""
    d = uint32(d)
    l = uint32(32 - cuda.clz(int32(d - uint32(1))))
    m = uint32((uint64((uint64(1) << uint64(l)) - uint64(d)) << uint64(32)) // uint64(d) + uint64(1))
    return d, m, l


@device_function
def divmod_by(n, div):
    """(n // d, n % d) for 0 <= n < 2^31 and div = divider(d): q = (mulhi(m, n) + n) >> l."""
    d, m, l = div
    n = uint32(n)
    q = uint32(uint32(uint32((uint64(m) * uint64(n)) >> uint64(32)) + n) >> l)
    return int32(q), int32(uint32(n - uint32(q * d)))


Scheduler = namedtuple("Scheduler", "item plan next_tile")


@lru_cache(maxsize=None)
def tile_scheduler(block_m, paired, causal):
    """The device functions of the deal of tiles of block_m query rows (see the module's
    docstring): `paired` deals causal tiles in pairs of equal work; `causal` (without pairing)
    deals them longest first."""
    BR, PAIRED, CAUSAL = block_m, paired, causal
    SPAN = 2 if paired else 1                  # tiles a work item holds, at most

    @device_function
    def item(k, n_items):
        """The k-th work item of this block, or -1 past the last: round k deals items
        k G .. k G + G - 1 to the G blocks, forwards when k is even, backwards when odd. A grid
        of a block a tile has round 0 only."""
        g = cuda.gridDim.x
        c = cuda.blockIdx.x if (k & 1) == 0 else g - 1 - cuda.blockIdx.x
        w = int32(k) * g + c
        return w if w < n_items else int32(-1)

    @device_function
    def plan(n_q, heads, batch_heads, kv_group):
        """What a block's walk over its tiles needs, made once a block (as FA3's tile scheduler
        makes its FastDivmods): (tiles, n_items, n_blocks, by_item, by_heads, by_group), tiles
        the walk's length (rounds of items, times the tiles an item holds) and the dividers of a
        work item's index (by a head's items, or the heads' count for causal tiles a block
        apiece), of b H + h by H and of h by the query heads a K/V head serves."""
        n_blocks = int32((n_q + BR - 1) // BR)
        n_items = int32(count_items(n_blocks, batch_heads, PAIRED))
        g = int32(cuda.gridDim.x)
        rounds = int32(uint32(n_items + g - 1) // uint32(g))   # once a block
        per = int32((n_blocks + 1) >> 1) if PAIRED else (batch_heads if CAUSAL else n_blocks)
        return (int32(rounds * SPAN), n_items, n_blocks, divider(per), divider(heads),
                divider(kv_group))

    @device_function
    def next_tile(k, plan):
        """(go, i, b, h, final) of this block's k-th tile: go -1 past the last, 0 for the empty
        half of an odd count's middle block, else 1; i, b, h its query block, batch and head;
        final: the block's last tile. Pairs: the longer tile first. Causal tiles a block apiece:
        every head's last query blocks first (they see the most keys). Else a head's query blocks
        together (they share K, V in L2)."""
        walk, n_items, n_blocks, by_item, by_heads, _ = plan
        r = int32(k >> 1) if PAIRED else k        # the round
        w = item(r, n_items)
        if w < 0:
            return int32(-1), int32(0), int32(0), int32(0), False
        if PAIRED:
            m = k & 1
            bh, q = divmod_by(w, by_item)
            if m == 1 and 2 * q + 1 == n_blocks:
                return int32(0), int32(0), int32(0), int32(0), False
            i = int32(n_blocks - 1 - q) if m == 0 else q
            last_half = m == 1 or 2 * q + 1 == n_blocks
        elif CAUSAL:
            q, bh = divmod_by(w, by_item)
            i, last_half = int32(n_blocks - 1 - q), True
        else:
            bh, i = divmod_by(w, by_item)
            last_half = True
        final = last_half and (int32((r + 1) * SPAN) == walk or item(int32(r + 1), n_items) < 0)
        b, h = divmod_by(bh, by_heads)
        return int32(1), i, b, h, final

    return Scheduler(item, plan, next_tile)
