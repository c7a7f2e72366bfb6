#!/usr/bin/env python3
"""Where a one-layer Mixtral training step goes on a GPU: transformers' stock MoE block against dmoe's (engines ep and
flash), T = 512 and 4096 tokens. For each: wall time per step (CUDA events, 5 steps after 3 warm-ups), the GPU
kernels' time per step (torch.profiler over 5 more steps), the host synchronisations and copies per step, the
top kernels, and the host thread's top entries by self CPU time. Wall well above the kernels' time means the step is host-bound (the GPU idles between launches).
Not a benchmark of record (gpu_check.py's is); a diagnostic, docs/perf.md (thirteenth session).

    PYTHONPATH=build/python python3 bench/module_step_profile.py [--tokens 512,4096] [--models stock,dmoe,flash]
"""
import argparse, copy, sys, json, torch, transformers, dmoe
from torch.profiler import profile, ProfilerActivity
def build(tokens, names):
    cfg = transformers.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=max(tokens, 4096))
    torch.manual_seed(0)
    stock = transformers.MixtralForCausalLM(cfg).to("cuda", torch.bfloat16)
    models = {"stock": stock}
    for name, engine in (("dmoe", "ep"), ("flash", "flash")):
        if name in names:
            models[name] = copy.deepcopy(stock)
            dmoe.hf.replace_moe_blocks(models[name], engine=engine)
    return {n: m for n, m in models.items() if n in names}
ap = argparse.ArgumentParser()
ap.add_argument("--tokens", default="512,4096")
ap.add_argument("--models", default="stock,dmoe,flash")
args = ap.parse_args()
for tokens in (int(t) for t in args.tokens.split(",")):
    models = build(tokens, args.models.split(","))
    ids = torch.randint(0, 32000, (1, tokens), device="cuda")
    for name, m in models.items():
        m.train()
        def step():
            m.zero_grad(set_to_none=True)
            m(ids, labels=ids).loss.backward()
        for _ in range(3): step()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5): step()
        e.record(); e.synchronize()
        wall = s.elapsed_time(e) / 5
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5): step()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        gpu = sum(k.self_device_time_total for k in ka if k.device_type == torch.autograd.DeviceType.CUDA) / 5 / 1000
        syncs = {k.key: k.count / 5 for k in ka if ("Synchronize" in k.key or "Memcpy" in k.key and "cuda" in k.key.lower())}
        print(f"== T={tokens} {name}: wall {wall:.3f} ms/step, GPU kernel time {gpu:.3f} ms/step, syncs/memcpy per step {json.dumps(syncs)}")
        launches = {k.key: k.count / 5 for k in ka if k.key in ("cudaLaunchKernel", "cuLaunchKernelEx",
                                                                   "cudaLaunchKernelExC", "cudaMemsetAsync")}
        print(f"   host launches per step {json.dumps(launches)}")
        rows = sorted([k for k in ka if k.self_device_time_total > 0], key=lambda k: -k.self_device_time_total)[:14]
        for k in rows:
            print(f"   {k.self_device_time_total/5/1000:8.3f} ms  x{k.count/5:5.1f}  {k.key[:110]}")
        # Host side: where the issuing thread's time goes (self CPU time per step: CUDA API calls, aten ops, the
        # autograd functions' Python bodies); a host-bound step shows its cause here.
        host = sorted([k for k in ka if k.self_cpu_time_total > 0], key=lambda k: -k.self_cpu_time_total)[:12]
        print(f"   host: {sum(k.self_cpu_time_total for k in ka) / 5 / 1000:.3f} ms self CPU time per step; top:")
        for k in host:
            print(f"   {k.self_cpu_time_total/5/1000:8.3f} ms host  x{k.count/5:5.1f}  {k.key[:110]}")
        sys.stdout.flush()
    del models; torch.cuda.empty_cache()
