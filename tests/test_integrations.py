"""The doors attention is called through, against the real libraries on a GPU (skipped where
torch or transformers is absent, as on CI): SDPA's flash backend (variants/integrations/sdpa.py)
forward and backward against float64, under torch.compile too; transformers' attn_implementation
(variants/integrations/transformers.py) on small random-initialised Llama (GQA), Mistral
(sliding window) and Gemma 2 (softcap and window) models built from configs: logits against
SDPA's with left and right padding and packed sequences, training losses, and greedy generation
with dynamic and static caches teacher-forced against SDPA."""
import numpy as np
import pytest

from experiments.measure import checks, inputs, reference

# Inductor and transformers warn about their own deprecations (the suite turns warnings into errors)
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def sdpa_active(torch, monkeypatch):
    """Our implementation active as SDPA's flash backend for one test; the kernel calls it made."""
    import torch.nn.attention as attention
    if not hasattr(attention, "activate_flash_attention_impl"):
        pytest.skip("torch without the flash-attention registry")
    from variants import registry
    from variants.integrations import sdpa
    calls = []
    for name in ("forward", "backward"):
        real = getattr(registry, name)
        monkeypatch.setattr(registry, name,
                            lambda *a, _real=real, _name=name, **kw: (calls.append(_name),
                                                                      _real(*a, **kw))[1])
    sdpa.activate()
    yield calls
    attention.restore_flash_attention_impl() if hasattr(attention, "restore_flash_attention_impl") \
        else None


def _sdpa(torch, q, k, v, **kw):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


# (torch's SDPA sends no causal call with N_q != N_k to its flash backend: that case is covered
# by flash_attn_func's tests)
@pytest.mark.parametrize("n_q, n_k, causal, head_dim", [(256, 256, True, 128), (128, 384, False, 64),
                                                        (200, 200, False, 72)])
def test_sdpa_flash_backend_forward_and_backward(torch, sdpa_active, rng, n_q, n_k, causal,
                                                 head_dim):
    """F.scaled_dot_product_attention with the flash backend runs our kernels (is_causal
    top-left, as SDPA defines it), and its gradients are ours."""
    q, k, v = inputs.random_qkv(rng, 2, n_q, 4, head_dim, DTYPE, seqlen_k=n_k)
    tq, tk, tv = (inputs.to_device(x, "torch").transpose(1, 2).requires_grad_() for x in (q, k, v))
    out = _sdpa(torch, tq, tk, tv, is_causal=causal)
    do = rng.standard_normal((2, n_q, 4, head_dim)).astype(q.dtype)
    out.backward(inputs.to_device(do, "torch").transpose(1, 2))
    assert sdpa_active.count("forward") == 1 and sdpa_active.count("backward") == 1
    mask = dict(causal=causal)   # square when causal: either diagonal
    ref_o, _ = reference.attention(q, k, v, **mask)
    got = inputs.to_host(out.transpose(1, 2))
    assert checks.compare(got, np.zeros((2, 4, n_q)), ref_o, np.zeros((2, 4, n_q)), DTYPE)["ok"]
    ref = reference.attention_backward(q, k, v, do, **mask)
    grads = [inputs.to_host(t.grad.transpose(1, 2)) for t in (tq, tk, tv)]
    assert checks.compare_gradients(grads, ref, DTYPE)["ok"]


def test_sdpa_flash_backend_lower_right_and_contiguous_inputs(torch, sdpa_active, rng):
    """torch's CausalBias sends a rectangular lower-right causal mask to the flash operator as
    is_causal=True: the bottom-right diagonal. Inputs (B, H, N, d)-contiguous (not transposed
    views) come back with the strides torch's meta function promises; GQA through enable_gqa is
    torch's to route, so the K/V heads here equal the query heads."""
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = inputs.random_qkv(rng, 2, 96, 4, 64, DTYPE, seqlen_k=256)
    tq, tk, tv = (inputs.to_device(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), "torch")
                  for x in (q, k, v))
    out = _sdpa(torch, tq, tk, tv, attn_mask=causal_lower_right(96, 256))
    assert out.stride() == torch.empty_like(tq).stride() and "forward" in sdpa_active
    ref_o, _ = reference.attention(q, k, v, causal=True)      # bottom-right
    got = inputs.to_host(out.transpose(1, 2))
    assert checks.compare(got, np.zeros((2, 4, 96)), ref_o, np.zeros((2, 4, 96)), DTYPE)["ok"]


def test_sdpa_flash_backend_under_torch_compile(torch, sdpa_active, rng):
    q, k, v = inputs.random_qkv(rng, 2, 256, 4, 64, DTYPE)
    tq, tk, tv = (inputs.to_device(x, "torch").transpose(1, 2) for x in (q, k, v))
    f = torch.compile(lambda a, b, c: _sdpa(torch, a, b, c, is_causal=True), fullgraph=True)
    got = inputs.to_host(f(tq, tk, tv).transpose(1, 2))
    assert "forward" in sdpa_active
    ref_o, _ = reference.attention(q, k, v, causal=True)
    assert checks.compare(got, np.zeros((2, 4, 256)), ref_o, np.zeros((2, 4, 256)), DTYPE)["ok"]


# --------------------------------------------------------------------------- transformers
MODELS = {
    "llama": ("LlamaConfig", dict()),
    "mistral": ("MistralConfig", dict(sliding_window=48)),
    "gemma2": ("Gemma2Config", dict(sliding_window=48, attn_logit_softcapping=50.0,
                                    query_pre_attn_scalar=64)),
    # attention sinks (s_aux: the kernels' learnable sinks), sliding and full layers, MoE
    "gpt_oss": ("GptOssConfig", dict(sliding_window=48, num_local_experts=4,
                                     num_experts_per_tok=2)),
}
BASELINE = {"gpt_oss": "eager"}   # what the logits are checked against (else SDPA)


def _model(torch, family, attn, dtype):
    transformers = pytest.importorskip("transformers")
    from variants.integrations import transformers as fa_transformers
    fa_transformers.register()
    cls, extra = MODELS[family]
    config = getattr(transformers, cls)(vocab_size=512, hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=64,
                                        max_position_embeddings=512, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=fa_transformers.NAME if attn == "ours" else attn,
        dtype=dtype)
    return model.cuda().eval()


def _pair(torch, family, dtype=None):
    """Our model and SDPA's (BASELINE's), with the same weights."""
    dtype = dtype or torch.float32
    ours = _model(torch, family, "ours", dtype)
    sdpa = _model(torch, family, BASELINE.get(family, "sdpa"), dtype)
    sdpa.load_state_dict(ours.state_dict())
    return ours, sdpa


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_transformers_logits_match_sdpa(torch, family, padding):
    """An fp32 model's logits (attention in bf16 inside) against SDPA's fp32 logits, at every
    unpadded position, within twice the error of the whole model run by SDPA in bf16."""
    ours, sdpa = _pair(torch, family)
    ids = torch.randint(0, 512, (3, 160), device="cuda")
    mask = torch.ones_like(ids)
    if padding == "left":
        mask[0, :37], mask[2, :100] = 0, 0
    elif padding == "right":
        mask[1, 120:], mask[2, 3:] = 0, 0
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = sdpa(ids, attention_mask=mask).logits
        bf16 = sdpa.to(torch.bfloat16)(ids, attention_mask=mask).logits.float()
    keep = mask.bool()
    assert _rel(got[keep], want[keep]) <= 2 * _rel(bf16[keep], want[keep])


def test_transformers_packed_sequences(torch):
    """Three sequences packed in one row (position_ids restarting at 0) attend within
    themselves: the logits each has alone."""
    ours, _ = _pair(torch, "llama")
    lengths = [50, 7, 90]
    ids = torch.randint(0, 512, (1, sum(lengths)), device="cuda")
    position_ids = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    with torch.no_grad():
        packed = ours(ids, position_ids=position_ids).logits[0]
        alone = torch.cat([ours(part[None]).logits[0]
                           for part in ids[0].split(lengths)])
    assert _rel(packed, alone) < 1e-2


def test_transformers_training_losses_follow_sdpa(torch):
    """Ten AdamW steps on the same batches: the losses of our model and SDPA's agree."""
    ours, sdpa = _pair(torch, "mistral")
    losses = []
    for model in (ours, sdpa):
        model.train()
        torch.manual_seed(1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = []
        for _ in range(10):
            ids = torch.randint(0, 512, (4, 128), device="cuda")
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(np.array(run))
    assert np.abs(losses[0] - losses[1]).max() < 2e-2 * losses[1].max(), losses


def test_transformers_attention_dropout_trains(torch):
    """config.attention_dropout in training runs the kernels' dropout: the training loss differs
    from eval's, torch.manual_seed replays it exactly, and it takes a gradient; eval is the
    model without dropout (the logits of a model built with attention_dropout=0)."""
    ours, _ = _pair(torch, "llama")
    ours.config.attention_dropout = 0.3
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.3
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    with torch.no_grad():
        eval_loss = ours(ids, labels=ids).loss.item()
    ours.train()
    torch.manual_seed(5)
    loss = ours(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in ours.parameters() if p.requires_grad)
    torch.manual_seed(5)
    with torch.no_grad():
        again = ours(ids, labels=ids).loss.item()
    assert again == loss.item() and abs(loss.item() - eval_loss) > 1e-4, (loss, again, eval_loss)


@pytest.mark.parametrize("padded", [True, False], ids=["left_padded", "unpadded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_transformers_generation_teacher_forced(torch, family, cache, padded, monkeypatch):
    """Greedy generation of 12 tokens through our kernels (a left-padded prompt through the
    packed kernels, then a step at a time through the decode kernel, the padding as its
    cache_leftpad; Gemma 2's window and softcap in it): each step's logits against SDPA's logits
    of the same sequence read at once (teacher-forced). With a dynamic cache (not compiled) the
    steps must have taken the decode kernel, with the left padding and Gemma 2's softcap."""
    from variants import decoding
    steps = []
    plain = decoding.decode

    def spy(*args, **kw):
        steps.append(kw)
        return plain(*args, **kw)
    monkeypatch.setattr(decoding, "decode", spy)
    ours, sdpa = _pair(torch, family)
    ids = torch.randint(0, 512, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :11] = 0
    with torch.no_grad():
        out = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                            cache_implementation=cache, output_logits=True,
                            return_dict_in_generate=True, pad_token_id=0)
        full_mask = torch.cat([mask, torch.ones_like(out.sequences[:, 40:])], 1)
        want = sdpa(out.sequences, attention_mask=full_mask).logits[:, 39:-1]
        bf16 = sdpa.to(torch.bfloat16)(out.sequences, attention_mask=full_mask).logits[:, 39:-1]
    got = torch.stack(out.logits, 1)
    assert _rel(got, want) <= 2 * _rel(bf16.float(), want) + 1e-3
    if cache == "dynamic":
        assert len(steps) >= 11 * ours.config.num_hidden_layers, len(steps)
        assert all((kw["cache_leftpad"] is not None) == padded for kw in steps)
        if family == "gemma2":   # Gemma 2's cap on every step (its sliding layers' caches keep
            assert all(kw["softcap"] == 50.0 for kw in steps)   # at most the window's keys)


def test_declared_cu_seqlens_are_not_read_back(torch, monkeypatch):
    """cu_seqlens declared with problem.known_seqlens (as the transformers door declares the ones
    it builds from a mask) are checked from the declared values, with no read-back; once the
    tensor is written in place (its version moves) they are read back again."""
    from common.host import problem
    from variants import flash_attn
    rng = np.random.default_rng(0)
    starts = np.array([0, 30, 31, 80], np.int64)
    q, k, v = (torch.from_numpy(x[0]).cuda() for x in
               inputs.random_qkv(rng, 1, 80, 4, 64, "float16", heads_kv=2))
    cu = problem.known_seqlens(torch.as_tensor(starts, dtype=torch.int32, device="cuda"), starts)
    reads = []
    real = problem.arrays.to_host
    monkeypatch.setattr(problem.arrays, "to_host", lambda x: (reads.append(x), real(x))[1])
    out = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 49, 49, causal=True)
    assert not any(x is cu for x in reads)
    cu.add_(0)                      # an in-place write: the declaration no longer holds
    again = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 49, 49, causal=True)
    assert any(x is cu for x in reads) and torch.equal(out, again)
    for b in range(3):
        lo, hi = starts[b], starts[b + 1]
        ref, _ = reference.attention(q[None, lo:hi].cpu().numpy(), k[None, lo:hi].cpu().numpy(),
                                     v[None, lo:hi].cpu().numpy(), causal=True)
        got = out[lo:hi].float().cpu().numpy()
        assert np.abs(got - ref[0]).max() < 2e-2, b
