"""The FLOP count every speed figure uses (the FlashAttention papers' convention)."""


def attention_flops(batch, heads, seqlen_q, seqlen_k, head_dim, causal=False, mode="fwd"):
    """4 * B * H * N_q * N_k * d for the forward (two matmuls of 2 N_q N_k d each), halved when
    causal; the backward counts 2.5x the forward (five matmuls), fwd_bwd 3.5x."""
    fwd = 4 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        fwd //= 2
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]
