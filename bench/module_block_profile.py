#!/usr/bin/env python3
"""Where the Mixtral MoE block's forward + backward goes on a GPU: transformers' stock block against dmoe's
(engine ep), the block alone as gpu_check.py's benchmark runs it (x and every parameter requiring grad,
``zero_grad(set_to_none=True)``, ``y.backward(dy)``), bf16, H 4096 I 14336 E 8 k 2, T tokens.

For each: wall time per step (CUDA events around one step, median of 15 after 3 warm-ups, gpu_check's rule), the
GPU kernels' time per step and the top kernels (torch.profiler over 5 steps), and for dmoe the host time of each
engine call (Session.forward / Session.backward, perf_counter around the call; median) with whether torch's stream
still had work queued when the call began and when it returned: a call that begins with work queued and returns
with none waited for the GPU, so the GPU then idles while the host queues what follows.
A diagnostic for docs/perf.md (sixteenth session), not a benchmark of record.

    PYTHONPATH=build/python python3 bench/module_block_profile.py [--tokens 1,512,4096]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import dmoe
import dmoe.module

H, I, E, K = 4096, 14336, 8, 2


class CallClock:
    """Wraps a Session's forward/backward (by patching _MoEFunction's session lookup) and records host times."""

    def __init__(self):
        self.rows = {"forward": [], "backward": []}
        self.on = False

    def wrap(self, session):
        """The session behind a timing proxy (one per session: made once, not at every call)."""
        if getattr(self, "_wrapped", (None,))[0] is session:
            return self._wrapped[1]
        clock = self

        class Timed:
            def __getattr__(self, name):
                attr = getattr(session, name)
                if name not in ("forward", "backward") or not clock.on:
                    return attr

                def call(*a, **kw):
                    stream = torch.cuda.current_stream()
                    busy_before = not stream.query()
                    t0 = time.perf_counter()
                    out = attr(*a, **kw)
                    t1 = time.perf_counter()
                    clock.rows[name].append(((t1 - t0) * 1e6, busy_before, not stream.query()))
                    return out

                return call

        self._wrapped = (session, Timed())
        return self._wrapped[1]

    def summary(self):
        out = {}
        for name, rows in self.rows.items():
            if rows:
                out[name] = {"host_us_median": round(statistics.median(r[0] for r in rows), 1),
                             "queued_at_entry": sum(r[1] for r in rows) / len(rows),
                             "queued_at_return": sum(r[2] for r in rows) / len(rows), "calls": len(rows)}
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,512,4096")
    ap.add_argument("--trace", help="write each profiled run's Chrome trace (torch.profiler) into this directory")
    ap.add_argument("--only", help="profile only this block (stock or dmoe)")
    args = ap.parse_args()
    import transformers

    # A one-layer model, as gpu_check.py builds it: its weights initialised by transformers and its block running
    # transformers' default experts implementation (a standalone block has neither).
    cfg = transformers.MixtralConfig(vocab_size=32000, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
                                     num_attention_heads=32, num_key_value_heads=8, num_local_experts=E,
                                     num_experts_per_tok=K, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).to("cuda", torch.bfloat16)
    import copy

    mine = copy.deepcopy(model)
    dmoe.hf.replace_moe_blocks(mine, engine="ep")
    stock = model.model.layers[0].mlp
    mine = mine.model.layers[0]
    blocks = {"stock": stock, "dmoe": mine.mlp}
    clock = CallClock()
    layer = mine.mlp.moe
    original = layer._session_for

    def session_for(x):
        return clock.wrap(original(x))

    layer._session_for = session_for
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(1, tokens, H, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        for name, blk in blocks.items():
            if args.only and name != args.only:
                continue
            blk.train()
            xg = x.clone().requires_grad_(True)

            def step():
                blk.zero_grad(set_to_none=True)
                xg.grad = None
                y = blk(xg)
                (y[0] if isinstance(y, tuple) else y).backward(dy)

            for _ in range(3):
                step()
            torch.cuda.synchronize()
            times = []
            clock.on = name == "dmoe"
            for _ in range(15):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                step()
                e.record()
                e.synchronize()
                times.append(s.elapsed_time(e))
            clock.on = False
            calls = clock.summary()
            clock.rows = {"forward": [], "backward": []}
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            if args.trace:
                os.makedirs(args.trace, exist_ok=True)
                prof.export_chrome_trace(f"{args.trace}/block_{name}_T{tokens}.json")
            ka = prof.key_averages()
            dev = [k for k in ka if k.self_device_time_total > 0]
            gpu = sum(k.self_device_time_total for k in dev) / 5 / 1000
            print(f"== T={tokens} {name} block fwd+bwd: wall {statistics.median(times):.3f} ms/step (min "
                  f"{min(times):.3f}), GPU kernel time {gpu:.3f} ms/step")
            if calls:
                print(f"   engine calls: {json.dumps(calls)}")
            for k in sorted(dev, key=lambda k: -k.self_device_time_total)[:16]:
                print(f"   {k.self_device_time_total / 5 / 1000:8.3f} ms  x{k.count / 5:5.1f}  {k.key[:120]}")
            host = sorted([k for k in ka if k.self_cpu_time_total > 0], key=lambda k: -k.self_cpu_time_total)[:8]
            for k in host:
                print(f"   {k.self_cpu_time_total / 5 / 1000:8.3f} ms host  x{k.count / 5:5.1f}  {k.key[:110]}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
