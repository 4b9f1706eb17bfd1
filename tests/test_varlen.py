"""Variable-length batches (flash_attn_varlen_func): `variants.forward_varlen` on packed q, k, v
against the float64 reference run on each sequence alone, with the masks applied per sequence
(bottom-right and top-left diagonals at each sequence's own corner), grouped-query heads, empty
sequences; and the errors for bad cu_seqlens and max_seqlen.

In the simulator the tiles are small (as in tests/test_masks.py) so that sequences span several
query and key blocks and blocks past a short sequence's end occur; on a GPU the default tiles run
at real lengths."""
import numpy as np
import pytest

import variants
from common.host import arrays
from common.tile import masks
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU

OPTIONS = {} if ON_GPU else dict(block_m=64, block_n=32, warps=2)
VARIANT_OPTIONS = {"fa2": OPTIONS, "fa3": {} if ON_GPU else dict(block_n=64),
                   # fa1: K/V blocks of 64 keys, each sequence's query blocks split two ways
                   "fa1": {} if ON_GPU else dict(block_n=64, q_splits=2),
                   "standard": {}}

# (N_q, N_k) of each sequence: a sequence with no query, one with no key (its rows: O = 0,
# LSE = -inf), one of a single token, more keys than queries and fewer.
LENGTHS = [(17, 40), (0, 5), (70, 70), (1, 1), (33, 12), (9, 0)]
if ON_GPU:
    LENGTHS = [(100, 100), (2048, 2048), (0, 7), (1000, 3000), (8192, 8192), (517, 130), (1, 1),
               (9, 0)]

CASES = [
    (dict(), 2, 1),                                                     # GQA, no mask
    (dict(causal=True), 2, 2),                                          # bottom-right, per sequence
    (dict(causal=True, align=masks.TOP_LEFT, window_size=(24, -1), softcap=2.0), 1, 1),
]
if ON_GPU:
    CASES += [(dict(window_size=(256, 0)), 4, 2), (dict(window_size=(64, 64), softcap=30.0), 2, 1)]
# fa3 (TMA reads a tile's rows from the packed tensors: past a sequence's end, the next one's):
# in the simulator the bottom-right causal case (an empty sequence's tiles skipped, a sequence of
# no key: O = 0), on the GPU every case
FORWARD_CASES = [("fa2", *c) for c in CASES] + \
    [("fa3", *c) for c in (CASES if ON_GPU else CASES[1:2])]
if ON_GPU:   # fa1 and standard in the simulator: test_fa1_and_standard_varlen (shorter sequences)
    FORWARD_CASES += [(v, *c) for v in ("fa1", "standard") for c in CASES]


def packed(rng, lengths, heads, heads_kv, head_dim, dtype):
    """Host q (total_q, H, d), k, v (total_k, H_kv, d), and cu_seqlens_q, cu_seqlens_k."""
    cu_q = np.concatenate([[0], np.cumsum([n for n, _ in lengths])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([n for _, n in lengths])]).astype(np.int32)
    q, k, v = inputs.random_qkv(rng, 1, int(cu_q[-1]), heads, head_dim, dtype,
                                seqlen_k=int(cu_k[-1]), heads_kv=heads_kv)
    return q[0], k[0], v[0], cu_q, cu_k


@pytest.mark.parametrize("variant, mask, heads, heads_kv", FORWARD_CASES,
                         ids=lambda x: str(x).replace(" ", ""))
@pytest.mark.parametrize("head_dim", [64, 128] if ON_GPU else [64])
def test_varlen_forward_matches_each_sequence_alone(rng, variant, mask, heads, heads_kv, head_dim):
    check_packed_forward(rng, variant, LENGTHS, mask, heads, heads_kv, head_dim,
                         VARIANT_OPTIONS[variant])


def check_packed_forward(rng, variant, lengths, mask, heads, heads_kv, head_dim, options,
                         poison_v=None):
    """forward_varlen over sequences of `lengths` against float64 on each sequence alone.
    poison_v(v, cu_k): edits the host V before the call (what the reference sees too)."""
    dtype = "bfloat16"
    q, k, v, cu_q, cu_k = packed(rng, lengths, heads, heads_kv, head_dim, dtype)
    if poison_v is not None:
        poison_v(v, cu_k)
    library = inputs.default_library()
    dq_, dk_, dv_, dcq, dck = (inputs.to_device(x, library) for x in (q, k, v, cu_q, cu_k))
    o = inputs.poison(arrays.empty(library, q.shape, dtype, like=dq_))
    lse = inputs.poison(arrays.empty(library, (heads, q.shape[0]), "float32", like=dq_))
    max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    variants.forward_varlen(dq_, dk_, dv_, dcq, dck, max_q, max_k, variant=variant,
                            out=(o, lse), **mask, **options)
    o, lse = inputs.to_host(o), inputs.to_host(lse)
    for b, (n_q, n_k) in enumerate(lengths):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        where = f"sequence {b} (N_q={n_q}, N_k={n_k}) {mask}"
        if n_q == 0:
            continue
        if n_k == 0:   # no key at all: O = 0 and LSE = -inf, as flash_attn
            assert (o[rows].astype(np.float32) == 0).all() and np.isneginf(lse[:, rows]).all(), where
            continue
        ref_o, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], **mask)
        got = checks.compare(o[None, rows], lse[None, :, rows], ref_o, ref_lse, dtype)
        assert got["ok"], f"{where}: " + checks.describe_failure(got)
        assert np.array_equal(np.isneginf(lse[None, :, rows]), np.isneginf(ref_lse)), where


# fa3's persistent blocks skip the tiles past each sequence's end, producer and consumers alike,
# and the ping-pong turn still goes round: a block whose final tile is skipped (the last
# sequence has no query), tiles skipped between run ones, with two consumer warpgroups (causal,
# tiles dealt in pairs) and three (d=64 non-causal: B_r = 192).
FA3_SKIPS = [([(150, 150), (20, 30), (130, 100), (0, 10)], dict(causal=True)),
             ([(200, 70), (10, 130), (0, 5), (5, 9)], dict())]


@pytest.mark.parametrize("lengths, mask", FA3_SKIPS, ids=["paired_causal", "three_warpgroups"])
def test_fa3_varlen_skips_tiles_past_each_sequence(rng, lengths, mask):
    check_packed_forward(rng, "fa3", lengths, mask, 1, 1, 64, VARIANT_OPTIONS["fa3"])


@pytest.mark.gpu   # (the simulator runs o_store="bulk" in test_fp8)
def test_fa3_varlen_bulk_store_keeps_to_each_sequence(rng):
    """o_store="bulk" (O by bulk copies, a row each): no copy for the rows past a sequence's end,
    which in the packed output are the next sequence's."""
    lengths, mask = FA3_SKIPS[0]
    check_packed_forward(rng, "fa3", lengths, mask, 1, 1, 64,
                         dict(VARIANT_OPTIONS["fa3"], o_store="bulk"))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the simulator's 0 x inf in sequence 1
@pytest.mark.parametrize("options", [dict(producer="cp_async"), dict(), dict(intra_overlap=True),
                                     dict(back_to_back=True)],
                         ids=["cp_async", "tma", "tma_intra_overlap", "tma_back_to_back"])
def test_fa3_varlen_keeps_sequences_apart(rng, options):
    """A non-finite V in one sequence stays out of the others. Sequence 0's one key block
    (B_c = 64) holds 24 keys past its end, the first of them inf. cp.async zero-fills past each
    sequence's keys (as fa2 does); TMA (the default producer) reads those rows from the packed
    tensor, the next sequence's: their scores are masked, and the consumers zero those V rows in
    shared memory before the P V wgmma (else 0 x inf = NaN), at the P V of each schedule (in the
    loop; after it with either overlap). Sequence 1 itself comes out NaN where a masked key is
    inf, as in every FlashAttention kernel."""
    lengths = [(20, 40), (20, 40)]
    q, k, v, cu_q, cu_k = packed(rng, lengths, 1, 1, 64, "bfloat16")
    v[cu_k[1]] = np.inf
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v, cu_q, cu_k)]
    o, lse = variants.forward_varlen(*dev, 20, 40, variant="fa3", causal=True,
                                     window_size=(8, 0), **options, **VARIANT_OPTIONS["fa3"])
    o, lse = inputs.to_host(o), inputs.to_host(lse)
    rows, keys = slice(0, 20), slice(0, 40)
    ref_o, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], causal=True,
                                         window_size=(8, 0))
    got = checks.compare(o[None, rows], lse[None, :, rows], ref_o, ref_lse, "bfloat16")
    assert got["ok"], checks.describe_failure(got)


# The backward: dQ by vector atomics into a row-major accumulator (the varlen default) and by the
# separate kernel, each with a bottom-right band (shifted per sequence): causal with grouped-query
# heads, and a causal window with softcap (top-left bands: the forward's tests).
BACKWARD_CASES = [(dict(causal=True), 2, 1, {}),
                  (dict(causal=True, window_size=(24, -1), softcap=2.0), 1, 1, dict(dq="separate"))]
if ON_GPU:
    # dq="separate" under a bottom-right diagonal: the query blocks of (517, 130) that see no key
    # run no step and write dQ = 0
    BACKWARD_CASES += [(dict(), 4, 2, {}), (dict(window_size=(256, 0)), 2, 2, dict(dq="separate")),
                       (dict(causal=True), 2, 1, dict(dq="separate"))]
SMALL_BACKWARD = {} if ON_GPU else dict(block_m=64, block_n=32, warps=2, dq_block_m=32, dq_warps=2,
                                        dq_block_n=32)


@pytest.mark.parametrize("mask, heads, heads_kv, options", BACKWARD_CASES,
                         ids=lambda x: str(x).replace(" ", ""))
def test_varlen_backward_matches_each_sequence_alone(rng, mask, heads, heads_kv, options):
    check_packed_backward(rng, "fa2", mask, heads, heads_kv, options)


# fa1 and standard over a packed batch, in the simulator over shorter sequences than LENGTHS (its
# cost grows with the thread blocks: fa1's split query blocks, standard's launches a sequence),
# still with a sequence of no query, one of no key and K/V blocks past a sequence's end
SHORT_LENGTHS = [(17, 40), (0, 5), (33, 12), (9, 0)]
FA1_STANDARD = [("fa1", dict(causal=True), {}),
                ("standard", dict(causal=True, align=masks.TOP_LEFT, window_size=(24, -1),
                                  softcap=2.0), {})]
if ON_GPU:
    # fa1's other loop order (the ladder's rungs: FA2's grid, deferred rescaling), its causal
    # block skipping and q_splits=0 (enough splits to fill the GPU)
    FA1_STANDARD += [("fa1", dict(causal=True), o) for o in (
        dict(outer_loop="q"), dict(outer_loop="q", deferred_rescale=True), dict(causal_skip=True),
        dict(q_splits=0))]


@pytest.mark.parametrize("variant, mask, options", FA1_STANDARD,
                         ids=lambda x: str(x).replace(" ", ""))
def test_fa1_and_standard_varlen(rng, variant, mask, options):
    check_packed_forward(rng, variant, LENGTHS if ON_GPU else SHORT_LENGTHS, mask, 2, 1, 64,
                         dict(VARIANT_OPTIONS[variant], **options))


# fa1's backward of a packed batch: Algorithm 4's schedule (a thread block per sequence and K/V
# head walking its K/V blocks) of fa2's kernel, dQ by vector atomics; standard's: its kernels one
# sequence at a time (the rows of a sequence with no key or no query zeroed)
@pytest.mark.parametrize("variant, mask", [("fa1", dict(causal=True)),
                                           ("standard", dict(causal=True, softcap=2.0))]
                         + ([("fa1", dict(window_size=(24, 5), softcap=2.0)),
                             ("standard", dict(window_size=(24, 5)))] if ON_GPU else []),
                         ids=lambda x: ",".join(x) if isinstance(x, dict) else x)
def test_fa1_and_standard_varlen_backward(rng, variant, mask):
    # grouped heads on the GPU (in the simulator one head: the fixed-length tests cover them)
    heads = (2, 1) if ON_GPU else (1, 1)
    check_packed_backward(rng, variant, mask, *heads, {}, LENGTHS if ON_GPU else SHORT_LENGTHS)


def check_packed_backward(rng, variant, mask, heads, heads_kv, options, lengths=LENGTHS):
    dtype, head_dim = "bfloat16", 64
    q, k, v, cu_q, cu_k = packed(rng, lengths, heads, heads_kv, head_dim, dtype)
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    library = inputs.default_library()
    dq_, dk_, dv_, ddo, dcq, dck = (inputs.to_device(x, library) for x in (q, k, v, do, cu_q, cu_k))
    max_q, max_k = max(n for n, _ in lengths), max(n for _, n in lengths)
    o, lse = variants.forward_varlen(dq_, dk_, dv_, dcq, dck, max_q, max_k, variant=variant,
                                     **mask, **VARIANT_OPTIONS[variant])
    grads = tuple(inputs.poison(arrays.empty(library, x.shape, dtype, like=dq_)) for x in (q, k, v))
    small = {k: v for k, v in SMALL_BACKWARD.items() if variant == "fa2" or
             (variant == "fa1" and k in ("block_m", "block_n", "warps"))}
    variants.backward_varlen(ddo, dq_, dk_, dv_, o, lse, dcq, dck, max_q, max_k, grads=grads,
                             variant=variant, **mask, **small, **options)
    dq, dk, dv = (inputs.to_host(x).astype(np.float32) for x in grads)
    for b, (n_q, n_k) in enumerate(lengths):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        where = f"sequence {b} (N_q={n_q}, N_k={n_k}) {mask} {options}"
        if n_q == 0 or n_k == 0:   # nothing flows: zero gradients, not garbage
            assert not dq[rows].any() and not dk[keys].any() and not dv[keys].any(), where
            continue
        ref = reference.attention_backward(q[None, rows], k[None, keys], v[None, keys],
                                           do[None, rows], **mask)
        errors = checks.compare_gradients([dq[None, rows], dk[None, keys], dv[None, keys]], ref,
                                          dtype)
        assert errors["ok"], f"{where}: " + ", ".join(f"{g} {errors[g]:.2e}"
                                                      for g in ("dq", "dk", "dv"))


@pytest.mark.gpu
def test_varlen_autograd_matches_the_direct_calls(rng):
    """variants.attention_varlen (a torch.autograd.Function) gives the output and gradients of
    forward_varlen and backward_varlen, bit for bit with dq="separate"."""
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed(rng, LENGTHS, 4, 2, 128, "bfloat16")
    dev = [inputs.to_device(x, "torch") for x in (q, k, v)]
    cu = [inputs.to_device(x, "torch") for x in (cu_q, cu_k)]
    max_q, max_k = max(n for n, _ in LENGTHS), max(n for _, n in LENGTHS)
    opts = dict(causal=True, backward_options={"dq": "separate"})
    leaves = [x.clone().requires_grad_() for x in dev]
    o = variants.attention_varlen(*leaves, *cu, max_q, max_k, **opts)
    do = torch.randn_like(o)
    o.backward(do)
    o_ref, lse = variants.forward_varlen(*dev, *cu, max_q, max_k, causal=True)
    grads = variants.backward_varlen(do, *dev, o_ref, lse, *cu, max_q, max_k, causal=True,
                                     dq="separate")
    assert torch.equal(o, o_ref)
    for leaf, g in zip(leaves, grads):
        assert torch.equal(leaf.grad, g)


def test_varlen_errors_name_the_problem(rng):
    library = inputs.default_library()
    q, k, v, cu_q, cu_k = packed(rng, [(5, 5), (3, 4)], 1, 1, 64, "bfloat16")
    dq_, dk_, dv_ = (inputs.to_device(x, library) for x in (q, k, v))

    def call(cu_q=cu_q, cu_k=cu_k, max_q=5, max_k=5, variant="fa2", q=dq_, **kw):
        return variants.forward_varlen(q, dk_, dv_, inputs.to_device(cu_q, library),
                                       inputs.to_device(cu_k, library), max_q, max_k,
                                       variant=variant, **kw)

    with pytest.raises(ValueError, match="end at the 8 rows"):
        call(cu_q=np.array([0, 6, 7], np.int32))
    with pytest.raises(ValueError, match="start at 0"):
        call(cu_k=np.array([1, 5, 9], np.int32))
    with pytest.raises(ValueError, match="never decrease"):
        call(cu_q=np.array([0, 6, 5, 8], np.int32))
    with pytest.raises(ValueError, match="max_seqlen_k=3 is below the longest sequence, 5"):
        call(max_k=3)
    with pytest.raises(ValueError, match="int32"):
        call(cu_q=cu_q.astype(np.int64))
    with pytest.raises(ValueError, match="2 sequences but cu_seqlens_k 1"):
        call(cu_k=np.array([0, 9], np.int32), max_k=9)
    with pytest.raises(ValueError, match="3-D"):
        call(q=inputs.to_device(q[None], library))
    with pytest.raises(TypeError, match="fa3 takes float16 or bfloat16"):   # no FP8 packed
        call(variant="fa3", q=inputs.to_device(np.zeros(q.shape, np.uint8), library))
    with pytest.raises(ValueError, match="takes 16-bit inputs, not FP8 \\(q_descale\\)"):
        call(variant="fa3", q_descale=dq_)
    o, lse = call()
    do = inputs.to_device(q, library)
    with pytest.raises(ValueError, match="runs FA2's kernels"):
        variants.backward_varlen(do, dq_, dk_, dv_, o, lse, inputs.to_device(cu_q, library),
                                 inputs.to_device(cu_k, library), 5, 5, variant="fa3",
                                 kernel="wgmma")
    with pytest.raises(ValueError, match="dq_reduce='red'"):
        variants.backward_varlen(do, dq_, dk_, dv_, o, lse, inputs.to_device(cu_q, library),
                                 inputs.to_device(cu_k, library), 5, 5, dq_reduce="bulk")
    with pytest.raises(ValueError, match=r"out\[1\] must be float32 of shape \(1, 8\)"):
        variants.backward_varlen(do, dq_, dk_, dv_, o, lse[:, :4], inputs.to_device(cu_q, library),
                                 inputs.to_device(cu_k, library), 5, 5)


@pytest.mark.slow
def test_varlen_experiment_runs(tmp_path):
    """experiments/varlen.py (the bar: a packed batch within 10% of its sequences one by one)
    checks and times its three rows; here on a tiny batch."""
    import csv
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)   # varlen.py puts the project on its path itself
    out = subprocess.run([sys.executable, str(root / "experiments" / "varlen.py"), "--lengths",
                          "3,9", "--heads", "1", "--head-dim", "64", "--causal", "1", "--csv",
                          str(tmp_path / "v.csv")], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with open(tmp_path / "v.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["case"] for r in rows] == ["varlen", "singles (sum)", "padded"]
    assert all(r["check"] == "ok" for r in rows)


def test_standard_packed_scratch_is_sized_by_the_largest_sequence(rng):
    """standard's one work allocation for a packed batch holds its largest sequence's S and P
    (the lengths read back), not max_seqlen_q x max_seqlen_k: with (N_q, N_k) = (1, 256) and
    (256, 1) the maxima would ask for 256 x 256 scores, each sequence needs 256 x 64 at most."""
    from common.host.problem import prepare_varlen
    from variants import standard
    lengths = [(1, 256), (256, 1)]
    q, k, v, cu_q, cu_k = packed(rng, lengths, 1, 1, 64, "bfloat16")
    library = inputs.default_library()
    dq_, dk_, dv_, dcq, dck = (inputs.to_device(x, library) for x in (q, k, v, cu_q, cu_k))
    prob = prepare_varlen(dq_, dk_, dv_, dcq, dck, 300, 300, causal=False, softmax_scale=None,
                          out=None, head_dims=standard.HEAD_DIMS, variant="standard")
    scratch = standard._scratch_for_sequences(prob, standard._FORWARD_WORK)
    assert arrays.describe(scratch).shape == (256 * 64 * (4 + 2),)
    with pytest.raises(ValueError, match="do not fit"):
        arrays.views_over(scratch, standard._work_specs(standard._FORWARD_WORK, 1, 1, 300, 300))
