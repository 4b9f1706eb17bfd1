"""CUDA graphs: a call launches on the caller's stream with no host synchronisation, no allocation
outside the caller's allocator and no read of device data on the host, so torch.cuda.graphs can
capture it. A training step of a small model with variants.attention in it is captured, replayed
with new inputs, and checked against the same step run eagerly on those inputs."""
import copy

import pytest

import variants
from experiments.measure import timing

pytestmark = pytest.mark.gpu

WIDTH, HEADS, HEAD_DIM, BATCH, SEQLEN = 256, 2, 64, 2, 200


def small_model(torch, variant):
    class Block(torch.nn.Module):
        """x -> Q, K, V (views of one projection: strided, as in real models) -> causal attention
        with `variant` -> output projection."""

        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(WIDTH, 3 * HEADS * HEAD_DIM, bias=False)
            self.out = torch.nn.Linear(HEADS * HEAD_DIM, WIDTH, bias=False)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, HEADS, HEAD_DIM).unbind(2)
            o = variants.attention(q, k, v, variant=variant, causal=True)
            return self.out(o.reshape(b, n, HEADS * HEAD_DIM))

    torch.manual_seed(0)
    return Block().cuda().to(torch.bfloat16)


def training_step(model, x):
    """Gradients of a loss into model's .grad; the loss returned detached, so that no reference
    keeps this step's autograd graph (and its streams) alive into the next."""
    for p in model.parameters():
        p.grad = None
    loss = model(x).float().pow(2).mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("variant", [v for v in variants.REGISTRY if v != "fa3"])
def test_training_step_replays_with_new_inputs(variant):
    torch = pytest.importorskip("torch")
    model = small_model(torch, variant)
    reference = copy.deepcopy(model)   # the eager steps' own parameters and autograd nodes
    x = torch.randn(BATCH, SEQLEN, WIDTH, device="cuda", dtype=torch.bfloat16)
    graph, loss = timing.capture_cuda_graph(lambda: training_step(model, x))
    for seed in (1, 2):
        new = torch.randn(x.shape, device="cuda", dtype=x.dtype,
                          generator=torch.Generator("cuda").manual_seed(seed))
        x.copy_(new)
        graph.replay()
        got_loss, got_grads = loss.item(), [p.grad.clone() for p in model.parameters()]
        want_loss = training_step(reference, new.clone()).item()
        assert got_loss == pytest.approx(want_loss, rel=1e-3)
        for got, p in zip(got_grads, reference.parameters()):
            want = p.grad.float()
            torch.testing.assert_close(got.float(), want, rtol=2e-2,
                                       atol=2e-2 * float(want.abs().max()))


def test_fa3_forward_replays_with_new_inputs(rng):
    """fa3's tensor maps are made per input address: a graph over inputs seen before the capture
    replays, reading whatever they hold at replay."""
    torch = pytest.importorskip("torch")
    from experiments.measure import inputs
    q, k, v = (inputs.to_device(x, "torch") for x in inputs.random_qkv(rng, 2, 300, 2, 128,
                                                                        "bfloat16"))
    graph, (o, lse) = timing.capture_cuda_graph(
        lambda: variants.forward(q, k, v, variant="fa3", causal=True))
    for _ in range(2):
        for x, new in zip((q, k, v), inputs.random_qkv(rng, 2, 300, 2, 128, "bfloat16")):
            x.copy_(inputs.to_device(new, "torch"))
        graph.replay()
        want_o, want_lse = variants.forward(q, k, v, variant="fa3", causal=True)
        assert torch.equal(o, want_o) and torch.equal(lse, want_lse)


def test_fa3_in_a_captured_training_step_says_what_to_do():
    """Q, K, V made inside the graph have addresses fa3 has no tensor maps for: a clear error, not
    a broken capture."""
    torch = pytest.importorskip("torch")
    model = small_model(torch, "fa3")
    x = torch.randn(BATCH, SEQLEN, WIDTH, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="fa3 under CUDA-graph capture"):
        timing.capture_cuda_graph(lambda: training_step(model, x))
