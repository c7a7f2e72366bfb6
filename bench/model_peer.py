#!/usr/bin/env python3
"""The PyTorch peer of `dmoe bench model`: transformers' MixtralForCausalLM built from the same config.json, bf16
parameters, its default attention (sdpa) and MoE implementation, torch.optim.AdamW(fused=True), the gradient
clipped to norm 1 as dmoe's step does; random tokens [batch, seq] with labels = tokens (output_router_logits as the
config says). Times whole training steps with CUDA events (warm-up, then the median of the timed steps).

    bench/model_peer.py --config bench/models/deepseek-v2-s.json [--batch 8 --seq 1024] [--json out.json]
"""
import argparse
import json
import statistics
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="HF Mixtral config.json (bench/models/NAME.json)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    import torch
    import transformers

    if not torch.cuda.is_available():
        sys.exit("model_peer.py needs a CUDA GPU")
    with open(args.config) as f:
        cfg = transformers.MixtralConfig.from_dict(json.load(f))
    torch.manual_seed(0)
    # Built on the GPU in bf16 (a 6.6e9-parameter model's random init on the CPU in f32 takes minutes).
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = transformers.MixtralForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.to("cuda", torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids, output_router_logits=cfg.output_router_logits)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return out.loss

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    res = {"config": args.config, "batch": args.batch, "seq": args.seq, "torch": torch.__version__,
           "transformers": transformers.__version__, "attn_implementation": model.config._attn_implementation,
           "parameters": sum(p.numel() for p in model.parameters()), "step_median_ms": statistics.median(times),
           "step_min_ms": min(times), "step_max_ms": max(times), "repeats": args.repeat,
           "peak_memory_bytes": torch.cuda.max_memory_allocated(), "last_loss": float(loss)}
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
