"""flash_attn's functions (variants/flash_attn.py) against float64: the dense, packed and
varlen forms, return_attn_probs, the KV-cache call, the head dims flash_attn pads, the choice of
generation, and the arguments refused by name. The simulator runs them on Numba arrays (forward);
on a GPU torch tensors also run the backward (against float64 gradients), deterministic=True
bitwise twice, and torch.compile(fullgraph=True)."""
import numpy as np
import pytest

from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU
from variants import flash_attn as fa

DTYPE = "bfloat16"
N = 300 if ON_GPU else 40


def device(*xs, library=None):
    library = library or inputs.default_library()
    return [inputs.to_device(x, library) for x in xs]


def check_forward(got, lse, q, k, v, **mask):
    ref_o, ref_lse = reference.attention(q, k, v, **mask)
    result = checks.compare(inputs.to_host(got), inputs.to_host(lse), ref_o, ref_lse, DTYPE)
    assert result["ok"], checks.describe_failure(result)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(16, 4))],
                         ids=["full", "causal", "window"])
def test_flash_attn_func_is_exact(rng, mask):
    """GQA (4 query heads on 2 K/V heads), N_q < N_k: out and softmax_lse as flash_attn returns
    them with return_attn_probs (its third value None without dropout)."""
    q, k, v = inputs.random_qkv(rng, 1, N // 2, 4, 64, DTYPE, seqlen_k=N, heads_kv=2)
    out, lse, probs = fa.flash_attn_func(*device(q, k, v), return_attn_probs=True, **mask)
    assert probs is None and tuple(out.shape) == q.shape and tuple(lse.shape) == (1, 4, N // 2)
    check_forward(out, lse, q, k, v, **mask)


@pytest.mark.parametrize("n_q, n_k, chunk, mask", [
    (N, N, 16, dict(causal=True)),                        # Llama 4's: causal within 16-key chunks
    (N, N, 24, dict()),                                   # block-diagonal, a short last chunk
    (N // 2, N + 3, 16, dict(causal=True, window_size=(10, 0))),   # queries at the last positions
], ids=["causal", "full", "rectangular_window"])
def test_attention_chunk_is_exact(rng, n_q, n_k, chunk, mask):
    """FA3's attention_chunk: each query sees only its chunk's keys (chunks of the key positions,
    the query at its bottom-right position), within the mask; GQA; against float64 with that
    mask, and not equal to the call without chunks."""
    q, k, v = inputs.random_qkv(rng, 2, n_q, 4, 64, DTYPE, seqlen_k=n_k, heads_kv=2)
    out = fa.flash_attn_func(*device(q, k, v), attention_chunk=chunk, **mask)
    assert tuple(out.shape) == q.shape
    lse0 = np.zeros((2, 4, n_q))
    ref_o, _ = reference.attention(q, k, v, attention_chunk=chunk, **mask)
    got = checks.compare(inputs.to_host(out), lse0, ref_o, lse0, DTYPE)
    assert got["ok"], checks.describe_failure(got)
    plain, _ = reference.attention(q, k, v, **mask)
    assert not checks.compare(inputs.to_host(out), lse0, plain, lse0, DTYPE)["ok"]


def test_packed_forms_equal_the_unpacked_call(rng):
    """qkvpacked (B, N, 3, H, d) and kvpacked (B, N, 2, H_kv, d) read their q, k, v as views of
    the stacked array: the same bits as flash_attn_func on the separate arrays."""
    q, k, v = inputs.random_qkv(rng, 1, N, 2, 64, DTYPE)
    base = inputs.to_host(fa.flash_attn_func(*device(q, k, v), causal=True))
    qkv = fa.flash_attn_qkvpacked_func(*device(np.stack([q, k, v], axis=2)), causal=True)
    dq, dkv = device(q, np.stack([k, v], axis=2))
    kv = fa.flash_attn_kvpacked_func(dq, dkv, causal=True)
    assert np.array_equal(inputs.to_host(qkv).view(np.uint16), base.view(np.uint16))
    assert np.array_equal(inputs.to_host(kv).view(np.uint16), base.view(np.uint16))


def test_varlen_forms_are_exact_per_sequence(rng):
    """flash_attn_varlen_func and its qkvpacked form on a packed batch: each sequence against
    float64 on its own; softmax_lse (H, total_q)."""
    lengths = [17, 1, 30] if not ON_GPU else [17, 1, 300, 129]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (x[0] for x in inputs.random_qkv(rng, 1, int(cu[-1]), 2, 64, DTYPE))
    dq, dk, dv, dcu = device(q, k, v, cu)
    out, lse, _ = fa.flash_attn_varlen_func(dq, dk, dv, dcu, dcu, max(lengths), max(lengths),
                                            causal=True, return_attn_probs=True)
    packed = fa.flash_attn_varlen_qkvpacked_func(*device(np.stack([q, k, v], axis=1)), dcu,
                                                 max(lengths), causal=True)
    out, lse = inputs.to_host(out), inputs.to_host(lse)
    assert np.array_equal(inputs.to_host(packed).view(np.uint16), out.view(np.uint16))
    for b in range(len(lengths)):
        rows = slice(cu[b], cu[b + 1])
        ref_o, ref_lse = reference.attention(q[None, rows], k[None, rows], v[None, rows],
                                             causal=True)
        got = checks.compare(out[None, rows], lse[None, :, rows], ref_o, ref_lse, DTYPE)
        assert got["ok"], f"sequence {b}: " + checks.describe_failure(got)


@pytest.mark.parametrize("page_size, head_dim, mask", [
    (64, 64, dict(causal=True)), (128, 64, dict(causal=True))] + ([
        (256, 128, dict(causal=True)), (64, 128, dict(window_size=(100, 20)))] if ON_GPU else []))
def test_varlen_prefill_against_a_paged_cache(rng, page_size, head_dim, mask):
    """flash_attn_varlen_func with a block_table: each sequence's keys and values in the pages of
    a cache (shuffled, some unused and NaN, as are the slots past each sequence's keys, the table
    entries past them -1: a read past a sequence's keys would show), causal at each sequence's
    bottom-right (a chunked prefill: the new queries are the last of the sequence's keys), or a
    two-sided window without causal (d=128: the K/V copies refilled after use); GQA; each
    sequence against float64 over its keys gathered from its pages."""
    lengths = [(3, 70), (17, 17), (40, 200)] if not ON_GPU else [(3, 700), (17, 17),
                                                                 (400, 2000), (129, 4097)]
    max_pages = max(-(-n // page_size) for _, n in lengths) + 1
    n_pages = len(lengths) * max_pages + 2
    table = rng.permutation(n_pages)[:len(lengths) * max_pages].reshape(len(lengths), max_pages)
    cu_q = np.concatenate([[0], np.cumsum([n for n, _ in lengths])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([n for _, n in lengths])]).astype(np.int32)
    q = inputs.random_qkv(rng, 1, int(cu_q[-1]), 4, head_dim, DTYPE)[0][0]
    kc, vc = (np.full((n_pages, page_size, 2, head_dim), np.nan, np.float32)
              .astype(inputs.DTYPES[DTYPE]) for _ in "kv")
    for b, (_, n_k) in enumerate(lengths):   # each sequence's keys; NaN elsewhere
        for t in range(0, n_k, page_size):
            rows = min(page_size, n_k - t)
            for x in (kc, vc):
                x[table[b, t // page_size], :rows] = rng.standard_normal(
                    (rows, 2, head_dim), dtype=np.float32).astype(x.dtype)
        table[b, -(-n_k // page_size):] = -1
    dq, dkc, dvc, dcu_q, dcu_k, dtable = device(q, kc, vc, cu_q, cu_k, table.astype(np.int32))
    out, lse, _ = fa.flash_attn_varlen_func(
        dq, dkc, dvc, dcu_q, dcu_k, max(n for n, _ in lengths), max(n for _, n in lengths),
        block_table=dtable, return_attn_probs=True, **mask)
    out, lse = inputs.to_host(out), inputs.to_host(lse)
    for b, (n_q, n_k) in enumerate(lengths):
        used = range(-(-n_k // page_size))
        keys = np.concatenate([kc[table[b, j]] for j in used])[:n_k]
        values = np.concatenate([vc[table[b, j]] for j in used])[:n_k]
        rows = slice(cu_q[b], cu_q[b + 1])
        ref_o, ref_lse = reference.attention(q[None, rows], keys[None], values[None], **mask)
        got = checks.compare(out[None, rows], lse[None, :, rows], ref_o, ref_lse, DTYPE)
        assert got["ok"], f"sequence {b}: " + checks.describe_failure(got)


def test_paged_cache_errors_name_the_problem(rng):
    cu = device(np.array([0, 5], np.int32))[0]
    q = device(np.zeros((5, 2, 64), inputs.DTYPES[DTYPE]))[0]
    cache = device(np.zeros((4, 64, 2, 64), inputs.DTYPES[DTYPE]))[0]
    odd = device(np.zeros((4, 48, 2, 64), inputs.DTYPES[DTYPE]))[0]
    small = device(np.zeros((4, 16, 2, 64), inputs.DTYPES[DTYPE]))[0]

    def call(k=cache, table=(0, 1), n_k=100):
        cu_k = device(np.array([0, n_k], np.int32))[0]
        return fa.flash_attn_varlen_func(q, k, k, cu, cu_k, 5, n_k, causal=True,
                                         block_table=device(np.array([table], np.int32))[0])
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 9 is not a page of the cache"):
        call(table=(0, 9))
    with pytest.raises(ValueError, match="sequence 0 has 200 keys but its block_table row holds 2"):
        call(n_k=200)
    with pytest.raises(ValueError, match="page_size .* must be a power of two, got 48"):
        call(k=odd)
    with pytest.raises(ValueError, match="pages must hold a multiple of block_n keys"):
        call(k=small, n_k=20)
    with pytest.raises(ValueError, match=r"k must be a paged cache \(num_pages, page_size"):
        call(k=q)


@pytest.mark.parametrize("seqused, chunk", [(True, 0), (False, 16), (True, 8)],
                         ids=["seqused", "attention_chunk", "both"])
def test_varlen_seqused_and_attention_chunk(rng, seqused, chunk):
    """flash_attn_varlen_func with FA3's seqused_q / seqused_k (sequence b: its first seqused[b]
    queries and keys, the other query rows 0 with LSE -inf) and attention_chunk (within the used
    part): each sequence against float64 on its used rows."""
    lengths = [(17, 40), (30, 30), (9, 12)]
    # (30, 20): more queries than keys, bottom-right (rows that see no key); chunks take N_q <= N_k
    used = [(10, 25), (18 if chunk else 30, 20), (9, 12)] if seqused else lengths
    cu_q = np.concatenate([[0], np.cumsum([n for n, _ in lengths])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([n for _, n in lengths])]).astype(np.int32)
    q = inputs.random_qkv(rng, 1, int(cu_q[-1]), 4, 64, DTYPE)[0][0]
    _, k, v = (x[0] for x in inputs.random_qkv(rng, 1, int(cu_k[-1]), 2, 64, DTYPE))
    extra = {}
    if seqused:
        extra = dict(zip(("seqused_q", "seqused_k"),
                         device(*(np.array(u, np.int32) for u in zip(*used)))))
    out, lse, _ = fa.flash_attn_varlen_func(
        *device(q, k, v, cu_q, cu_k), max(n for n, _ in lengths), max(n for _, n in lengths),
        causal=True, attention_chunk=chunk, return_attn_probs=True, **extra)
    out, lse = inputs.to_host(out), inputs.to_host(lse)
    for b, (uq, uk) in enumerate(used):
        rows = slice(cu_q[b], cu_q[b] + uq)
        keys = slice(cu_k[b], cu_k[b] + uk)
        ref_o, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys],
                                             causal=True, attention_chunk=chunk)
        got = checks.compare(out[None, rows], lse[None, :, rows], ref_o, ref_lse, DTYPE)
        assert got["ok"], f"sequence {b}: " + checks.describe_failure(got)
        unused = slice(cu_q[b] + uq, cu_q[b + 1])
        assert not out[unused].astype(np.float32).any() and np.isneginf(lse[:, unused]).all()


def test_with_kvcache_appends_and_attends(rng):
    """flash_attn_with_kvcache with an int cache_seqlens: k, v written into the cache at that
    position (in place), then each new token attends to the cache up to its own position."""
    batch, n_cache, filled, n_new = 2, 64, 20, 3
    kc, vc = (np.zeros((batch, n_cache, 2, 64), dtype=inputs.DTYPES[DTYPE]) for _ in range(2))
    _, kc[:, :filled], vc[:, :filled] = inputs.random_qkv(rng, batch, filled, 2, 64, DTYPE)
    q, k, v = inputs.random_qkv(rng, batch, n_new, 4, 64, DTYPE, heads_kv=2)
    dq, dkc, dvc, dk, dv = device(q, kc, vc, k, v)
    out, lse = fa.flash_attn_with_kvcache(dq, dkc, dvc, dk, dv, cache_seqlens=filled,
                                          causal=True, return_softmax_lse=True)
    keys, values = np.concatenate([kc[:, :filled], k], 1), np.concatenate([vc[:, :filled], v], 1)
    assert np.array_equal(inputs.to_host(dkc)[:, :filled + n_new].view(np.uint16),
                          keys.view(np.uint16))
    check_forward(out, lse, q, keys, values, causal=True)


def test_with_kvcache_left_padding_window_softcap_rows_and_rotary(rng):
    """flash_attn_with_kvcache's cache_leftpad, cache_batch_idx, window_size, softcap and rotary
    tables together, as a served Gemma 2 passes them: q and the new k rotated at their positions
    (GPT-NeoX pairs over the first 32 columns), k, v appended into each sequence's cache row,
    then each new token attends to its row's keys from cache_leftpad[b] up to its own position,
    within its window, capped."""
    rows, n_cache, n_new = [2, 0], 64, 2
    filled, leftpad, window, cap = np.array([40, 25], np.int32), np.array([5, 0], np.int32), \
        (8, 0), 3.0
    kc, vc = (rng.standard_normal((3, n_cache, 2, 64), dtype=np.float32)
              .astype(inputs.DTYPES[DTYPE]) for _ in range(2))
    q, k, v = inputs.random_qkv(rng, 2, n_new, 4, 64, DTYPE, heads_kv=2)
    angle = rng.uniform(0, 2 * np.pi, (n_cache, 16))
    cos, sin = (f(angle).astype(inputs.DTYPES[DTYPE]) for f in (np.cos, np.sin))
    dq, dkc, dvc, dk, dv, dlens, dpad, drows, dcos, dsin = device(
        q, kc, vc, k, v, filled, leftpad, np.array(rows, np.int32), cos, sin)
    out, lse = fa.flash_attn_with_kvcache(dq, dkc, dvc, dk, dv, rotary_cos=dcos, rotary_sin=dsin,
                                          cache_seqlens=dlens, cache_leftpad=dpad,
                                          cache_batch_idx=drows, causal=True, window_size=window,
                                          softcap=cap, rotary_interleaved=False,
                                          return_softmax_lse=True)
    out, lse = inputs.to_host(out), inputs.to_host(lse)
    after = inputs.to_host(dkc)
    at = filled[:, None] + np.arange(n_new)[None]   # the new tokens' positions, q's and k's
    q = reference.rotary(q, cos, sin, at, False).astype(q.dtype)
    k = reference.rotary(k, cos, sin, at, False).astype(k.dtype)
    for b, row in enumerate(rows):
        n, first = int(filled[b]), int(leftpad[b])
        np.testing.assert_allclose(after[row, n:n + n_new].astype(np.float32),
                                   k[b].astype(np.float32), rtol=2 ** -7, atol=1e-6)
        keys = np.concatenate([kc[row:row + 1, first:n], k[b:b + 1]], 1)
        values = np.concatenate([vc[row:row + 1, first:n], v[b:b + 1]], 1)
        ref_o, ref_lse = reference.attention(q[b:b + 1], keys, values, causal=True,
                                             window_size=window, softcap=cap)
        result = checks.compare(out[b:b + 1], lse[b:b + 1], ref_o, ref_lse, DTYPE)
        assert result["ok"], f"sequence {b}: " + checks.describe_failure(result)


@pytest.mark.parametrize("call, error, words", [
    (lambda a: fa.flash_attn_func(a, a, a, dropout_p=0.1), NotImplementedError,
     "dropout_p=0.1 with"),
    (lambda a: fa.flash_attn_varlen_func(a, a, a, a, a, 1, 1, block_table=a, dropout_p=0.1),
     NotImplementedError, "dropout_p=0.1 with block_table"),
    (lambda a: fa.flash_attn_func(a[:, :, :, :20], a[:, :, :, :20], a[:, :, :, :20]), ValueError,
     "head_dim 20"),
    (lambda a: fa.flash_attn_func(a, a, a, qv=a), NotImplementedError, "qv"),
], ids=["dropout", "block_table", "unpadded_head_dim", "qv"])
def test_what_is_refused_is_named(call, error, words):
    """Nothing is launched: the argument is refused before any kernel, by name (a CuPy or Numba
    array whose head_dim the kernels do not take must come padded; torch tensors are padded
    inside)."""
    a = device(np.zeros((1, 8, 2, 64), dtype=inputs.DTYPES[DTYPE]), library="numba")[0]
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call(a)


def test_generation_and_backward_options():
    """fa3 on sm_90, fa2 elsewhere (the simulator: fa2); deterministic=True asks for the
    backward with one summation order of each generation."""
    a = device(np.zeros((1, 8, 2, 64), dtype=inputs.DTYPES[DTYPE]), library="numba")[0]
    expected = "fa2"
    if ON_GPU:
        from numba import cuda
        expected = "fa3" if cuda.get_current_device().compute_capability == (9, 0) else "fa2"
    assert fa.default_variant(a) == expected
    assert fa._backward_options("fa2", True) == {"dq": "separate"}
    assert fa._backward_options("fa3", True) == {"kernel": "fa2", "dq": "separate"}
    assert fa._backward_options("fa3", False) is None
    assert [fa._padded(d) for d in (1, 20, 32, 59, 111, 128, 256)] == [32, 32, 32, 64, 112, 128,
                                                                         256]
    with pytest.raises(ValueError, match="head_dim must be 1 .. 256, got 300"):
        fa._padded(300)


# --------------------------------------------------------------------------- torch, on a GPU
def _torch():
    return pytest.importorskip("torch")


def _torch_qkv(torch, rng, batch, n, heads, heads_kv, d):
    q, k, v = inputs.random_qkv(rng, batch, n, heads, d, DTYPE, heads_kv=heads_kv)
    return (q, k, v), [inputs.to_device(x, "torch").requires_grad_() for x in (q, k, v)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [59, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_gradients_are_exact(rng, head_dim, causal):
    """flash_attn_func on torch tensors is differentiable: dq, dk, dv against float64 (d=59 is
    padded to 64 inside, and the padding's gradient cut off by autograd)."""
    torch = _torch()
    (q, k, v), (tq, tk, tv) = _torch_qkv(torch, rng, 2, 300, 4, 2, head_dim)
    out = fa.flash_attn_func(tq, tk, tv, causal=causal)
    do = rng.standard_normal(out.shape).astype(inputs.DTYPES[DTYPE])
    out.backward(inputs.to_device(do, "torch"))
    ref = reference.attention_backward(q, k, v, do, causal=causal)
    got = checks.compare_gradients([inputs.to_host(t.grad) for t in (tq, tk, tv)], ref, DTYPE)
    assert got["ok"], got
    ref_o, _ = reference.attention(q, k, v, causal=causal)
    assert checks.compare(inputs.to_host(out), np.zeros((2, 4, 300)), ref_o,
                          np.zeros((2, 4, 300)), DTYPE)["ok"]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_torch_dropout_is_exact_and_reproducible(rng, causal):
    """dropout_p > 0 on torch tensors (fa2's kernels on every GPU): the mask is keep_mask of the
    seed and offset torch's generator held before the call (which the call advances); out and
    dq, dk, dv against float64 with that mask; torch.manual_seed replays the call bit for bit and
    the next call draws another mask."""
    torch = _torch()
    from common.tile import dropout
    (q, k, v), (tq, tk, tv) = _torch_qkv(torch, rng, 2, 300, 4, 2, 64)
    p = 0.2
    torch.manual_seed(1234)
    generator = torch.cuda.default_generators[tq.device.index or 0]
    seed, offset = generator.initial_seed(), generator.get_offset()
    out = fa.flash_attn_func(tq, tk, tv, dropout_p=p, causal=causal)
    assert generator.get_offset() > offset
    do = rng.standard_normal(out.shape).astype(inputs.DTYPES[DTYPE])
    out.backward(inputs.to_device(do, "torch"))
    drop = dict(dropout_p=p, dropout_mask=dropout.keep_mask(seed, offset, p, 2, 4, 300, 300))
    ref_o, _ = reference.attention(q, k, v, causal=causal, **drop)
    lse0 = np.zeros((2, 4, 300))
    assert checks.compare(inputs.to_host(out), lse0, ref_o, lse0, DTYPE)["ok"]
    ref = reference.attention_backward(q, k, v, do, causal=causal, **drop)
    got = checks.compare_gradients([inputs.to_host(t.grad) for t in (tq, tk, tv)], ref, DTYPE)
    assert got["ok"], got
    again = fa.flash_attn_func(tq, tk, tv, dropout_p=p, causal=causal)
    assert not torch.equal(again, out)
    torch.manual_seed(1234)
    assert torch.equal(fa.flash_attn_func(tq, tk, tv, dropout_p=p, causal=causal), out)


@pytest.mark.gpu
def test_torch_attention_chunk_gradients(rng):
    """attention_chunk on torch tensors: out, softmax_lse and dq, dk, dv against float64 with the
    chunked mask (keys of a chunk no query reaches get zero gradients)."""
    torch = _torch()
    q, k, v = inputs.random_qkv(rng, 2, 300, 4, 64, DTYPE, seqlen_k=520, heads_kv=2)
    tq, tk, tv = (inputs.to_device(x, "torch").requires_grad_() for x in (q, k, v))
    out, lse, _ = fa.flash_attn_func(tq, tk, tv, causal=True, attention_chunk=128,
                                     return_attn_probs=True)
    do = rng.standard_normal(out.shape).astype(inputs.DTYPES[DTYPE])
    out.backward(inputs.to_device(do, "torch"))
    ref_o, ref_lse = reference.attention(q, k, v, causal=True, attention_chunk=128)
    got = checks.compare(inputs.to_host(out), inputs.to_host(lse), ref_o, ref_lse, DTYPE)
    assert got["ok"], checks.describe_failure(got)
    ref = reference.attention_backward(q, k, v, do, causal=True, attention_chunk=128)
    grads = checks.compare_gradients([inputs.to_host(t.grad) for t in (tq, tk, tv)], ref, DTYPE)
    assert grads["ok"], grads


@pytest.mark.gpu
@pytest.mark.parametrize("d_qk, d_v", [(192, 128), (64, 128), (59, 40)])
def test_v_head_dim_other_than_qk(rng, d_qk, d_v):
    """FA3's hdim_v: V's head dim other than Q's and K's (DeepSeek's 192 / 128), padded to the
    wider inside; output, dq, dk, dv against float64, softmax_scale from Q's head dim."""
    _torch()
    q, k, _ = inputs.random_qkv(rng, 2, 300, 4, d_qk, DTYPE, heads_kv=2)
    v = inputs.random_qkv(rng, 2, 300, 2, d_v, DTYPE)[2]
    tq, tk, tv = (inputs.to_device(x, "torch").requires_grad_() for x in (q, k, v))
    out = fa.flash_attn_func(tq, tk, tv, causal=True)
    assert tuple(out.shape) == (2, 300, 4, d_v)
    do = rng.standard_normal(out.shape).astype(inputs.DTYPES[DTYPE])
    out.backward(inputs.to_device(do, "torch"))
    ref_o, _ = reference.attention(q, k, v, causal=True)
    lse0 = np.zeros((2, 4, 300))
    assert checks.compare(inputs.to_host(out), lse0, ref_o, lse0, DTYPE)["ok"]
    ref = reference.attention_backward(q, k, v, do, causal=True)
    got = checks.compare_gradients([inputs.to_host(t.grad) for t in (tq, tk, tv)], ref, DTYPE)
    assert got["ok"], got


def test_v_head_dim_other_than_qk_needs_torch(rng):
    """CuPy / Numba arrays with V's head dim other than Q's are refused by name (torch tensors
    are padded inside)."""
    q = device(np.zeros((1, 8, 2, 64), dtype=inputs.DTYPES[DTYPE]), library="numba")[0]
    v = device(np.zeros((1, 8, 2, 32), dtype=inputs.DTYPES[DTYPE]), library="numba")[0]
    with pytest.raises(ValueError, match=r"head dims 64 \(q, k\) and 32 \(v\)"):
        fa.flash_attn_func(q, q, v)


@pytest.mark.gpu
def test_deterministic_backward_is_bitwise_reproducible(rng):
    torch = _torch()
    _, (tq, tk, tv) = _torch_qkv(torch, rng, 2, 1024, 8, 2, 128)
    do = torch.randn(tq.shape, dtype=tq.dtype, device=tq.device)
    grads = []
    for _ in range(2):
        dq, dk, dv = torch.autograd.grad(fa.flash_attn_func(tq, tk, tv, causal=True,
                                                            deterministic=True), (tq, tk, tv), do)
        grads.append((dq, dk, dv))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")   # inductor's own (torch 2.11)
def test_torch_compile_fullgraph(rng):
    """A function calling flash_attn_func compiles with fullgraph=True (no graph break) and gives
    the eager call's output and gradients."""
    torch = _torch()
    _, (tq, tk, tv) = _torch_qkv(torch, rng, 2, 256, 4, 4, 64)

    def layer(q, k, v):
        return fa.flash_attn_func(q * 1.0, k, v, causal=True).float().square().sum()

    eager = torch.autograd.grad(layer(tq, tk, tv), (tq, tk, tv))
    compiled = torch.compile(layer, fullgraph=True)
    got = torch.autograd.grad(compiled(tq, tk, tv), (tq, tk, tv))
    for a, b in zip(eager, got):   # fa3's dQ is added by atomics, in any order
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)
