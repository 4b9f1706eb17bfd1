"""A training step of a small GPT with a variant's attention in place of SDPA's: step time and loss
curve, the two models from the same initial weights on the same batches.

    python experiments/gpt_step.py [--variants fa2,fa3] [--steps 30] [--batch 8] [--seqlen 1024]
                                   [--graph | --compile MODE]

The model (issue: host overhead): 4 pre-LayerNorm blocks of d_model 512, 8 causal heads of 64,
an MLP of 4 x d_model, vocabulary 8192, next-token cross-entropy, AdamW, bf16 autocast. Q, K, V
are strided views of one projection, as in real models. Attention is `variants.attention(q, k, v,
variant=..., causal=True)` or SDPA's FlashAttention-2 backend (`sdpa_flash`). Step time: the
median over `--repeats` runs of `--steps` steps (wall clock from a synchronize to a synchronize,
after `--warmup` steps), the models taking turns so that clocks and other drift hit both alike.
Loss curves: the first `--steps` losses of each model from the same start, and their largest
difference from SDPA's (bf16 rounding lets them drift apart slowly; a wrong gradient does not
stay close). `--graph` times each model's whole training step (forward, backward, AdamW)
captured once in a CUDA graph and replayed on each batch: what is left without any host time.
`--compile MODE` runs every model through torch.compile(mode=MODE, fullgraph=True) (MODE
"default", or "reduce-overhead" to replay the compiled model from CUDA graphs): the variants enter
the graph as custom operators (variants/torch_ops.py), and the model's backward is one autograd
node instead of one Python node a layer.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402

common.select_backend()


def make_model(torch, attention, *, layers, width, heads, vocab, seqlen):
    """A GPT whose blocks call attention(q, k, v) on (B, N, H, d) views."""
    nn = torch.nn
    head_dim = width // heads

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                     nn.Linear(4 * width, width))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, heads, head_dim).unbind(2)
            x = x + self.proj(attention(q, k, v).reshape(b, n, width))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.position = nn.Parameter(torch.zeros(1, seqlen, width))
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens) + self.position[:, :tokens.shape[1]]
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln(x))

    return GPT()


def attention_fn(name):
    """attention(q, k, v) -> o, causal, for a variant name or `sdpa_flash` (SDPA on the (B, N, H, d)
    tensors transposed to its layout and back; its backend is chosen once, by `main`)."""
    if name.startswith("sdpa"):
        from torch.nn.functional import scaled_dot_product_attention as sdpa
        return lambda q, k, v: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    is_causal=True).transpose(1, 2)
    import variants
    return lambda q, k, v: variants.attention(q, k, v, variant=name, causal=True)


def main(argv=None):
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--variants", default="fa2")
    a.add_argument("--peer", default="sdpa_flash")
    a.add_argument("--steps", type=int, default=30)
    a.add_argument("--warmup", type=int, default=10)
    a.add_argument("--repeats", type=int, default=5)
    a.add_argument("--batch", type=int, default=8)
    a.add_argument("--seqlen", type=int, default=1024)
    a.add_argument("--layers", type=int, default=4)
    a.add_argument("--width", type=int, default=512)
    a.add_argument("--heads", type=int, default=8)
    a.add_argument("--vocab", type=int, default=8192)
    a.add_argument("--graph", action="store_true", help="time steps replayed from a CUDA graph")
    a.add_argument("--compile", metavar="MODE", default=None,
                   help="torch.compile every model with this mode (default, reduce-overhead)")
    args = a.parse_args(argv)
    if args.graph and args.compile:
        a.error("--graph captures the eager step; use one of --graph and --compile")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from experiments import peers
    # The peer's backend chosen once for the run, as a model does (until 2026-11-27 it was entered
    # around every attention call, ~20 us of host time each: about 1% of the peer's eager step).
    with sdpa_kernel(getattr(SDPBackend, peers.BACKENDS[args.peer])):
        _measure(args)


def _measure(args):
    import torch

    from common.hardware import target

    names = [args.peer] + args.variants.split(",")
    shape = dict(layers=args.layers, width=args.width, heads=args.heads, vocab=args.vocab,
                 seqlen=args.seqlen)
    runs = {}
    for name in names:
        torch.manual_seed(0)   # the same initial weights for every model
        model = make_model(torch, attention_fn(name), **shape).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True, capturable=args.graph)
        if args.compile:
            model = torch.compile(model, mode=args.compile, fullgraph=True)
        runs[name] = (model, opt)
    data = torch.Generator("cuda").manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seqlen + 1), device="cuda",
                             generator=data) for _ in range(args.steps)]

    def step(name, tokens):
        model, opt = runs[name]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):   # graph-safe
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        return loss.detach()

    # Loss curves from the common start, on the same batches.
    curves = {name: torch.stack([step(name, t) for t in batches]).tolist() for name in names}
    # Step time (the models keep training; the values no longer matter).
    if args.graph:
        from experiments.measure.timing import capture_cuda_graph
        static = batches[0].clone()
        graphs = {name: capture_cuda_graph(lambda n=name: step(n, static), warmup=3)[0]
                  for name in names}

        def timed(name, tokens):
            static.copy_(tokens)
            graphs[name].replay()
    else:
        timed = step
    times = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            for t in batches[:args.warmup]:
                timed(name, t)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for t in batches:
                timed(name, t)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / len(batches) * 1e3)

    peer = statistics.median(times[args.peer])
    print(f"# {target.describe()}, torch {torch.__version__}; GPT {args.layers} x d_model "
          f"{args.width}, {args.heads} heads of {args.width // args.heads}, batch {args.batch}, "
          f"seqlen {args.seqlen}, bf16 autocast, AdamW; median of {args.repeats} x {args.steps} "
          f"steps" + (f"; torch.compile(mode={args.compile!r})" if args.compile else "")
          + ("; CUDA graph replay" if args.graph else ""))
    print(f"{'attention':12s} {'ms/step':>8s} {'vs peer':>8s} {'loss@1':>8s} "
          f"{'loss@' + str(args.steps):>9s} {'max |dloss|':>12s}")
    for name in names:
        ms = statistics.median(times[name])
        diff = max(abs(x - y) for x, y in zip(curves[name], curves[args.peer]))
        print(f"{name:12s} {ms:8.2f} {ms / peer:8.3f} {curves[name][0]:8.4f} "
              f"{curves[name][-1]:9.4f} {diff:12.2e}")


if __name__ == "__main__":
    main()
