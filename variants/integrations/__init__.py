"""Adapters from the places attention is called to this codebase's kernels, one small module per
door: `sdpa` (PyTorch's scaled_dot_product_attention flash backend, through torch's registry) and
`transformers` (HuggingFace's attn_implementation). flash_attn's own functions are
variants/flash_attn.py. Each imports its library only when called; none activates on import."""
