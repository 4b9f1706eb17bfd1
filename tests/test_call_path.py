"""The per-call path (common/host/problem.py, "the per-call path"): a torch call with the geometry of an
earlier one skips the checks and reuses the layouts, so it must return exactly what the checked
path returns, for each call's own data, raise what the checked path raises, and keep nothing of a
call alive."""
import gc
import weakref

import pytest

import variants
from common.host import problem, replay
from experiments.measure import checks, inputs, reference
from variants import backward_shared as backward

pytestmark = pytest.mark.gpu

SHAPE = dict(batch=2, seqlen=200, heads=4, head_dim=64)


def _forget_templates():
    problem._TEMPLATES.clear()
    backward._TEMPLATES.clear()
    replay.forget()


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
    for _ in range(3):
        variants.forward(q, k, v, variant="fa2")   # the geometry known, its call replayed
    flat = torch.empty(q.numel() + 8, dtype=q.dtype, device=q.device)
    shifted = flat[1:1 + q.numel()].view(q.shape)              # same shape and strides, 2 bytes off
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte"):
        variants.forward(shifted, k, v, variant="fa2")
    o, lse = variants.forward(q, k, v, variant="fa2")
    do = torch.randn_like(o)
    for _ in range(3):
        variants.backward(do, q, k, v, o, lse, variant="fa2")
    with pytest.raises(ValueError, match="16-byte"):
        variants.backward(do, shifted, k, v, o, lse, variant="fa2")


@pytest.mark.parametrize("variant", ["fa2", "fa3"])
@pytest.mark.parametrize("calls", [1, 3])
def test_templates_keep_no_call_alive(rng, calls, variant):
    """Nor do the plans of replayed calls (calls=3: the second call is recorded, the third
    replayed)."""
    torch = pytest.importorskip("torch")
    if variant not in _variants():
        pytest.skip("fa3 needs sm_90")
    _forget_templates()
    _, (q, k, v) = _torch_qkv(rng)
    do = torch.randn_like(q)
    for _ in range(calls):
        o, lse = variants.forward(q, k, v, variant=variant)
        grads = variants.backward(do, q, k, v, o, lse, variant=variant)
    refs = [weakref.ref(x) for x in (q, k, v, o, lse, *grads)]
    del q, k, v, o, lse, grads, do
    gc.collect()
    assert all(r() is None for r in refs)
    assert problem._TEMPLATES and backward._TEMPLATES


@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_recorded_and_replayed_calls_make_no_reference_cycles(rng, variant):
    """A call's tensors go by reference counting alone, the collector off. A reference cycle
    through a recorded call's inputs keeps their autograd graph alive until the collector runs,
    and a CUDA-graph capture after it finds that graph's nodes on another stream (torch warns:
    test_graphs failed so while replay.py resolved views with closures that called each other).

    Calls of another geometry are recorded first, so that this test holds wherever it runs in its
    pytest worker: the next test checks the first call recorded in a process."""
    torch = pytest.importorskip("torch")
    if variant not in _variants():
        pytest.skip("fa3 needs sm_90")
    _forget_templates()
    _, warm = _torch_qkv(rng)
    warm = [x[:1] for x in warm]
    for _ in range(3):
        o, lse = variants.forward(*warm, variant=variant)
        variants.backward(torch.randn_like(o), *warm, o, lse, variant=variant)
    del warm, o, lse
    _, (q, k, v) = _torch_qkv(rng)
    do = torch.randn_like(q)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):   # the checked path, then recorded, then replayed
            o, lse = variants.forward(q, k, v, variant=variant)
            grads = variants.backward(do, q, k, v, o, lse, variant=variant)
        refs = [weakref.ref(x) for x in (q, k, v, o, lse, *grads)]
        del q, k, v, o, lse, grads, do
        assert all(r() is None for r in refs)
    finally:
        gc.enable()


_FIRST_RECORDING = """
import gc, sys, weakref
import common
common.select_backend()
import variants
from experiments.measure import inputs
q, k, v = (inputs.to_device(x, "torch") for x in inputs.random_qkv(
    __import__("numpy").random.default_rng(0), 2, 200, 4, 64, "bfloat16"))
from common.host import replay
print("dynamo imported before", "torch._dynamo" in sys.modules)
gc.disable()
o, lse = variants.forward(q, k, v, variant="fa2")   # the checked path; starts the first use
replay.warm_up()                                     # (on its thread): the next call is recorded
o, lse = variants.forward(q, k, v, variant="fa2")   # the first call recorded in this process
refs = [weakref.ref(x) for x in (q, k, v, o, lse)]
del q, k, v, o, lse
print("plans", sum(type(p) is replay.Plan for p in variants.get("fa2").forward.plans.values()))
print("alive", sum(r() is not None for r in refs))
"""


def test_the_first_recorded_call_of_a_process_keeps_nothing_alive():
    """The first dispatch mode a process uses imports torch._dynamo, and the import's reference
    cycles held the frames of the call recorded then, with its tensors, until the collector ran;
    it now runs on a thread of its own, started by the first call (replay._dispatch_ready). A
    fresh process, the collector off."""
    import os
    import subprocess
    import sys
    pytest.importorskip("torch")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _FIRST_RECORDING], cwd=root, capture_output=True,
                         text=True, timeout=300,
                         env=dict(os.environ, FA_REPLAY="1", PYTHONPATH=os.pathsep.join(
                             [root] + os.environ.get("PYTHONPATH", "").split(os.pathsep))))
    assert run.returncode == 0, run.stderr[-3000:]
    words = run.stdout.split()
    # the premise: no dispatch mode ran before, and the second call was recorded into a plan
    assert words[words.index("before") + 1] == "False", run.stdout
    assert words[-4:] == ["plans", "1", "alive", "0"], run.stdout


def _plans(fn):
    return [p for p in fn.plans.values() if type(p) is replay.Plan]


def test_fa3_replays_keep_and_remake_their_tensor_maps(rng):
    """A replayed fa3 call makes the tensor maps of its inputs' addresses, keeps those of its last
    _Derived.KEEP address sets and reuses them when the addresses come back. KEEP + 2 input sets,
    then the same in reverse, so that the second round reuses the last KEEP sets' maps and remakes
    the first two's, dropped: every call returns what the ordinary path returns on its data."""
    torch = pytest.importorskip("torch")
    if "fa3" not in _variants():
        pytest.skip("fa3 needs sm_90")
    from variants import fa3
    _forget_templates()
    sets = [_torch_qkv(rng)[1] for _ in range(replay._Derived.KEEP + 2)]
    for order in (sets, sets[::-1]):
        for qkv in order:
            o, lse = fa3.forward(*qkv, causal=True)
            o_want, lse_want = fa3.forward.__wrapped__(*qkv, causal=True)
            assert torch.equal(o, o_want) and torch.equal(lse, lse_want)
    plan, = _plans(fa3.forward)
    derived, = plan.derived
    # Sets 2.. were replayed in the first round (0: the checked path, 1: recorded), and 2.. 9 kept;
    # the second round reused 9 .. 2 and remade 1 and 0, each dropping the oldest kept. Remaking
    # every call would leave 7 .. 0.
    keep = replay._Derived.KEEP
    want = sets[-(keep - 2):] + sets[:2]
    assert set(derived.kept) == {tuple(x.data_ptr() for x in qkv) for qkv in want}


def test_fa3_tensor_maps_are_ordered_on_the_calls_stream(rng):
    """fa3's tensor maps are uploaded on the call's stream and waited for, so that a kernel on a
    non-blocking stream (torch's side streams) reads them whole, from whichever stream: calls on
    two side streams, the maps new on the first and reused on the second, return the default
    stream's result. (Whether an early read happens depends on timing; the wait is what makes it
    impossible.)"""
    torch = pytest.importorskip("torch")
    if "fa3" not in _variants():
        pytest.skip("fa3 needs sm_90")
    from variants import fa3
    qkv = _torch_qkv(rng)[1]
    o_want, lse_want = fa3.forward.__wrapped__(*qkv, causal=True)
    fresh = [x.clone() for x in qkv]   # new addresses: new maps
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    outs = []
    for stream in (first, second):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outs.append(fa3.forward.__wrapped__(*fresh, causal=True))
    torch.cuda.synchronize()
    for o, lse in outs:
        assert torch.equal(o, o_want) and torch.equal(lse, lse_want)


@pytest.mark.parametrize("variant", ["standard", "fa1", "fa2", "fa3"])
def test_replayed_calls_match_the_ordinary_path(rng, variant):
    """From the third call of a geometry on, forward and backward are replayed (common/host/replay.py):
    the recorded launches over the call's own addresses and allocations (and fa3's tensor maps,
    made for those addresses). They must return what the ordinary path returns on the same data,
    causal or not, with GQA."""
    torch = pytest.importorskip("torch")
    if variant not in _variants():
        pytest.skip("fa3 needs sm_90")
    module = variants.get(variant)
    if variant == "fa3":   # fa3.backward chooses a kernel; its own is the replayed function
        from variants import fa3_backward
        backward = fa3_backward.backward
    else:
        backward = module.backward
    _forget_templates()
    del replay._REFUSALS[:]
    for causal in (False, True):
        for call in range(3):
            host, qkv = _torch_qkv(rng, heads_kv=2)
            o, lse = module.forward(*qkv, causal=causal)
            do = torch.randn_like(o)
            grads = module.backward(do, *qkv, o, lse, causal=causal)
        assert len(_plans(module.forward)) == len(_plans(backward)) == 1 + causal, \
            replay._REFUSALS
        ref = reference.attention(*host, causal=causal)
        got = checks.compare(inputs.to_host(o), inputs.to_host(lse), *ref, "bfloat16")
        assert got["ok"], checks.describe_failure(got)
        o_want, lse_want = module.forward.__wrapped__(*qkv, causal=causal)
        assert torch.equal(o, o_want) and torch.equal(lse, lse_want)
        want = backward.__wrapped__(do, *qkv, o, lse, causal=causal)
        for g, w in zip(grads, want):   # fa2's dQ atomics add in any order
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
    assert not replay._REFUSALS


def test_calls_with_preallocated_outputs_are_not_replayed(rng):
    torch = pytest.importorskip("torch")
    _forget_templates()
    host, (q, k, v) = _torch_qkv(rng)
    o, lse = torch.empty_like(q), torch.empty(q.shape[0], q.shape[2], q.shape[1],
                                               dtype=torch.float32, device=q.device)
    for _ in range(3):
        o.zero_()
        got = variants.forward(q, k, v, variant="fa2", out=(o, lse))
        assert got[0] is o and got[1] is lse
        want, _ = variants.forward(q, k, v, variant="fa2")
        assert torch.equal(o, want)
    plans = variants.get("fa2").forward.plans   # an array in the key: never kept (it would hold o)
    assert all(dict(key[0]).get("out") is None for key in plans)
    assert len(_plans(variants.get("fa2").forward)) == 1     # the call without out only


def test_replayed_backward_through_autograd(rng):
    """torch runs a Python node's backward on its own thread: replays from there, too."""
    torch = pytest.importorskip("torch")
    _forget_templates()
    for _ in range(3):
        host, qkv = _torch_qkv(rng)
        leaves = [x.detach().requires_grad_() for x in qkv]
        o = variants.attention(*leaves, variant="fa2", causal=True)
        do = torch.randn_like(o)
        grads = torch.autograd.grad(o, leaves, do)
    assert _plans(variants.get("fa2").forward) and _plans(variants.get("fa2").backward)
    want = variants.get("fa2").backward.__wrapped__(
        do, *qkv, *variants.get("fa2").forward.__wrapped__(*qkv, causal=True), causal=True)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)


def test_calls_launch_on_the_current_stream(rng):
    """On a side stream that is busy, then writes q: a call that launched anywhere else would read
    q before the write."""
    torch = pytest.importorskip("torch")
    _, (q, k, v) = _torch_qkv(rng)
    _, (new_q, _, _) = _torch_qkv(rng)
    for _ in range(2):   # the geometry is known and its call recorded: the next is replayed
        variants.forward(q, k, v, variant="fa2")
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
    """decode with check=False keeps a template per geometry (common/host/kvcache.py): a later call on
    new caches, queries and block table returns, bit for bit, what the checked call returns on
    the same data, and a misaligned q of that geometry is still refused."""
    torch = pytest.importorskip("torch")
    import numpy as np

    from common.host import kvcache
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
