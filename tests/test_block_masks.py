"""Block masks (variants.block_mask, common/host/mods.py BlockMask, common/tile/mods.py): a
mask_mod's lists of kept blocks against NumPy's classification, fa2's forward and backward with
them against the float64 reference and against the same calls without them, and the
refusals. (A file of its own beside tests/test_mods.py, so that CI's workers split the two.)"""
import numpy as np
import pytest

import variants
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU
from tests.test_backward import SMALL
from tests.test_mods import DTYPE, EXAMPLES, FORWARD, HEAD_DIM, aux_of
from variants import score_mods


def _classes(mask_mod, aux, batch, heads, n_q, n_k, bm, bn):
    """NumPy's block lists: for each (b, h, query block), the kept key blocks with FULL."""
    from common.tile.mods import FULL
    keep = np.zeros((batch, heads, n_q, n_k), bool)
    fn = getattr(mask_mod, "py_func", mask_mod)
    for b in range(batch):
        for h in range(heads):
            for i in range(n_q):
                for j in range(n_k):
                    keep[b, h, i, j] = fn(b, h, i, j, aux)
    lists = {}
    for b in range(batch):
        for h in range(heads):
            for i in range(-(-n_q // bm)):
                entries = []
                for j in range(-(-n_k // bn)):
                    tile = keep[b, h, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
                    if tile.any():
                        entries.append(j | (FULL if tile.all() else 0))
                lists[b, h, i] = entries
    return lists


def _same_forward(o1, o2, lse1, lse2):
    """The forward with the lists against the one that visits every block of the band: bit for
    bit in the simulator. On the GPU the second also visits the empty blocks, and a visit is not
    an exact no-op there: it rescales O and l by alpha = 2^(m_old scale_log2 - base) with base =
    m_new scale_log2 rounded, and ptxas contracts the exponent's mul.f32 and sub.f32 into one
    FFMA, whose result for m_old = m_new is base's rounding error, not 0 (common/tile/softmax.py
    advance_row): alpha is 1 or 1 + an ulp or two. O and l take the same factor, so the output
    moves by float32 rounding: within a bf16 ulp, the LSE within 1e-5."""
    if not ON_GPU:
        assert np.array_equal(o1, o2) and np.array_equal(lse1, lse2)
        return
    a, b = o1.astype(np.float32), o2.astype(np.float32)
    assert np.all(np.abs(a - b) <= 2.0 ** -7 * np.abs(b) + 2.0 ** -24), np.abs(a - b).max()
    assert np.abs(lse1 - lse2).max() <= 1e-5, np.abs(lse1 - lse2).max()


@pytest.mark.parametrize("name, batch, causal, dq_paths", [
    ("document_mask", 1, True, ("atomic", "separate")),
    ("prefix_lm", 2, False, ("atomic",)),      # lists by batch
    ("sliding_window", 1, True, ()),
    ("dilated", 1, False, ())])                 # every block partial
def test_block_mask_visits_the_kept_blocks_and_changes_nothing(rng, name, batch, causal,
                                                                dq_paths):
    """The BlockMask's lists are NumPy's classification of every block; a forward that visits only
    them (and tests no element of a FULL block) matches the float64 reference and, bit for bit
    (on the GPU within float32 rounding: _same_forward), the forward that visits every block of
    the band; so does the backward, its dK and dV bit for bit (dq_paths: the dQ
    paths checked; in the simulator two masks suffice, each backward being minutes there)."""
    n, heads = (2048, 4) if ON_GPU else (128, 2)
    mask_mod = EXAMPLES[name][2]
    q, k, v = inputs.random_qkv(rng, batch, n, heads, HEAD_DIM, DTYPE)
    host_aux = aux_of(name, rng, batch, heads, n)
    library = inputs.default_library()
    dev = [inputs.to_device(x, library) for x in (q, k, v)]
    aux = tuple(inputs.to_device(x, library) for x in host_aux)
    bm = variants.block_mask(mask_mod, n, n, batch=batch, aux=aux, like=dev[0])
    options = dict(FORWARD)
    block_m, block_n = options.get("block_m", 128), options.get("block_n", 64)
    if not ON_GPU:   # the lists against NumPy's (the simulator's small problem)
        counts, blocks = bm.blocks_kept(block_m, block_n)
        want = _classes(mask_mod, host_aux, batch, 1, n, n, block_m, block_n)
        for (b, h, i), entries in want.items():
            assert list(blocks[b, h, i, :counts[b, h, i]]) == entries, (b, h, i)
    mask = dict(causal=causal)
    o1, lse1 = variants.forward(*dev, variant="fa2", mask_mod=mask_mod, aux=aux, block_mask=bm,
                                **mask, **options)
    o2, lse2 = variants.forward(*dev, variant="fa2", mask_mod=mask_mod, aux=aux, **mask,
                                **options)
    ref = reference.attention(q, k, v, mask_mod=mask_mod, aux=host_aux, **mask)
    got = checks.compare(inputs.to_host(o1), inputs.to_host(lse1), *ref, DTYPE)
    assert got["ok"], f"{name}: " + checks.describe_failure(got)
    _same_forward(inputs.to_host(o1), inputs.to_host(o2), inputs.to_host(lse1),
                  inputs.to_host(lse2))

    # the backward: its K/V kernel walks each key block's transposed list, the separate dQ
    # kernel (dq="separate") each query block's list
    dq_paths = dq_paths or (("atomic", "separate") if ON_GPU else ())
    if not dq_paths:
        return
    do = rng.standard_normal(q.shape, dtype=np.float32).astype(q.dtype)
    ddo = inputs.to_device(do, library)
    ref = reference.attention_backward(q, k, v, do, mask_mod=mask_mod, aux=host_aux, **mask)
    for dq_path in dq_paths:
        small = dict(SMALL["fa2"], dq=dq_path)
        g1 = variants.backward(ddo, *dev, o1, lse1, variant="fa2", mask_mod=mask_mod, aux=aux,
                               block_mask=bm, **mask, **small)
        g2 = variants.backward(ddo, *dev, o1, lse1, variant="fa2", mask_mod=mask_mod, aux=aux,
                               **mask, **small)
        errors = checks.compare_gradients([inputs.to_host(x) for x in g1[:3]], ref[:3], DTYPE)
        assert errors["ok"], f"{name} backward dq={dq_path}: {errors}"
        for x, y in zip(g1[1:3], g2[1:3]):   # dK, dV: registers, in order, bit for bit
            assert np.array_equal(inputs.to_host(x), inputs.to_host(y))


def test_block_mask_is_refused_for_another_mask_or_geometry(rng):
    library = inputs.default_library()
    q, k, v = (inputs.to_device(x, library) for x in inputs.random_qkv(rng, 1, 40, 1, 64, DTYPE))
    window = inputs.to_device(np.array([8], np.int32), library)
    bm = variants.block_mask(score_mods.sliding_window, 40, 40, aux=(window,))
    with pytest.raises(ValueError, match="without its mask_mod"):
        variants.forward(q, k, v, variant="fa2", block_mask=bm)
    with pytest.raises(ValueError, match="was made for mask_mod"):
        variants.forward(q, k, v, variant="fa2", mask_mod=score_mods.dilated, block_mask=bm)
    small = variants.block_mask(score_mods.sliding_window, 32, 40, aux=(window,))
    with pytest.raises(ValueError, match="block_mask is for N_q=32"):
        variants.forward(q, k, v, variant="fa2", mask_mod=score_mods.sliding_window,
                         aux=(window,), block_mask=small)
    with pytest.raises(ValueError, match="needs `like`"):
        variants.block_mask(score_mods.dilated, 40, 40)
