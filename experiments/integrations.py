"""A model through the doors (transformers' attn_implementation, torch.compile) against SDPA:
training step time and generate() tokens/s, on one GPU, in one process.

    python experiments/integrations.py [--layers 8] [--quick]

A random-initialised Llama (GQA 16/4 heads of 128, hidden 2048) built from its config, bf16:
- train: forward + backward + AdamW step, batch 4 x 2048 tokens, ours eager, SDPA eager, ours
  under torch.compile(fullgraph=True) and SDPA under it; median of timed steps after warm-up;
- generate: greedy, prompt 500, 32 new tokens, batch 1 and 8, with a dynamic cache, a static
  cache and (batch 8) a left-padded batch; tokens/s of the new tokens, wall clock (generate is
  host-bound at small batch), median of three.
Prints one table; the last column is ours / SDPA (time: lower is better; tokens/s: higher)."""
import argparse
import statistics
import sys
import time


def model_pair(torch, transformers, layers, attn):
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                      num_hidden_layers=layers, num_attention_heads=16,
                                      num_key_value_heads=4, head_dim=128,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=attn, dtype=torch.bfloat16).cuda()


def timed(torch, fn, reps):
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def train_step_time(torch, model, compiled, reps):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, 32000, (4, 2048), device="cuda")
    step_model = torch.compile(model, fullgraph=True) if compiled else model

    def step():
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):   # compile / autotune / first-call work outside the timing
        step()
    return timed(torch, step, reps)


def tokens_per_s(torch, model, batch, cache, padded, new=32, prompt=500):
    ids = torch.randint(0, 32000, (batch, prompt), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        for b in range(batch):
            mask[b, : (b * 37) % 200] = 0

    def run():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, cache_implementation=cache, pad_token_id=0)

    return batch * new / timed(torch, run, 3)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="one timed repeat, no compiled rows")
    parser.add_argument("--caches", default="dynamic,static", help="generate()'s caches to time")
    args = parser.parse_args(argv)
    import torch
    import transformers

    from variants.integrations import transformers as fa_transformers
    name = fa_transformers.register()
    rows = []
    models = {attn: model_pair(torch, transformers, args.layers, attn) for attn in (name, "sdpa")}
    reps = 1 if args.quick else 5
    for compiled in ((False,) if args.quick else (False, True)):
        t = {attn: train_step_time(torch, m, compiled, reps) for attn, m in models.items()}
        rows.append((f"train step{' compiled' if compiled else ''} (ms)", t[name] * 1e3,
                     t["sdpa"] * 1e3, t[name] / t["sdpa"]))
    for m in models.values():
        m.eval()
    with torch.no_grad():
        for batch, cache, padded in ((1, "dynamic", False), (1, "static", False),
                                     (8, "dynamic", False), (8, "static", False),
                                     (8, "dynamic", True)):
            if cache not in args.caches.split(","):
                continue
            r = {attn: tokens_per_s(torch, m, batch, cache, padded) for attn, m in models.items()}
            label = f"generate b={batch} {cache}{' left-padded' if padded else ''} (tok/s)"
            rows.append((label, r[name], r["sdpa"], r[name] / r["sdpa"]))
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
          f"{transformers.__version__}, {args.layers} layers")
    print(f"{'what':46s} {'ours':>10s} {'sdpa':>10s} {'ours/sdpa':>10s}")
    for label, a, b, ratio in rows:
        print(f"{label:46s} {a:10.1f} {b:10.1f} {ratio:10.3f}")


if __name__ == "__main__":
    sys.path.insert(0, ".")
    main()
