"""common/hardware/stamps.py, a probe's timing stamps: with them on, the sums of the cycles between
stamps add up to the clock's advance from the first stamp to the last (mod 2^32); off, they read
and write nothing (experiments/probes/fa3_phases.py reads fa3's). Decoding's split kernel built
with its global-timer stamps (variants/decoding.py: build(cfg, stamps=True), what
experiments/probes/decode_stamps.py launches) writes them, in order, where stamp_offsets says, and
gives the unstamped build's output; that build reads no timer and writes nothing extra."""
from functools import lru_cache

import numpy as np
import pytest
from numba import cuda, uint32

from common.hardware.stamps import stamper
from common.hardware.target import kernel

PHASES = 3


@lru_cache(maxsize=None)
def stamp_kernel(on):
    begin, add = stamper(on)

    @kernel
    def stamped(out, ends, n):
        tl = cuda.local.array(PHASES, uint32)
        for k in range(PHASES):
            tl[k] = uint32(7)
        t = begin(tl)
        first = t
        x = uint32(1)
        for k in range(n):
            x = x * uint32(3) + uint32(k)      # some work between stamps
            t = add(tl, k % PHASES, t)
        for k in range(PHASES):
            out[k] = tl[k]
        ends[0], ends[1], ends[2] = first, t, x

    return stamped


@pytest.mark.parametrize("on", [True, False])
def test_stamps_sum_the_clock(on):
    out = cuda.to_device(np.zeros(PHASES, np.uint32))
    ends = cuda.to_device(np.zeros(3, np.uint32))
    stamp_kernel(on)[1, 1](out, ends, np.int32(10))
    tl, (first, last, _) = out.copy_to_host(), ends.copy_to_host()
    if on:
        assert int(tl.sum(dtype=np.uint64)) % 2 ** 32 == (int(last) - int(first)) % 2 ** 32
    else:
        assert (tl == 7).all() and first == last == 0


DECODE_SPLITS = 3
DECODE_LENGTHS = [70, 17]   # 3 and 1 K/V tiles of 32 keys in the simulator: splits with no tile
SENTINEL = -0x2152411       # what the counters' spare words hold before the call


def decode_block_n():
    from tests.conftest import ON_GPU
    return 64 if ON_GPU else 32


def decode_stamped(monkeypatch, stamps):
    """One fused decode call whose split kernel is decoding.build(cfg, stamps=stamps), launched
    through decoding.decode as experiments/probes/decode_stamps.py launches it, with counters of
    the call's own (the module's are left alone) whose words past the tickets hold a sentinel.
    In the simulator the timer is a counter that each read advances (stamps.time replaced), so
    that the stamps' order is exact. Returns (o, lse, the counters after, the timer's reads)."""
    import itertools

    from common.hardware import stamps as stamps_module
    from common.host import arrays
    from experiments.measure import inputs
    from tests.conftest import ON_GPU
    from tests.test_decode import make_cache
    from variants import decoding

    reads = itertools.count(1)
    monkeypatch.setattr(stamps_module, "time", type("Timer", (), {
        "perf_counter_ns": staticmethod(lambda: next(reads))}))
    plain = decoding.build
    monkeypatch.setattr(decoding, "build", lambda cfg: plain(cfg, stamps=stamps))
    monkeypatch.setattr(decoding, "_COUNTERS", {})
    rng = np.random.default_rng(7)
    heads, heads_kv, d, page = 4, 2, 64, 16
    k_cache, v_cache, table = make_cache(rng, DECODE_LENGTHS, heads_kv, d, "bfloat16", page,
                                         max(DECODE_LENGTHS) // page * page + 2 * page)
    q = rng.standard_normal((len(DECODE_LENGTHS), 1, heads, d),
                            dtype=np.float32).astype(inputs.DTYPES["bfloat16"])
    lib = inputs.default_library()
    dev = [inputs.to_device(x, lib) for x in
           (q, k_cache, v_cache, np.array(DECODE_LENGTHS, np.int32), table)]
    groups = len(DECODE_LENGTHS) * heads_kv
    words = decoding.stamp_offsets(groups, DECODE_SPLITS)[3]
    decoding.split_counters(arrays.describe(dev[0]).library, dev[0], words)   # decode's library
    (_, arr, size), = decoding._COUNTERS.values()
    start = np.full(size, SENTINEL, np.int32)
    start[:groups] = 0
    arr.copy_to_device(start)
    options = {} if ON_GPU else {"block_n": decode_block_n(), "warps": 2, "stages": 2}
    o, lse = decoding.decode(*dev[:4], block_table=dev[4], num_splits=DECODE_SPLITS,
                             combine="fused", **options)
    assert len(decoding._COUNTERS) == 1, "the call took counters other than these"
    return inputs.to_host(o), inputs.to_host(lse), arr.copy_to_host(), next(reads) - 1


def test_decode_stamps_go_into_the_fused_combines_counters(monkeypatch):
    """decoding.build(cfg, stamps=True) (the split kernel with combine="fused", as
    experiments/probes/decode_stamps.py runs it): the tickets are back at zero, every block's
    (start, fenced) pair and first-tile stamp and every group's last block's 8 words are written
    where decoding.stamp_offsets says, in the order they were taken (mod 2^32), the last block's
    start and fence are its own pair's, the merge began after every split's partials were fenced,
    and a split with no K/V tile stamps its start as its first tile's. The output is the unstamped
    build's, bit for bit; that build reads no timer and writes nothing past the tickets."""
    from variants import decoding
    with monkeypatch.context() as m:
        o, lse, c, _ = decode_stamped(m, True)
    with monkeypatch.context() as m:
        o0, lse0, c0, reads0 = decode_stamped(m, False)
    groups = len(DECODE_LENGTHS) * 2
    blocks = groups * DECODE_SPLITS
    pairs, last, first, words = decoding.stamp_offsets(groups, DECODE_SPLITS)
    assert np.array_equal(o, o0) and np.array_equal(lse, lse0, equal_nan=True)
    assert not c0[:groups].any() and (c0[groups:] == SENTINEL).all() and reads0 == 0
    assert not c[:groups].any() and (c[words:] == SENTINEL).all()
    assert (c[groups:words] != SENTINEL).all()
    stamp = c.astype(np.int64) % 2 ** 32     # the stamps' 32 bits

    def after(a, b):
        """Stamp b was taken at or after a (mod 2^32: within half the timer's period)."""
        return (b - a) % 2 ** 32 < 2 ** 31

    pair = stamp[pairs:pairs + 2 * blocks].reshape(blocks, 2)
    tile = stamp[first:first + blocks]
    tail = stamp[last:first].reshape(groups, decoding.STAMP_LAST_WORDS)
    tiles = [-(-n // decode_block_n()) for n in DECODE_LENGTHS]
    for blk in range(blocks):
        assert after(pair[blk, 0], tile[blk]) and after(tile[blk], pair[blk, 1])
        seq, split = blk // (2 * DECODE_SPLITS), blk % DECODE_SPLITS
        if split >= tiles[seq]:
            assert tile[blk] == pair[blk, 0], f"block {blk}: no tile, its start"
    for g in range(groups):
        split = int(c[last + decoding.STAMP_LAST_WORDS * g + 7])
        assert 0 <= split < DECODE_SPLITS
        own = g * DECODE_SPLITS + split
        assert (tail[g, 0], tail[g, 3]) == tuple(pair[own]), f"group {g}: its last block's pair"
        assert all(after(a, b) for a, b in zip(tail[g, :6], tail[g, 1:7])), f"group {g}: order"
        for s in range(DECODE_SPLITS):   # every split's partials fenced before the ticket's stamp
            assert after(pair[g * DECODE_SPLITS + s, 1], tail[g, 4])


def test_decode_stamps_need_the_fused_combine():
    from common.hardware.elements import BFLOAT16
    from variants import decoding
    cfg = decoding.make_config(64, BFLOAT16, 2, 1, False, True, True, combine="kernel")
    with pytest.raises(ValueError, match="fused combine's counters"):
        decoding.build(cfg, stamps=True)
