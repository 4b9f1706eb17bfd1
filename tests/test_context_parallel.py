"""Context parallelism (variants/context_parallel.py): ring attention over several ranks.

Without GPUs (CI) the ring's loops run in one process, one thread per rank, passing arrays through
queues (`ThreadRing`, a test double of TorchRing); the kernels are the float64 reference (exact to
1e-12: the schedule, the merge and the travelling dK, dV), or fa2 itself in the simulator. With
torch installed, two processes run the torch.distributed ring (gloo, CPU tensors) through the
autograd Function. On a host with two GPUs, torchrun runs fa2 under NCCL against one GPU's result.
"""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import variants
import variants.context_parallel as cp
from experiments.measure import checks, inputs, reference
from tests.conftest import ON_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ThreadRing:
    """Rank `rank` of a ring of threads. As in NCCL and gloo, a receive matches the send posted in
    the same order: the n-th exchange of rank r puts copies of its tensors into rank r + 1's
    mailbox under n, and its handle waits for rank r - 1's n-th."""

    def __init__(self, rank, boxes):
        self.rank, self.world, self.boxes, self.posted = rank, len(boxes), boxes, 0

    def exchange(self, tensors):
        self.boxes[(self.rank + 1) % self.world].put(self.posted,
                                                     [np.array(t, copy=True) for t in tensors])
        self.posted += 1
        return _Receive(self.boxes[self.rank], self.posted - 1)


class Mailbox:
    def __init__(self):
        self.items, self.ready = {}, threading.Condition()

    def put(self, n, item):
        with self.ready:
            self.items[n] = item
            self.ready.notify_all()

    def take(self, n):
        with self.ready:
            if not self.ready.wait_for(lambda: n in self.items, timeout=600):
                raise TimeoutError(f"exchange {n} never arrived")
            return self.items.pop(n)


class _Receive:
    def __init__(self, box, n):
        self.box, self.n = box, n

    def wait(self):
        got = self.box.take(self.n)
        if got is None:
            raise RuntimeError("another rank failed")
        return got


def run_ring(world, body):
    """body(ring) on every rank of a ring of threads; the ranks' results in rank order."""
    boxes = [Mailbox() for _ in range(world)]
    results, errors = [None] * world, []

    def run(rank):
        try:
            results[rank] = body(ThreadRing(rank, boxes))
        except BaseException as e:          # re-raised below, in the test's thread
            errors.append(e)
            for box in boxes:               # unblock the others
                for n in range(4 * world):
                    box.put(n, None)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def float64_kernels(softmax_scale):
    """The ring's per-block kernels as the float64 reference: (O, L) and (dQ, dK, dV) of a block
    given the final O, L (the block backward written out, as the variants' backward computes it:
    P = exp(S - L), D = rowsum(dO o O))."""

    def local_forward(q, k, v, causal):
        return reference.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)

    def local_backward(do, q, k, v, o, lse, causal):
        b, n_q, h, d = q.shape
        n_k, group = k.shape[1], h // k.shape[2]
        qh, doh, oh = (x.transpose(0, 2, 1, 3) for x in (q, do, o))
        kh, vh = (np.repeat(x, group, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
        ok = reference.visible(np.arange(n_q), n_k, causal, (-1, -1), "bottom_right", n_q)
        s = np.where(ok, softmax_scale * qh @ kh.transpose(0, 1, 3, 2), -np.inf)
        p = np.exp(s - lse[..., None])
        ds = p * (doh @ vh.transpose(0, 1, 3, 2) - (doh * oh).sum(-1, keepdims=True))
        dq = softmax_scale * ds @ kh
        dk = softmax_scale * ds.transpose(0, 1, 3, 2) @ qh
        dv = p.transpose(0, 1, 3, 2) @ doh

        def per_kv_head(x):
            return x.reshape(b, k.shape[2], group, n_k, d).sum(2).transpose(0, 2, 1, 3)
        return dq.transpose(0, 2, 1, 3), per_kv_head(dk), per_kv_head(dv)

    return local_forward, local_backward


# -- The schedule ---------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity(world, layout):
    x = np.arange(2 * 8 * world * 3).reshape(2, 8 * world, 3)
    parts = [cp.shard(x, r, world, layout) for r in range(world)]
    assert all(p.shape == (2, 8, 3) for p in parts)
    np.testing.assert_array_equal(cp.unshard(parts, layout), x)
    if layout == "zigzag" and world > 1:      # rank 0 holds the first and the last chunk
        np.testing.assert_array_equal(parts[0][:, :4], x[:, :4])
        np.testing.assert_array_equal(parts[0][:, 4:], x[:, -4:])


def test_shard_refuses_a_length_that_does_not_split():
    with pytest.raises(ValueError, match="does not split into 4 equal chunks"):
        cp.shard(np.zeros((1, 6, 1, 8)), 0, 2, "zigzag")
    with pytest.raises(ValueError, match="layout must be one of"):
        cp.shard(np.zeros((1, 8, 1, 8)), 0, 2, "striped")


def covered_pairs(world, causal, layout, n_local):
    """How often each (query, key) pair of the full sequence is computed over all ranks and steps,
    with the blocks' own causal masks applied: (N, N) counts."""
    n = n_local * world
    position = np.arange(n).reshape(world * len(cp.chunk_ids(0, world, layout)), -1)
    where = [np.concatenate([position[c] for c in cp.chunk_ids(r, world, layout)])
             for r in range(world)]
    count = np.zeros((n, n), dtype=int)
    for rank in range(world):
        for step in range(world):
            src = (rank - step) % world
            block = cp.step_block(rank, src, world, causal, layout, n_local)
            if block is None:
                continue
            rows, cols = where[rank][block.rows], where[src][block.cols]
            seen = np.ones((len(rows), len(cols)), dtype=int)
            if block.causal:
                seen = np.tril(seen)
            count[np.ix_(rows, cols)] += seen
    return count


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_the_steps_cover_the_mask_exactly_once(world, causal, layout):
    count = covered_pairs(world, causal, layout, n_local=8)
    full = np.ones_like(count)
    np.testing.assert_array_equal(count, np.tril(full) if causal else full)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_the_causal_work(world):
    """Every rank computes the same number of scores (contiguous: rank W-1 does 2W-1 times rank 0's)."""
    def work(layout):
        per_rank = []
        for rank in range(world):
            total = 0
            for step in range(world):
                b = cp.step_block(rank, (rank - step) % world, world, True, layout, 8)
                if b is not None:
                    rows = len(range(8)[b.rows])
                    total += rows * len(range(8)[b.cols]) // (2 if b.causal else 1)
            per_rank.append(total)
        return per_rank
    zigzag, contiguous = work("zigzag"), work("contiguous")
    assert max(zigzag) == min(zigzag)
    assert max(contiguous) >= (2 * world - 1) * min(contiguous) * 0.9


def test_merge_of_two_key_ranges_is_attention_over_both(rng):
    """(merge), with rows that one half, the other or neither sees (O = 0, L = -inf)."""
    q, k, v = (rng.standard_normal((1, 6, 2, 8)) for _ in range(3))
    ok = rng.random((6, 6)) < 0.5
    ok[0] = False                                  # row 0 sees no key
    ok[1, 3:] = False                              # row 1 sees the first half only
    qk = np.einsum("bqhd,bkhd->bhqk", q, k)
    vh = v.transpose(0, 2, 1, 3)

    def partial(cols):
        mask = np.zeros_like(ok)
        mask[:, cols] = ok[:, cols]
        p, lse, _ = reference.softmax_rows(qk, mask, 0.3)
        return (p @ vh).transpose(0, 2, 1, 3), lse

    o_all, lse_all = partial(slice(None))
    o, lse = cp._Arrays(q).merge(*partial(slice(0, 3)), *partial(slice(3, 6)))
    np.testing.assert_allclose(o, o_all, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_all))
    finite = np.isfinite(lse_all)
    np.testing.assert_allclose(lse[finite], lse_all[finite], rtol=1e-12)
    assert not np.isnan(o).any()


# -- The ring's loops, in float64 ---------------------------------------------------------------

def ring_problem(rng, world, layout, *, batch=2, n_local=6, heads=4, heads_kv=2, head_dim=8):
    n = n_local * world
    q = rng.standard_normal((batch, n, heads, head_dim))
    k, v = (rng.standard_normal((batch, n, heads_kv, head_dim)) for _ in range(2))
    do = rng.standard_normal(q.shape)
    return q, k, v, do


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_forward_and_backward_are_exact(rng, world, causal, layout, overlap):
    q, k, v, do = ring_problem(rng, world, layout)
    scale = 0.4
    fwd, bwd = float64_kernels(scale)
    settings = dict(causal=causal, layout=layout, overlap=overlap)

    def rank_body(ring):
        part = [cp.shard(x, ring.rank, world, layout) for x in (q, k, v, do)]
        o, lse = cp.ring_forward(*part[:3], ring, fwd, **settings)
        grads = cp.ring_backward(part[3], *part[:3], o, lse, ring, bwd, **settings)
        return o, lse, grads

    results = run_ring(world, rank_body)
    o = cp.unshard([r[0] for r in results], layout)
    lse = cp.unshard([r[1] for r in results], layout, dim=2)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, softmax_scale=scale)
    np.testing.assert_allclose(o, o_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-10)
    ref = reference.attention_backward(q, k, v, do, causal=causal, softmax_scale=scale)
    for i, name in enumerate(("dq", "dk", "dv")):
        got = cp.unshard([r[2][i] for r in results], layout)
        np.testing.assert_allclose(got, ref[i], rtol=1e-10, atol=1e-12, err_msg=name)


def test_timeline_marks_every_step(rng):
    """The overlap measurement's marks (host clock here, CUDA events on a GPU): every step starts,
    queues its kernel and, but for the last, receives the next K/V after it (overlap) or before
    it (overlap=False)."""
    world = 3
    q, k, v, _ = ring_problem(rng, world, "zigzag")
    fwd = float64_kernels(0.3)[0]
    for overlap in (True, False):
        def rank_body(ring):
            timeline = cp.Timeline(torch_events=False)
            cp.ring_forward(*(cp.shard(x, ring.rank, world) for x in (q, k, v)), ring, fwd,
                            causal=True, overlap=overlap, timeline=timeline)
            return timeline.steps()
        for steps in run_ring(world, rank_body):
            assert len(steps) == world
            for i, marks in enumerate(steps):
                assert marks["start"] == 0 and marks["computed"] >= 0
                if i + 1 < world:
                    after, before = ("received", "computed") if overlap else ("computed", "received")
                    assert marks[after] >= marks[before]
                else:
                    assert "received" not in marks


def test_ring_refuses_parts_of_different_lengths(rng):
    q, k, v, _ = ring_problem(rng, 1, "zigzag")
    with pytest.raises(ValueError, match="same length"):
        run_ring(1, lambda ring: cp.ring_forward(q, k[:, :4], v[:, :4], ring,
                                                 float64_kernels(0.3)[0], causal=True))


# -- fa2's kernels in the ring ----------------------------------------------------------------------

def fa2_on_host_arrays(lock):
    """The ring's kernels as fa2 on device copies of host arrays (one kernel at a time: the ranks
    are threads of one process), results back on the host."""
    def local_forward(q, k, v, causal):
        with lock:
            dev = [inputs.to_device(np.ascontiguousarray(x), inputs.default_library())
                   for x in (q, k, v)]
            o, lse = variants.forward(*dev, variant="fa2", causal=causal)
            return inputs.to_host(o), inputs.to_host(lse)

    def local_backward(do, q, k, v, o, lse, causal):
        with lock:
            lib = inputs.default_library()
            dev = [inputs.to_device(np.ascontiguousarray(x), lib) for x in (do, q, k, v, o)]
            lse_dev = inputs.to_device(np.ascontiguousarray(lse, dtype=np.float32), lib)
            grads = variants.backward(*dev, lse_dev, variant="fa2", causal=causal)
            return tuple(inputs.to_host(g) for g in grads)

    return local_forward, local_backward


@pytest.mark.slow
def test_ring_of_fa2_kernels_matches_float64(rng):
    """Two ranks, zigzag, causal, bf16: fa2's forward and backward per block, merged by the ring,
    within the single-kernel tolerances of the whole problem's float64 answer."""
    world, layout, n = 2, "zigzag", 40
    q, k, v = inputs.random_qkv(rng, 1, n, 1, 64, "bfloat16")
    do = inputs.random_qkv(rng, 1, n, 1, 64, "bfloat16")[0]
    fwd, bwd = fa2_on_host_arrays(threading.Lock())

    def rank_body(ring):
        part = [cp.shard(x, ring.rank, world, layout) for x in (q, k, v, do)]
        o, lse = cp.ring_forward(*part[:3], ring, fwd, causal=True, layout=layout)
        return o, lse, cp.ring_backward(part[3], *part[:3], o, lse, ring, bwd, causal=True,
                                        layout=layout)

    results = run_ring(world, rank_body)
    o = cp.unshard([r[0] for r in results], layout)
    lse = cp.unshard([r[1] for r in results], layout, dim=2)
    got = checks.compare(o, lse, *reference.attention(q, k, v, causal=True), "bfloat16")
    assert got["ok"], checks.describe_failure(got)
    grads = [cp.unshard([r[2][i] for r in results], layout) for i in range(3)]
    ref = reference.attention_backward(q, k, v, do, causal=True)
    result = checks.compare_gradients(grads, ref, "bfloat16")
    assert result["ok"], result


# -- torch.distributed ---------------------------------------------------------------------------

def _gloo_rank(rank, world, port, layout, causal, path):
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        data = np.load(path)
        q, k, v, do = (torch.tensor(cp.shard(data[n], rank, world, layout), requires_grad=n != "do")
                       for n in ("q", "k", "v", "do"))
        fwd, bwd = float64_kernels(0.3)

        def as_torch(f):
            def call(*xs):
                out = f(*(x.detach().numpy() if isinstance(x, torch.Tensor) else x for x in xs))
                return tuple(torch.from_numpy(np.ascontiguousarray(y)) for y in out)
            return call

        o = cp.attention(q, k, v, causal=causal, layout=layout, softmax_scale=0.3,
                         local_kernels=(as_torch(fwd), as_torch(bwd)))
        (o * do).sum().backward()
        np.savez(f"{path}.{rank}.npz", o=o.detach().numpy(), dq=q.grad.numpy(),
                 dk=k.grad.numpy(), dv=v.grad.numpy())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout, causal", [("zigzag", True), ("contiguous", False)])
def test_torch_distributed_ring_over_gloo(rng, tmp_path, layout, causal):
    """TorchRing (batch_isend_irecv) and the autograd Function, two processes on CPU tensors."""
    torch = pytest.importorskip("torch")
    import socket
    world = 2
    q, k, v, do = ring_problem(rng, world, layout, batch=1, n_local=8)
    path = str(tmp_path / "problem.npz")
    np.savez(path, q=q, k=k, v=v, do=do)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_gloo_rank, args=(world, port, layout, causal, path),
                                nprocs=world, join=True)
    got = [np.load(f"{path}.{r}.npz") for r in range(world)]
    o_ref, _ = reference.attention(q, k, v, causal=causal, softmax_scale=0.3)
    np.testing.assert_allclose(cp.unshard([g["o"] for g in got], layout), o_ref, rtol=1e-10,
                               atol=1e-12)
    ref = reference.attention_backward(q, k, v, do, causal=causal, softmax_scale=0.3)
    for name, r in zip(("dq", "dk", "dv"), ref):
        np.testing.assert_allclose(cp.unshard([g[name] for g in got], layout), r, rtol=1e-10,
                                   atol=1e-12, err_msg=name)


def test_attention_takes_torch_tensors_only():
    with pytest.raises(TypeError, match="takes torch tensors"):
        cp.attention(np.zeros((1, 8, 1, 64)), np.zeros((1, 8, 1, 64)), np.zeros((1, 8, 1, 64)))


# -- On GPUs ------------------------------------------------------------------------------------

def _gpu_count():
    try:
        import torch
        return torch.cuda.device_count()
    except ImportError:
        return 0


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_ring_of_one_is_fa2():
    """No process group: a ring of one, which is fa2's own attention, forward and backward."""
    torch = pytest.importorskip("torch")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 512, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    o = cp.attention(q, k, v, causal=True)
    o_ref = variants.attention(q, k, v, variant="fa2", causal=True)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    grads_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or _gpu_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_match_one():
    """torchrun, NCCL, fa2 on two GPUs: O and the gradients against fa2 on one GPU, every layout
    and mask (experiments/context_parallel.py check)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    result = subprocess.run(torchrun + [os.path.join(ROOT, "experiments", "context_parallel.py"),
                                        "check"], cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "all match" in result.stdout, result.stdout[-4000:]



def test_plot_draws_time_and_memory_per_gpu(tmp_path):
    from experiments import context_parallel as experiment
    path = tmp_path / "cp.csv"
    rows = []
    for world in (1, 2):
        for seqlen in (8192, 16384):
            for mask in ("full", "causal-zigzag"):
                rows.append(dict(gpu="H100", world=world, seqlen=seqlen, mask=mask, variant="fa2",
                                 batch=1, heads=16, head_dim=128, ms=seqlen / 1e3 / world,
                                 compute_ms=seqlen / 1e3 / world, comm_ms=0.1, exposed_ms=0.0,
                                 serial_ms=seqlen / 1e3, tflops_per_gpu=300, peak_gb=seqlen / 1e4,
                                 kv_mb_per_step=8, **{"pass": "fwd_bwd"}))
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=experiment.FIELDS)
        w.writeheader()
        w.writerows(rows)
    assert experiment.main(["plot", str(path)]) == 0
    assert (tmp_path / "cp.png").stat().st_size > 10_000
