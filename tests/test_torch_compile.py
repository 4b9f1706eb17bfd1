"""torch.compile: variants.attention inside a model compiles with fullgraph=True (the custom
operators of variants/torch_ops.py; a graph break would raise), and the compiled model's loss
and gradients match the same model run eagerly (the autograd.Function path)."""
import copy

import pytest

import variants
from tests.test_graphs import BATCH, SEQLEN, WIDTH, small_model, training_step

# Inductor's own code calls torch.jit APIs that warn as deprecated in torch 2.11 (the suite turns
# warnings into errors).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(variants.REGISTRY))
def test_compiled_training_step_matches_eager(variant):
    torch = pytest.importorskip("torch")
    model = small_model(torch, variant)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    for seed in (1, 2):   # the second step runs the compiled code without tracing
        x = torch.randn(BATCH, SEQLEN, WIDTH, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator("cuda").manual_seed(seed))
        got = training_step(compiled, x).item()
        want = training_step(eager, x).item()
        assert got == pytest.approx(want, rel=1e-3)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=2e-2,
                                       atol=2e-2 * float(q.grad.abs().max()))


@pytest.mark.gpu
def test_compiled_varlen_matches_eager():
    torch = pytest.importorskip("torch")
    lengths = [37, 200, 1]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    total, heads, head_dim = sum(lengths), 4, 64
    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(total, h, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for h in (heads, 2, 2))

    def loss(q, k, v):
        o = variants.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths),
                                      variant="fa2", causal=True, window_size=(64, 0))
        return o.float().pow(2).sum()

    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    got_loss = torch.compile(loss, fullgraph=True, dynamic=False)(q, k, v)
    got = torch.autograd.grad(got_loss, (q, k, v))
    assert got_loss.item() == pytest.approx(loss(q, k, v).item(), rel=1e-3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2,
                                   atol=2e-2 * float(w.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fa2", "fa3"])
def test_compiled_score_terms_match_eager(variant):
    """ALiBi's slopes and learnable sinks through the custom operators (fullgraph): the loss and
    the gradients of q, k, v and the sinks equal the eager autograd.Function's, dense and packed."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator("cuda").manual_seed(0)
    heads, head_dim = 4, 64
    q, k, v = (torch.randn(2, 150, h, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for h in (heads, 2, 2))
    sinks = torch.randn(heads, device="cuda", generator=gen).requires_grad_()
    slopes = torch.rand(2, heads, device="cuda", generator=gen)
    lengths = [37, 113]
    cu = torch.tensor([0, 37, 150], dtype=torch.int32, device="cuda")

    def loss(q, k, v, sinks):
        o = variants.attention(q, k, v, variant=variant, causal=True, alibi_slopes=slopes,
                               sinks=sinks)
        packed = variants.attention_varlen(q.flatten(0, 1)[:150], k.flatten(0, 1)[:150],
                                           v.flatten(0, 1)[:150], cu, cu, max(lengths),
                                           max(lengths), variant=variant, causal=True,
                                           alibi_slopes=slopes, sinks=sinks)
        return o.float().pow(2).sum() + packed.float().pow(2).sum()

    args = (q, k, v, sinks)
    want = torch.autograd.grad(loss(*args), args)
    got_loss = torch.compile(loss, fullgraph=True, dynamic=False)(*args)
    got = torch.autograd.grad(got_loss, args)
    assert got_loss.item() == pytest.approx(loss(*args).item(), rel=1e-3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2,
                                   atol=2e-2 * float(w.abs().max()))


def test_options_travel_as_text():
    """The operators carry options as JSON text (an operator schema takes no dict): tuples come
    back as tuples, and no options as ""."""
    pytest.importorskip("torch")
    from variants import torch_ops
    text = torch_ops.encode_options({"dq_split": (2, 2), "dq": "separate"})
    assert torch_ops._decode_options(text) == (("dq", "separate"), ("dq_split", (2, 2)))
    assert torch_ops.encode_options(None) == torch_ops.encode_options({}) == ""
    assert torch_ops._decode_options("") == ()


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(), dict(leftpad=True, window_size=(40, 0), softcap=30.0)],
                         ids=["plain", "leftpad_window_softcap"])
def test_compiled_decode_step_is_the_decode_kernel(options):
    """flash_numba::decode (what the transformers door calls for a generation step under
    torch.compile) compiles with fullgraph=True and gives the eager decode kernel's bits."""
    torch = pytest.importorskip("torch")
    from variants import decoding, torch_ops
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(3, 1, 8, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(3, 300, 2, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in "kv")
    lengths = torch.full((3,), 300, dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 17, 250], dtype=torch.int32, device="cuda") \
        if options.get("leftpad") else None
    left, right = options.get("window_size", (-1, -1))
    cap = options.get("softcap", 0.0)

    def step(q, k, v):
        return torch_ops.decode(q, k, v, lengths, leftpad, True, None, left, right, cap, 0)

    got_o, got_lse = torch.compile(step, fullgraph=True, dynamic=False)(q, k, v)
    want_o, want_lse = decoding.decode(q, k, v, lengths, cache_leftpad=leftpad, causal=True,
                                       window_size=(left, right), softcap=cap, check=False)
    assert torch.equal(got_o, want_o) and torch.equal(got_lse, want_lse)
    from experiments.measure import checks, reference
    host = [x.float().cpu().numpy() for x in (q, k, v)]
    for b in range(3):   # and both right: sequence b's keys from its padding on, float64
        first = 0 if leftpad is None else int(leftpad[b])
        ref_o, ref_lse = reference.attention(host[0][b:b + 1], host[1][b:b + 1, first:],
                                             host[2][b:b + 1, first:], causal=True,
                                             window_size=(left, right), softcap=cap)
        got = checks.compare(got_o[b:b + 1].float().cpu().numpy(),
                             got_lse[b:b + 1].cpu().numpy(), ref_o, ref_lse, "bfloat16")
        assert got["ok"], f"sequence {b}: " + checks.describe_failure(got)
