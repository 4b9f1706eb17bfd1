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
    import torch
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
