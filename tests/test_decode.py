"""Decoding against a KV cache (variants/decoding.py, common/host/kvcache.py): each sequence's output and
LSE against the float64 reference over the keys its cache holds (after the append), for ragged
lengths, paged caches with random block tables, grouped-query heads, several new tokens with the
causal diagonal, and any number of splits, with the splits merged by the combine kernel
(combine="kernel") or by the split kernel's last block (combine="fused": equal to the kernel's,
its counters back at zero after every call); and the errors for bad calls.

In the simulator the tiles are small (2 warps, 32-key tiles) and the lengths short, so that splits
with no tile, tiles past a sequence's end, pages that cut a tile and a sequence of one key all
occur; on a GPU the default tiles run at the issue's lengths (1, 17, 4097, 16k)."""
import numpy as np
import pytest

import variants
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU, compiled_in_a_subprocess

SMALL = {} if ON_GPU else dict(block_n=32, warps=2, stages=2)
LENGTHS = [1, 17, 4097, 16384, 300] if ON_GPU else [1, 17, 70]


def make_cache(rng, lengths, heads_kv, head_dim, dtype, page_size, capacity, extra_pages=3):
    """Host caches holding random tokens: contiguous (B, capacity, H_kv, d) when page_size is
    None, else paged (pages, page_size, H_kv, d) with a random block table (B, capacity /
    page_size) over shuffled pages (some never used)."""
    b = len(lengths)
    if page_size is None:
        shape = (b, capacity, heads_kv, head_dim)
        table = None
    else:
        per_seq = capacity // page_size
        pages = b * per_seq + extra_pages
        shape = (pages, page_size, heads_kv, head_dim)
        table = rng.permutation(pages)[:b * per_seq].reshape(b, per_seq).astype(np.int32)
    k = rng.standard_normal(shape, dtype=np.float32).astype(inputs.DTYPES[dtype])
    v = rng.standard_normal(shape, dtype=np.float32).astype(inputs.DTYPES[dtype])
    return k, v, table


def sequence_keys(cache, table, b, n, page_size):
    """Host (1, n, H_kv, d): sequence b's first n keys of a cache."""
    if table is None:
        return cache[b:b + 1, :n]
    rows = [cache[table[b, t // page_size], t % page_size] for t in range(n)]
    return np.stack(rows)[None]


def run_case(rng, *, lengths=LENGTHS, n_q=1, heads=4, heads_kv=2, head_dim=64, dtype="bfloat16",
             page_size=16, causal=False, n_new=0, num_splits=0, split_kv=True, options=SMALL,
             combine="kernel", merge_warps=None, leftpad=None, rows=None, window_size=(-1, -1),
             softcap=0.0, rotary=None, alibi=None):
    """One decode call on random inputs drawn from rng, checked against float64 sequence by
    sequence; returns its (o, lse) on the host. merge_warps: the option, where it is not the
    default. leftpad (cache_leftpad), rows (cache_batch_idx: a contiguous cache of max(rows) + 1
    rows), window_size, softcap: flash_attn_with_kvcache's options; the reference attends to
    sequence b's keys leftpad[b] .. n_k - 1 of its row. rotary: (rotary_dim, interleaved): RoPE
    tables of random angles, q and the appended k rotated by the reference (float64, rounded
    to the dtype), the appended keys compared within one rounding. alibi: "heads" ((H,) slopes)
    or "batch" ((B, H) slopes), random in (0, 1)."""
    options = dict(options, combine=combine)
    if merge_warps is not None:
        options["merge_warps"] = merge_warps
    capacity = max(lengths) + n_new
    if page_size is not None:
        capacity = -(-capacity // page_size) * page_size + page_size   # a spare page a sequence
    cache_rows = list(range(len(lengths))) if rows is None else list(rows)
    k_cache, v_cache, table = make_cache(rng, [0] * (max(cache_rows) + 1), heads_kv, head_dim,
                                         dtype, page_size, capacity)
    q = rng.standard_normal((len(lengths), n_q, heads, head_dim),
                            dtype=np.float32).astype(inputs.DTYPES[dtype])
    lens = np.array(lengths, dtype=np.int32)
    lib = inputs.default_library()
    dev = {name: inputs.to_device(x, lib) for name, x in
           dict(q=q, k_cache=k_cache, v_cache=v_cache, lens=lens).items()}
    kw = dict(window_size=window_size, softcap=softcap)
    if table is not None:
        kw["block_table"] = inputs.to_device(table, lib)
    if leftpad is not None:
        kw["cache_leftpad"] = inputs.to_device(np.array(leftpad, np.int32), lib)
    if rows is not None:
        kw["cache_batch_idx"] = inputs.to_device(np.array(rows, np.int32), lib)
    slopes = None
    if alibi is not None:
        slopes = rng.uniform(0, 1, (heads,) if alibi == "heads" else (len(lengths), heads)) \
            .astype(np.float32)
        kw["alibi_slopes"] = inputs.to_device(slopes, lib)
    if rotary is not None:
        rotary_dim, kw["rotary_interleaved"] = rotary
        angle = rng.uniform(0, 2 * np.pi, (capacity + n_q, rotary_dim // 2))   # to the last q
        cos, sin = (f(angle).astype(inputs.DTYPES[dtype]) for f in (np.cos, np.sin))
        kw["rotary_cos"], kw["rotary_sin"] = (inputs.to_device(x, lib) for x in (cos, sin))
    new = None
    if n_new:
        new = [rng.standard_normal((len(lengths), n_new, heads_kv, head_dim),
                                   dtype=np.float32).astype(inputs.DTYPES[dtype]) for _ in "kv"]
        kw["k"], kw["v"] = (inputs.to_device(x, lib) for x in new)
    o, lse = variants.decode(dev["q"], dev["k_cache"], dev["v_cache"], dev["lens"], causal=causal,
                             num_splits=num_splits, split_kv=split_kv, **kw, **options)
    o, lse = inputs.to_host(o), inputs.to_host(lse)
    if rotary is not None:   # what the call attends with: q and the new keys rotated
        per_token = causal or tuple(window_size) != (-1, -1)
        at = lens[:, None] + (np.arange(n_q)[None] if per_token else 0)
        q = reference.rotary(q, cos, sin, at, kw["rotary_interleaved"]).astype(q.dtype)
        if n_new:
            at = lens[:, None] + np.arange(n_new)[None]
            new[0] = reference.rotary(new[0], cos, sin, at, kw["rotary_interleaved"]) \
                .astype(new[0].dtype)
    if n_new:   # the append went into the caches: read them back
        k_after, v_after = inputs.to_host(dev["k_cache"]), inputs.to_host(dev["v_cache"])
    for b, n in enumerate(lengths):
        n_k, row = n + n_new, cache_rows[b]
        if n_new:
            ks = sequence_keys(k_after, table, row, n_k, page_size)
            vs = sequence_keys(v_after, table, row, n_k, page_size)
            if rotary is None:
                assert np.array_equal(ks[0, n:], new[0][b]), f"sequence {b}: appended keys"
            else:   # rotated in fp32 by the kernel, in float64 here: within one rounding
                np.testing.assert_allclose(ks[0, n:].astype(np.float32),
                                           new[0][b].astype(np.float32), rtol=2 ** -7, atol=1e-6,
                                           err_msg=f"sequence {b}: appended (rotated) keys")
            assert np.array_equal(vs[0, n:], new[1][b]), f"sequence {b}: appended values"
            ks = np.concatenate([sequence_keys(k_cache, table, row, n, page_size),
                                 new[0][b:b + 1]], 1)
            vs = np.concatenate([sequence_keys(v_cache, table, row, n, page_size),
                                 new[1][b:b + 1]], 1)
        else:
            ks = sequence_keys(k_cache, table, row, n_k, page_size)
            vs = sequence_keys(v_cache, table, row, n_k, page_size)
        first = 0 if leftpad is None else leftpad[b]
        seq_slopes = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        ref_o, ref_lse = reference.attention(q[b:b + 1], ks[:, first:], vs[:, first:],
                                             causal=causal, window_size=window_size,
                                             softcap=softcap, alibi_slopes=seq_slopes)
        got = checks.compare(o[b:b + 1], lse[b:b + 1], ref_o, ref_lse, dtype)
        where = f"sequence {b} (N_k={n_k}, N_q={n_q}, causal={causal}, splits={num_splits}, " \
            f"combine={combine}, leftpad={first}, row={row}, window={window_size}, " \
            f"softcap={softcap})"
        assert got["ok"], where + ": " + checks.describe_failure(got)
    return o, lse


def assert_same_merge(fused, kernel):
    """combine="fused" against combine="kernel" with merge_warps="block" on the same inputs: the
    same merge arithmetic (decoding.build_merge), so the same bits in the simulator; on a GPU
    within one bf16 rounding (the two kernels are compiled apart), far below any race's damage."""
    (o_f, lse_f), (o_k, lse_k) = fused, kernel
    if ON_GPU:
        np.testing.assert_allclose(o_f.astype(np.float32), o_k.astype(np.float32), rtol=2 ** -7,
                                   atol=1e-6)
        np.testing.assert_allclose(lse_f, lse_k, rtol=1e-6, atol=1e-6)
    else:
        assert np.array_equal(o_f.view(np.uint16), o_k.view(np.uint16))
        assert np.array_equal(lse_f, lse_k)


def counters_are_zero():
    """Every ticket counter of the fused combine is back at zero (the last block's reset)."""
    from variants import decoding
    return all(not inputs.to_host(arr).any() for _, arr, _ in decoding._COUNTERS.values())


COMBINES = ["kernel", "fused"]


@pytest.mark.parametrize("combine", COMBINES)
# pages of 16 keys cut a tile (one table lookup a key), 32 (the simulator's tile), 64 and 256 hold
# whole tiles (one lookup a tile; at 64 and 256 a tile may start mid-page), None: a contiguous cache
@pytest.mark.parametrize("page_size", [16, None] + ([256] if ON_GPU else [32, 64]))
@pytest.mark.parametrize("num_splits", [1, 2, 3] + ([0, 64] if ON_GPU else []))
def test_decode_matches_reference(rng, page_size, num_splits, combine):
    run_case(rng, page_size=page_size, num_splits=num_splits, combine=combine)


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("n_q, heads, heads_kv, causal", [(3, 4, 2, True), (2, 4, 4, False)] +
                         ([(4, 32, 8, True), (1, 32, 8, False)] if ON_GPU else []))
def test_decode_new_tokens_and_groups(rng, n_q, heads, heads_kv, causal, combine):
    run_case(rng, n_q=n_q, heads=heads, heads_kv=heads_kv, causal=causal, num_splits=2,
             combine=combine)


@pytest.mark.parametrize("split_kv, combine", [(True, "kernel"), (True, "fused"), (False, "kernel")])
def test_decode_appends_new_tokens(rng, split_kv, combine):
    run_case(rng, n_q=2, n_new=2, causal=True, num_splits=2, split_kv=split_kv,
             dtype="float16", combine=combine)


# flash_attn_with_kvcache's options (issue 62), each against the reference over the keys it
# leaves: left padding (the splits start at the tile of the first key; in the simulator the
# 70-key sequence's padding of 40 skips a whole 32-key tile and cuts the next), a sliding window
# (causal, and two-sided without causal), Gemma 2's softcap, cache rows picked by
# cache_batch_idx (with the append going to those rows), and all of them at once
OPTION_CASES = {
    "leftpad": dict(leftpad=[0, 5, 40] if not ON_GPU else [0, 16, 4000, 9000, 299], n_q=2,
                    causal=True),
    "leftpad_append": dict(leftpad=[1, 0, 33] if not ON_GPU else [1, 0, 33, 8000, 7], n_new=2,
                           n_q=2, causal=True, page_size=None),
    "window_causal": dict(window_size=(9, 0), n_q=3, causal=True),
    "window_two_sided": dict(window_size=(12, 5), n_q=2, causal=False, page_size=None),
    "softcap": dict(softcap=1.5, n_q=1),
    "batch_idx_append": dict(rows=[3, 0, 2] if not ON_GPU else [6, 0, 2, 5, 1], n_new=1,
                             page_size=None),
    "rotary_neox": dict(rotary=(32, False), n_new=2, n_q=2, causal=True, page_size=None),
    "alibi_causal": dict(alibi="heads", n_q=3, causal=True),
    "alibi_batch": dict(alibi="batch", n_q=1, causal=False, page_size=None),
    "rotary_interleaved": dict(rotary=(64, True), n_new=1, n_q=1, causal=False),
    # not causal, no window: every query rotated at cache_seqlens[b] (flash_attn's rule)
    "rotary_one_position": dict(rotary=(32, True), n_q=3, causal=False, page_size=None),
    "leftpad_window_no_split": dict(leftpad=[0, 2, 30] if not ON_GPU else [0, 2, 30, 9000, 99],
                                    window_size=(9, 0), n_q=2, causal=True, split_kv=False),
    "all": dict(leftpad=[0, 3, 35] if not ON_GPU else [0, 3, 35, 16000, 100],
                rows=[2, 1, 0] if not ON_GPU else [4, 3, 2, 1, 0], window_size=(20, 0),
                softcap=2.0, alibi="heads", n_q=2, causal=True, page_size=None),
}


@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_decode_kvcache_options(rng, case, combine):
    kw = dict(OPTION_CASES[case])
    run_case(rng, num_splits=kw.pop("num_splits", 3), combine=combine, **kw)


def test_decode_kernels_are_built_once_per_configuration():
    """build and the combine builders are cached: a decoding step reuses the compiled kernels
    (a new dispatcher a call would miss the launcher's cache and load or compile again)."""
    from common.hardware.elements import BFLOAT16
    from variants import decoding
    cfg = decoding.make_config(64, BFLOAT16, 2, 1, True, False, True, leftpad=True, alibi=True)
    assert decoding.build(cfg) is decoding.build(cfg)
    assert decoding.build_combine(64, BFLOAT16) is decoding.build_combine(64, BFLOAT16)


def test_decode_left_padding_past_the_keys_leaves_zeros(rng):
    """A sequence whose padding covers every key it has (cache_leftpad = cache_seqlens): no key
    to attend to, O = 0 and LSE = -inf, as a row with every key masked."""
    lib = inputs.default_library()
    k_cache, v_cache, _ = make_cache(rng, [1, 1], 1, 64, "bfloat16", None, 64)
    q = inputs.to_device(rng.standard_normal((2, 1, 2, 64)).astype(inputs.DTYPES["bfloat16"]), lib)
    lens = inputs.to_device(np.array([40, 7], np.int32), lib)
    o, lse = variants.decode(q, inputs.to_device(k_cache, lib), inputs.to_device(v_cache, lib),
                             lens, cache_leftpad=inputs.to_device(np.array([3, 7], np.int32), lib),
                             num_splits=2, **SMALL)
    o, lse = inputs.to_host(o).astype(np.float32), inputs.to_host(lse)
    assert (o[1] == 0).all() and np.isneginf(lse[1]).all()
    assert np.isfinite(lse[0]).all() and (o[0] != 0).any()


@pytest.mark.parametrize("num_splits, page_size, n_q, causal, lengths",
                         [(3, 16, 1, False, LENGTHS), (2, None, 3, True, LENGTHS),
                          (40, 64, 1, False, [700])])
def test_decode_fused_combine_equals_the_kernel(rng, num_splits, page_size, n_q, causal, lengths):
    """The same inputs through both combines: the same result (assert_same_merge), both right.
    40 splits of a 700-key sequence (22 of them with keys in the simulator's 32-key tiles): the
    merge's later rounds of loads (more splits than a round holds, U W) and lanes holding two
    splits' L_s."""
    seed = int(rng.integers(2 ** 31))
    got = {c: run_case(np.random.default_rng(seed), num_splits=num_splits, page_size=page_size,
                       n_q=n_q, causal=causal, combine=c, lengths=lengths,
                       merge_warps="block" if c == "kernel" else None) for c in COMBINES}
    assert_same_merge(got["fused"], got["kernel"])


@pytest.mark.parametrize("num_splits", [3, 45] if ON_GPU else [3])
def test_decode_combine_as_a_dependent_launch_gives_the_same_bits(rng, num_splits):
    """pdl=True launches the combine kernel as a programmatic dependent of the split kernel (it
    waits for the split kernel's end with griddepcontrol.wait); pdl=False, an ordinary launch:
    the same arithmetic, so the same bits (on a GPU; in the simulator both launch alike, and
    test_decode_combine_waits_before_it_reads checks the wait's place). 45 splits (GPU): the
    merge's warps take uneven shares, and many splits hold no key."""
    seed = int(rng.integers(2 ** 31))
    got = [run_case(np.random.default_rng(seed), num_splits=num_splits,
                    options=dict(SMALL, pdl=pdl)) for pdl in (True, False)]
    assert np.array_equal(got[0][0].view(np.uint16), got[1][0].view(np.uint16))
    assert np.array_equal(got[0][1], got[1][1])


def test_decode_combine_waits_before_it_reads():
    """The dependent combine kernels (pdl=True; the block-merge and the warp-parts form) run
    griddepcontrol.wait before their first load from global memory (Numba's are generic ld), and
    the ordinary ones have no wait (PTX for sm_90, compiled without a GPU)."""
    code = (
        "import re\n"
        "from numba import cuda, types\n"
        "from common.hardware.elements import BFLOAT16\n"
        "from variants import decoding\n"
        "f = {n: types.Array(types.float32, n, 'A') for n in (3, 4, 5)}\n"
        "sig = (f[5], f[4], types.Array(types.uint32, 4, 'A'), f[3], types.int32)\n"
        "for dependent in (True, False):\n"
        "    for k in (decoding.build_combine(128, BFLOAT16, dependent),\n"
        "              decoding.build_combine_parts(128, BFLOAT16, dependent, 128)):\n"
        "        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(9, 0))\n"
        "        body = ptx[ptx.index('.entry'):]\n"
        "        m = re.search(r'\\bld\\.(?!param|shared)', body)\n"   # a global (or generic) load
        "        wait, load = body.find('griddepcontrol.wait'), m.start() if m else -1\n"
        "        print(dependent, wait, load)\n")
    rows = [r.split() for r in compiled_in_a_subprocess(code)]
    assert len(rows) == 4   # the combine kernel and its warp-parts form, each both ways
    for dependent, wait, load in rows:
        wait, load = int(wait), int(load)
        if dependent == "True":
            assert 0 <= wait < load
        else:
            assert wait == -1 and load >= 0


def test_decode_fused_combine_reuses_its_counters(rng):
    """The fused combine's ticket counters are made once and reset by each (sequence, K/V head)'s
    last block, with no launch and no host read: consecutive calls of other batches, splits and
    lengths (more sequences x K/V heads than the last call, fewer, a split of one) all come out
    right and equal to the combine kernel's, and leave every counter at zero."""
    calls = [dict(num_splits=3), dict(num_splits=2, lengths=[40, 9], heads_kv=1, heads=2),
             dict(num_splits=3, lengths=[5, 64, 33, 1], n_q=2, causal=True),
             dict(num_splits=1), dict(num_splits=2, page_size=None)]
    for kw in calls:
        seed = int(rng.integers(2 ** 31))
        fused = run_case(np.random.default_rng(seed), combine="fused", **kw)
        assert counters_are_zero(), kw
        assert_same_merge(fused, run_case(np.random.default_rng(seed), combine="kernel",
                                          merge_warps="block", **kw))


@pytest.mark.parametrize("head_dim, num_splits, lengths", [
    (64, 70, [700]),       # 140 parts a row (2 warps): the combine's second round of loads
    (40, 3, LENGTHS),      # 48-column tiles: the parts' columns stop at d, the combine's at 40
])
def test_decode_merges_the_warps_in_the_combine_or_the_block(rng, head_dim, num_splits, lengths):
    """merge_warps="combine" (combine="kernel" only): each warp of a split block writes its own
    part, splits x warps parts a row merged by the combine kernel; "block" (the default): the
    block merges its warps first, one part a split. Both right, and equal within the rounding of
    adding the same terms in another order."""
    seed = int(rng.integers(2 ** 31))
    got = {m: run_case(np.random.default_rng(seed), head_dim=head_dim, num_splits=num_splits,
                       lengths=lengths, heads=2, heads_kv=1, merge_warps=m)
           for m in ("combine", "block")}
    (o_c, lse_c), (o_b, lse_b) = got["combine"], got["block"]
    np.testing.assert_allclose(o_c.astype(np.float32), o_b.astype(np.float32), rtol=2 ** -7,
                               atol=1e-5)
    np.testing.assert_allclose(lse_c, lse_b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n_q, combine, merge_warps, warp_buffers", [
    (8, "kernel", "block", True), (16, "fused", None, False), (16, "kernel", "combine", False)])
def test_decode_merges_the_warps_either_way(rng, n_q, combine, merge_warps, warp_buffers):
    """Where the block merges its warps (merge_warps="block", combine="fused"), they meet after
    the loop in one fp32 buffer each where they fit (32 query rows of 64 columns: two m16 tiles,
    fragment order), else in one buffer added into one warp at a time (64 rows); both add the
    warps in the same order. With merge_warps="combine", 64 rows (four m16 tiles) of parts a
    warp. 4 query heads on 1 K/V head."""
    from common.hardware.elements import BFLOAT16
    from variants import decoding
    options = dict(block_n=64, warps=4)
    cfg = decoding.make_config(64, BFLOAT16, 4, n_q, True, True, True, combine=combine,
                               merge_warps=merge_warps, **options)
    assert cfg.warp_buffers == warp_buffers
    assert cfg.warp_parts == (merge_warps == "combine")
    run_case(rng, n_q=n_q, heads=4, heads_kv=1, causal=True, num_splits=2, options=options,
             combine=combine, merge_warps=merge_warps,
             lengths=[17, 300, 4097] if ON_GPU else [40] if merge_warps == "combine" else [17, 40])


@pytest.mark.parametrize("head_dim, page_size, n_q, causal, combine", [
    (32, 16, 1, False, "kernel"),   # 32-column tiles of padded rows, one column of chunks a thread
    (40, 64, 1, False, "fused"),    # 48-column tiles, columns 40-47 zero-filled; whole-page tiles
    (96, None, 1, False, "kernel"),  # 12 chunks a row, dealt out in order; a contiguous cache
    (72, 16, 2, True, "kernel"),    # a key's page looked up per row, 80-column tiles; causal
    (256, 16, 2, True, "fused"),    # past 128: Q streamed from its tile at every K/V tile
    (200, None, 1, False, "kernel"),  # 208-column tiles, zero-filled past 200, Q streamed
])
def test_decode_head_dims_other_than_64_and_128(rng, head_dim, page_size, n_q, causal, combine):
    """Every multiple of 8 from 32 to 256: tiles of tile_columns(d) columns (swizzled only at 64
    and 128), the copies zero-filling the columns past d, the merge stopping at d; past 128 Q's
    fragments are read from its tile at every K/V tile (Config.q_held)."""
    run_case(rng, head_dim=head_dim, page_size=page_size, n_q=n_q, causal=causal, num_splits=3,
             combine=combine)


def test_decode_refuses_head_dims_past_256(rng):
    """Past 256 (what flash_attn takes) and head dims that are not multiples of 8: refused by
    name."""
    lib = inputs.default_library()
    for d in (264, 44):
        q = inputs.to_device(np.zeros((1, 1, 2, d), np.float16), lib)
        cache = inputs.to_device(np.zeros((1, 16, 1, d), np.float16), lib)
        lens = inputs.to_device(np.array([4], np.int32), lib)
        with pytest.raises(ValueError, match=f"decode supports head_dim in .*got {d}"):
            variants.decode(q, cache, cache, lens)


@pytest.mark.skipif(not ON_GPU, reason="d=128 and the default tiles: GPU sizes")
@pytest.mark.parametrize("combine", COMBINES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decode_head_dim_128(rng, dtype, combine):
    run_case(rng, head_dim=128, heads=32, heads_kv=8, dtype=dtype, page_size=256, combine=combine)


@pytest.mark.gpu
def test_decode_fused_combine_under_load(rng):
    """The fused combine's memory ordering on a real GPU (the simulator runs the blocks of a grid
    one after another, so it cannot race): many splits finishing close together, over and over,
    shapes changing between calls (the counters' slots reused), each call against the combine
    kernel's result on the same inputs, and the counters at zero at the end."""
    torch = pytest.importorskip("torch")
    from variants import decoding
    d, page = 128, 256
    for batch, length, splits in ((1, 16384, 128), (1, 16384, 32), (4, 4096, 16), (8, 8192, 0)):
        k_cache, v_cache, table = make_cache(rng, [length] * batch, 8, d, "bfloat16", page,
                                             length + page)
        kc, vc, tbl = (inputs.to_device(x, "torch") for x in (k_cache, v_cache, table))
        lens = inputs.to_device(np.array(rng.integers(length // 2, length + 1, batch),
                                         dtype=np.int32), "torch")
        q = torch.randn(batch, 1, 32, d, device="cuda").to(torch.bfloat16)

        def call(combine, **options):
            return variants.decode(q, kc, vc, lens, block_table=tbl, check=False,
                                   num_splits=splits, combine=combine, **options)
        o_k, lse_k = call("kernel", merge_warps="block")
        for _ in range(25):
            o_f, lse_f = call("fused")
        torch.cuda.synchronize()
        assert_same_merge((inputs.to_host(o_f), inputs.to_host(lse_f)),
                          (inputs.to_host(o_k), inputs.to_host(lse_k)))
        outs = [call("fused") for _ in range(25)]   # queued back to back, then all checked
        for o, lse in outs:
            assert torch.equal(o, o_f) and torch.equal(lse, lse_f), (batch, length, splits)
    assert counters_are_zero() and decoding._COUNTERS


def test_decode_errors_name_the_problem(rng):
    lib = inputs.default_library()
    k_cache, v_cache, table = make_cache(rng, [5, 9], 1, 64, "bfloat16", 16, 32)
    q = inputs.to_device(rng.standard_normal((2, 1, 2, 64)).astype(inputs.DTYPES["bfloat16"]), lib)
    kc, vc = inputs.to_device(k_cache, lib), inputs.to_device(v_cache, lib)

    def call(lens=(5, 9), table=table, **kw):
        return variants.decode(q, kc, vc, inputs.to_device(np.array(lens, np.int32), lib),
                               block_table=None if table is None else inputs.to_device(table, lib),
                               num_splits=1, **kw, **SMALL)

    bad = table.copy()
    bad[1, 0] = table.size + 7
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = .* is not a page of the cache"):
        call(table=bad)
    bad[1, 0] = -1
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] = -1"):
        call(table=bad)
    with pytest.raises(ValueError, match="exceeds the cache's capacity of 32 tokens"):
        call(lens=(5, 40))
    with pytest.raises(ValueError, match="is negative"):
        call(lens=(-1, 3))
    with pytest.raises(ValueError, match="one row per sequence"):
        call(table=None)
    with pytest.raises(ValueError, match="must be int32"):
        variants.decode(q, kc, vc, inputs.to_device(np.array([5, 9], np.int64), lib),
                        block_table=inputs.to_device(table, lib))
    with pytest.raises(ValueError, match="pass both k and v"):
        call(k=q)
    with pytest.raises(ValueError, match="power of two"):
        odd = inputs.to_device(k_cache[:, :12].copy(), lib)
        variants.decode(q, odd, odd, inputs.to_device(np.array([5, 9], np.int32), lib),
                        block_table=inputs.to_device(table, lib))
    with pytest.raises(ValueError, match="decode has no option"):
        call(block_m=64)
    with pytest.raises(ValueError, match="combine must be one of kernel, fused, got 'last'"):
        call(combine="last")
    with pytest.raises(ValueError, match="merge_warps must be one of block, combine, got 'warp'"):
        call(merge_warps="warp")
    with pytest.raises(ValueError, match=r"out must be \(o: bfloat16 \(2, 1, 2, 64\)"):
        call(out=(kc, inputs.to_device(np.zeros((2, 2, 1), np.float32), lib)))

    def vec(*x):
        return inputs.to_device(np.array(x, np.int32), lib)
    with pytest.raises(ValueError, match=r"cache_leftpad\[1\] = 10 must be 0 .. cache_seqlens"):
        call(cache_leftpad=vec(0, 10))
    with pytest.raises(ValueError, match=r"cache_leftpad must be int32 of shape \(2,\)"):
        call(cache_leftpad=vec(0, 1, 2))
    with pytest.raises(ValueError, match="cache_batch_idx picks rows of a contiguous cache"):
        call(cache_batch_idx=vec(1, 0))
    contiguous = inputs.to_device(k_cache[:3].copy(), lib)
    with pytest.raises(ValueError, match=r"cache_batch_idx\[0\] = 3 is not a row of the cache"):
        variants.decode(q, contiguous, contiguous, vec(5, 9), cache_batch_idx=vec(3, 0))
    with pytest.raises(ValueError, match="window_size must be a pair"):
        call(window_size=(4,))
    with pytest.raises(ValueError, match="softcap must be a finite number >= 0"):
        call(softcap=-1.0)
    angles = inputs.to_device(np.zeros((16, 16), inputs.DTYPES["bfloat16"]), lib)
    with pytest.raises(ValueError, match="pass both rotary_cos and rotary_sin"):
        call(rotary_cos=angles)
    with pytest.raises(ValueError, match="rotary_cos holds 16 positions; this call rotates up to "
                                         "position 17"):
        call(lens=(5, 17), rotary_cos=angles, rotary_sin=angles)
    odd = inputs.to_device(np.zeros((32, 4), inputs.DTYPES["bfloat16"]), lib)
    with pytest.raises(ValueError, match="rotary_dim = 2 \\* rotary_cos.shape\\[1\\] = 8 must"):
        call(rotary_cos=odd, rotary_sin=odd)
    # check=False reads nothing back: a bad entry is clamped into the cache, never read past it
    bad[1, 0] = table.size + 7
    o, lse = call(table=bad, check=False)
    assert np.isfinite(inputs.to_host(lse)).all()
    assert inputs.to_host(o).shape == (2, 1, 2, 64)


@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_unchecked_bad_tables_and_lengths_stay_inside_the_cache(rng, page_size):
    """check=False reads nothing back: table entries out of range or negative, and lengths past
    the table's pages, are clamped into the cache by the kernel (the simulator raises on any copy
    from outside it), with one lookup a key (pages of 16) or a tile (64: a tile of 32 or 64 keys
    lies in one page)."""
    lib = inputs.default_library()
    k_cache, v_cache, table = make_cache(rng, [5, 70], 1, 64, "bfloat16", page_size, 128)
    q = inputs.to_device(rng.standard_normal((2, 1, 2, 64)).astype(inputs.DTYPES["bfloat16"]), lib)
    kc, vc = inputs.to_device(k_cache, lib), inputs.to_device(v_cache, lib)
    bad = table.copy()
    bad[1, 0], bad[1, -1], bad[0, 0] = table.size + 7, -3, 2 ** 30
    for lens in [(5, 70), (300, 129)]:
        o, lse = variants.decode(q, kc, vc, inputs.to_device(np.array(lens, np.int32), lib),
                                 block_table=inputs.to_device(bad, lib), check=False,
                                 num_splits=2, **SMALL)
        assert np.isfinite(inputs.to_host(lse)).all()
        assert np.isfinite(inputs.to_host(o).astype(np.float32)).all()


@pytest.mark.parametrize("check", [True, False])
def test_decode_an_empty_block_table_reads_nothing(rng, check):
    """A block table of no columns (max_blocks = 0: a cache that holds nothing, every length 0):
    the split kernel reads ahead the table entries of its first tiles before it knows the
    length, and must not index an empty row (the simulator raises on it). Nothing to attend to:
    O = 0, LSE = -inf."""
    lib = inputs.default_library()
    k_cache, v_cache, _ = make_cache(rng, [1, 1], 1, 64, "bfloat16", 16, 16)
    q = inputs.to_device(rng.standard_normal((2, 1, 2, 64)).astype(inputs.DTYPES["bfloat16"]), lib)
    o, lse = variants.decode(q, inputs.to_device(k_cache, lib), inputs.to_device(v_cache, lib),
                             inputs.to_device(np.zeros(2, np.int32), lib),
                             block_table=inputs.to_device(np.zeros((2, 0), np.int32), lib),
                             check=check, num_splits=2, **SMALL)
    assert (inputs.to_host(o).astype(np.float32) == 0).all()
    assert np.isneginf(inputs.to_host(lse)).all()


def test_num_splits_heuristic():
    from variants.decoding import num_splits_heuristic
    # 132 SMs, two blocks each: 264 slots. One sequence, 8 K/V heads: 32 splits (256 blocks)
    assert num_splits_heuristic(1, 8, 131072, 132, 64) == 32
    # batch 8: 64 blocks; 4 splits fill 256 of the 264 slots (5 would need 1.2 waves)
    assert num_splits_heuristic(8, 8, 131072, 132, 64) == 4
    # a short cache: no split under two tiles
    assert num_splits_heuristic(1, 8, 256, 132, 64) == 2
    # a batch that already fills the GPU: no split
    assert num_splits_heuristic(64, 8, 16384, 132, 64) == 1


@pytest.mark.slow
def test_decode_experiment_runs(tmp_path):
    """experiments/decode.py checks each size against float64 and times every row (here one tiny
    size: in the simulator the times mean nothing)."""
    from experiments import decode as experiment
    rows = experiment.main(["--batches", "1", "--lengths", "128", "--page-size", "64", "--heads",
                            "2", "--heads-kv", "1", "--head-dim", "64", "--peers", "0",
                            "--csv", str(tmp_path / "d.csv")])
    assert {r["kernel"] for r in rows} >= {"decode, no split", "decode, contiguous", "fa2"}
    assert all(r["check"] == "ok" for r in rows)
    assert (tmp_path / "d.csv").read_text().count("\n") == len(rows) + 1


@pytest.mark.slow
def test_decode_grid_experiment_writes_its_rows(tmp_path):
    """`python experiments/run.py experiment=decode_grid` (pass=decode): one job, its rows in the
    job's results.csv with GB/s and the page size (in the simulator: a short cache)."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not ON_GPU:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = subprocess.run([sys.executable, str(root / "experiments" / "run.py"),
                          "experiment=decode_grid", "bench.peers=[]"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    [path] = list(tmp_path.glob("outputs/*/*/results.csv"))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert {r["variant"] for r in rows} >= {"decode, no split", "decode, contiguous", "fa2"}
    assert all(r["pass"] == "decode" and r["check"] == "ok" and r["gbs"] for r in rows)


@pytest.mark.gpu
@pytest.mark.parametrize("combine", COMBINES)
def test_decode_step_replays_from_a_cuda_graph(rng, combine):
    """A decoding step (append the new token's K and V, split-KV attention, combine) with
    check=False and a fixed num_splits reads nothing back on the host, so torch.cuda.graph captures
    it; replayed after the caller writes the next token and advances the lengths in place, it
    gives what the same call gives eagerly on the same state, bit for bit. combine="fused": the
    graph is one launch less, and its counters, made in the warm-up, are zero after each replay."""
    torch = pytest.importorskip("torch")
    from experiments.measure import timing
    # d=128, 4 query heads a K/V head, pages of 256: experiments/decode.py's kernels
    lengths, heads, heads_kv, d, page = [300, 4097], 8, 2, 128, 256
    capacity = -(-(max(lengths) + 4) // page) * page + page
    k_cache, v_cache, table = make_cache(rng, lengths, heads_kv, d, "bfloat16", page, capacity)
    dev = lambda x: inputs.to_device(x, "torch")                                  # noqa: E731
    kc, vc, tbl = dev(k_cache), dev(v_cache), dev(table)
    lens = dev(np.array(lengths, dtype=np.int32))
    q, kn, vn = (torch.zeros((len(lengths), 1, h, d), dtype=torch.bfloat16, device="cuda")
                 for h in (heads, heads_kv, heads_kv))

    def step(k_cache, v_cache):
        return variants.decode(q, k_cache, v_cache, lens, block_table=tbl, k=kn, v=vn,
                               check=False, num_splits=4, combine=combine)

    graph, (o, lse) = timing.capture_cuda_graph(lambda: step(kc, vc))
    for _ in range(2):
        for x in (q, kn, vn):
            x.copy_(torch.randn(x.shape, device="cuda", dtype=torch.float32).to(x.dtype))
        lens.add_(1)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        o_ref, lse_ref = step(kc_ref, vc_ref)   # eager, on a copy of the same state
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)   # the same append
        assert counters_are_zero()
    # and the eager result is right: against float64 over each sequence's keys
    for b, n in enumerate(lens.tolist()):   # the cache's n keys and the appended one
        ks = sequence_keys(inputs.to_host(kc), table, b, n + 1, page)
        vs = sequence_keys(inputs.to_host(vc), table, b, n + 1, page)
        ref_o, ref_lse = reference.attention(inputs.to_host(q)[b:b + 1], ks, vs)
        got = checks.compare(inputs.to_host(o)[b:b + 1], inputs.to_host(lse)[b:b + 1], ref_o,
                             ref_lse, "bfloat16")
        assert got["ok"], f"sequence {b}: " + checks.describe_failure(got)


@pytest.mark.gpu
def test_decode_takes_other_integer_widths(rng):
    """int64 lengths, block table and left padding (torch's default integer type) are converted
    to the int32 the kernels read: the same bits as the int32 call."""
    torch = pytest.importorskip("torch")
    k_cache, v_cache, table = make_cache(rng, [5, 40], 2, 64, "bfloat16", 16, 64)
    q = torch.randn(2, 1, 4, 64, device="cuda", dtype=torch.bfloat16)
    kc, vc = (torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
              for x in (k_cache, v_cache))
    lens, pad = torch.tensor([5, 40], device="cuda"), torch.tensor([1, 3], device="cuda")
    table = torch.from_numpy(table).cuda()
    wide = variants.decode(q, kc, vc, lens, block_table=table.long(), cache_leftpad=pad)
    narrow = variants.decode(q, kc, vc, lens.int(), block_table=table.int(),
                             cache_leftpad=pad.int())
    assert all(torch.equal(a, b) for a, b in zip(wide, narrow))


@pytest.mark.gpu
def test_decode_generation_step_is_replayed():
    """A decoding call with plain keywords and check=False (what a generation step makes, a layer
    after another) is recorded at its second call and replayed from its third (common/host/
    replay.py): the same bits each time; a call with an array keyword (cache_leftpad) never is."""
    torch = pytest.importorskip("torch")
    from common.host import replay
    from variants import decoding
    replay.warm_up()
    q = torch.randn(2, 1, 8, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    lens = torch.full((2,), 300, dtype=torch.int32, device="cuda")
    plans = [p for p in decoding.decode.plans.values() if type(p) is replay.Plan]
    keys = len(decoding.decode.plans)
    outs = [variants.decode(q, k, v, lens, causal=True, check=False) for _ in range(4)]
    made = [p for p in decoding.decode.plans.values() if type(p) is replay.Plan]
    assert len(made) == len(plans) + 1
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs)
    pad = torch.tensor([0, 7], dtype=torch.int32, device="cuda")
    for _ in range(3):
        variants.decode(q, k, v, lens, causal=True, check=False, cache_leftpad=pad)
        variants.decode(q, k, v, lens, causal=False)   # check=True: never recorded
    assert len([p for p in decoding.decode.plans.values() if type(p) is replay.Plan]) == len(made)
    assert len(decoding.decode.plans) == keys + 1   # no key kept for the other calls
