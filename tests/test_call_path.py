"""The per-call path (common/problem.py, "the per-call path"): a torch call with the geometry of an
earlier one skips the checks and reuses the layouts, so it must return exactly what the checked
path returns, for each call's own data, raise what the checked path raises, and keep nothing of a
call alive."""
import gc
import weakref

import pytest

import variants
from common import backward, checks, inputs, problem, reference

pytestmark = pytest.mark.gpu

SHAPE = dict(batch=2, seqlen=200, heads=4, head_dim=64)


def _forget_templates():
    problem._TEMPLATES.clear()
    backward._TEMPLATES.clear()


def _torch_qkv(rng, dtype="bfloat16", heads_kv=None):
    host = inputs.random_qkv(rng, SHAPE["batch"], SHAPE["seqlen"], SHAPE["heads"],
                             SHAPE["head_dim"], dtype, heads_kv=heads_kv)
    return host, [inputs.to_device(x, "torch") for x in host]


def _variants():
    import torch
    names = list(variants.REGISTRY)
    if torch.cuda.get_device_capability() < (9, 0):
        names.remove("fa3")
    return names


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2", "fa3"])
def test_repeated_calls_match_the_checked_path_on_their_own_data(rng, variant, causal):
    torch = pytest.importorskip("torch")
    if variant not in _variants():
        pytest.skip("fa3 needs sm_90")
    module = variants.get(variant)
    _forget_templates()
    first_host, first = _torch_qkv(rng, heads_kv=2)
    module.forward(*first, causal=causal)                     # the checked path; makes the template
    for _ in range(2):                                        # then new data, same geometry
        host, qkv = _torch_qkv(rng, heads_kv=2)
        o, lse = module.forward(*qkv, causal=causal)          # the per-call path
        ref = reference.attention(*host, causal=causal)
        got = checks.compare(inputs.to_host(o), inputs.to_host(lse), *ref, "bfloat16")
        assert got["ok"], checks.describe_failure(got)
        _forget_templates()
        o_checked, lse_checked = module.forward(*qkv, causal=causal)
        assert torch.equal(o, o_checked) and torch.equal(lse, lse_checked)
        if hasattr(module, "backward"):       # dQ's atomics make fa2's order of adds vary
            do = torch.randn_like(o)
            _forget_templates()
            want = module.backward(do, *qkv, o, lse, causal=causal)        # checked
            got_grads = module.backward(do, *qkv, o, lse, causal=causal)   # per-call
            for g, w in zip(got_grads, want):
                torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)


def test_a_misaligned_tensor_of_a_known_geometry_is_refused(rng):
    torch = pytest.importorskip("torch")
    _, (q, k, v) = _torch_qkv(rng)
    variants.forward(q, k, v, variant="fa2")                   # the geometry is now known
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    shifted = flat[1:1 + q.numel()].view(q.shape)              # same shape and strides, 2 bytes off
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte"):
        variants.forward(shifted, k, v, variant="fa2")
    o, lse = variants.forward(q, k, v, variant="fa2")
    do = torch.randn_like(o)
    variants.backward(do, q, k, v, o, lse, variant="fa2")
    with pytest.raises(ValueError, match="16-byte"):
        variants.backward(do, shifted, k, v, o, lse, variant="fa2")


def test_templates_keep_no_call_alive(rng):
    torch = pytest.importorskip("torch")
    _forget_templates()
    _, (q, k, v) = _torch_qkv(rng)
    o, lse = variants.forward(q, k, v, variant="fa2")
    grads = variants.backward(torch.randn_like(o), q, k, v, o, lse, variant="fa2")
    refs = [weakref.ref(x) for x in (q, k, v, o, lse, *grads)]
    del q, k, v, o, lse, grads
    gc.collect()
    assert all(r() is None for r in refs)
    assert problem._TEMPLATES and backward._TEMPLATES


def test_calls_launch_on_the_current_stream(rng):
    """On a side stream that is busy, then writes q: a call that launched anywhere else would read
    q before the write."""
    torch = pytest.importorskip("torch")
    _, (q, k, v) = _torch_qkv(rng)
    _, (new_q, _, _) = _torch_qkv(rng)
    variants.forward(q, k, v, variant="fa2")            # the geometry is known: the per-call path
    want, _ = variants.forward(new_q, k, v, variant="fa2")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)                  # ~0.1 s of GPU clock cycles
        q.copy_(new_q)
        got, _ = variants.forward(q, k, v, variant="fa2")
    side.synchronize()
    assert torch.equal(got, want)


@pytest.mark.parametrize("append", [False, True])
def test_decode_calls_of_a_known_geometry_match_the_checked_path(rng, append):
    """decode with check=False keeps a template per geometry (common/kvcache.py): a later call on
    new caches, queries and block table returns, bit for bit, what the checked call returns on
    the same data, and a misaligned q of that geometry is still refused."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from common import kvcache
    from tests.test_decode import make_cache
    lengths, heads, heads_kv, d, page = [300, 1000], 8, 2, 128, 256
    capacity = -(-(max(lengths) + 1) // page) * page + page
    dev = lambda x: inputs.to_device(x, "torch")                                  # noqa: E731

    def draw():
        k_cache, v_cache, table = make_cache(rng, lengths, heads_kv, d, "bfloat16", page, capacity)
        q = rng.standard_normal((len(lengths), 1, heads, d), dtype=np.float32)
        kn, vn = (rng.standard_normal((len(lengths), 1, heads_kv, d), dtype=np.float32)
                  for _ in range(2))
        return [dev(x.astype(inputs.DTYPES["bfloat16"])) if x.dtype != np.int32 else dev(x)
                for x in (q, k_cache, v_cache, table, kn, vn)]

    def call(q, kc, vc, tbl, kn, vn, check):
        lens = dev(np.array(lengths, dtype=np.int32))
        new = dict(k=kn, v=vn) if append else {}
        return variants.decode(q, kc, vc, lens, block_table=tbl, check=check, num_splits=4, **new)

    kvcache._TEMPLATES.clear()
    call(*draw(), check=False)                      # the checked path; makes the template
    assert len(kvcache._TEMPLATES) == 1
    args = draw()
    got = call(*[x.clone() for x in args], check=False)     # the per-call path
    want = call(*args, check=True)                           # checked, on the same data
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q = args[0]
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    shifted = flat[1:1 + q.numel()].view(q.shape)
    with pytest.raises(ValueError, match="16-byte"):
        call(shifted, *args[1:], check=False)
