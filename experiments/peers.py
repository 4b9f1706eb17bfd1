"""The peers every run is measured against: torch SDPA's backends on the same tensors.

sdpa_flash is the FlashAttention-2 CUDA kernels, sdpa_cudnn cuDNN's fused attention, sdpa_math
PyTorch's unfused "standard attention", sdpa_efficient xFormers' memory-efficient kernel. torch is
optional: without it (or without a GPU) there are no peers.
"""
BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_math": "MATH",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}


def available():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def forward_fn(name, causal, softmax_scale, gqa):
    """fn(q, k, v) -> o for torch tensors in flash_attn_func's (B, N, H, d) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    backend = getattr(SDPBackend, BACKENDS[name])
    extra = {"enable_gqa": True} if gqa else {}

    def fn(q, k, v):
        with sdpa_kernel(backend):
            o = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                     scale=softmax_scale, **extra)
        return o.transpose(1, 2)

    return fn


def is_out_of_memory(exc):
    import torch
    return isinstance(exc, torch.OutOfMemoryError)


def pass_fn(pass_, forward, sets):
    """fn(i) -> (o, None, grads) timing one pass of a peer on input set i (see run.pass_fn): the
    backward is torch.autograd.grad of O with dO; for pass bwd the forward's graph is built once
    per set beforehand and kept (retain_graph), so only the backward is timed."""
    import torch

    from experiments.measure.timing import PerInputSet

    leaves = [tuple(x.detach().requires_grad_() for x in s[:3]) + (s[3],) if len(s) > 3 else s
              for s in sets]
    graphs = PerInputSet(len(leaves), lambda j: forward(*leaves[j][:3]))

    def fn(i):
        q, k, v, *rest = leaves[i % len(leaves)]
        if pass_ == "fwd":
            with torch.no_grad():
                return forward(q, k, v), None, None
        if pass_ == "bwd":
            o = graphs[i]
            return o, None, torch.autograd.grad(o, (q, k, v), rest[0], retain_graph=True)
        o = forward(q, k, v)
        return o, None, torch.autograd.grad(o, (q, k, v), rest[0])

    fn.prime = graphs.prime   # bwd: every set's forward graph now, outside any timing
    return fn
