#!/usr/bin/env python3
"""dmoe.MoELayer with one process per rank under torchrun (engine 'ep', world = W): every rank holds E/W experts and
its own tokens; the results gathered from the ranks must match one rank holding everything.

    torchrun --nproc-per-node 2 tests/python/gpu/multi_rank.py OUT_DIR [--comm auto|nccl|nvshmem]

Ranks may share GPUs (rank r uses GPU LOCAL_RANK % device count): then run them under an MPS daemon started
beforehand (`nvidia-cuda-mps-control -d`; torchrun does not start one, `dmoe launch` does) with `--comm nvshmem`
(NCCL needs a GPU per rank).
Rank 0 writes OUT_DIR/multi_rank.json; the exit code is 1 on a failed check.

Checks, for float32 and bfloat16, two calls with different token counts: y, dx (gathered over ranks) and the experts'
gradients (each rank's share) against world = 1 on rank 0's GPU: f32 within 1e-5 of the largest magnitude (the same
kernels on other row counts), bf16 within 2e-2; the gate's gradient equal on every rank (summed over the ranks by
dmoe's communicator) and within the same tolerance of world = 1's.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import dmoe


def rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--comm", default="auto", choices=["auto", "nccl", "nvshmem"])
    ap.add_argument("--bootstrap", default="env", choices=["env", "pg"],
                    help="env: torchrun's variables and a rendezvous directory; pg: dmoe.init_from_process_group")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(local % gpus)
    dev = torch.device("cuda", local % gpus)
    if gpus < int(os.environ.get("LOCAL_WORLD_SIZE", world)) and args.comm != "nvshmem":
        sys.exit(f"multi_rank.py: {world} ranks share {gpus} GPU(s): run them under MPS with --comm nvshmem")
    dist.init_process_group("gloo")  # to gather results for the comparison; dmoe uses its own communicators
    if args.bootstrap == "pg":  # ... which then start through this group instead of a directory
        os.environ.pop("DMOE_RENDEZVOUS", None)
        dmoe.init_from_process_group()
    h, i, e, k = 512, 768, 8 * world, 2
    results, failed = {}, []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        name = str(dtype).split(".")[-1]
        torch.manual_seed(0)
        full = dmoe.MoELayer(h, i, e, k, engine="cpu")  # the same weights on every rank (same seed)
        layer = dmoe.MoELayer(h, i, e, k, world=world, engine="ep", device=dev, dtype=dtype, comm=args.comm)
        first, held = layer.first_expert, e // world
        with torch.no_grad():
            layer.gate.copy_(full.gate)
            for n in ("w1", "w3", "w2"):
                getattr(layer, n).copy_(getattr(full, n)[first:first + held])
        one = None
        if rank == 0:
            one = dmoe.MoELayer(h, i, e, k, engine="ep", device=dev, dtype=dtype)
            one.load_state_dict({n: p.to(dev, dtype) for n, p in full.state_dict().items()})
        for call, tokens in enumerate((96, 40)):
            g = torch.Generator().manual_seed(10 + call)
            x_all = torch.randn(world * tokens, h, generator=g).to(dtype)
            dy_all = torch.randn(world * tokens, h, generator=g).to(dtype)
            x = x_all[rank * tokens:(rank + 1) * tokens].to(dev).requires_grad_()
            layer.zero_grad()
            y = layer(x)
            (y.float() * dy_all[rank * tokens:(rank + 1) * tokens].to(dev).float()).sum().backward()
            mine = {"y": y.detach().cpu(), "dx": x.grad.cpu(), "gate": layer.gate.grad.cpu(),
                    "w1": layer.w1.grad.cpu(), "w3": layer.w3.grad.cpu(), "w2": layer.w2.grad.cpu()}
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            if rank != 0:
                continue
            xr = x_all.to(dev).requires_grad_()
            one.zero_grad()
            yr = one(xr)
            (yr.float() * dy_all.to(dev).float()).sum().backward()
            errs = {"y": rel(torch.cat([m["y"] for m in gathered]), yr.detach()),
                    "dx": rel(torch.cat([m["dx"] for m in gathered]), xr.grad),
                    "gate": max(rel(m["gate"], one.gate.grad) for m in gathered),
                    "gate_equal_on_ranks": all(torch.equal(m["gate"], gathered[0]["gate"]) for m in gathered)}
            for n in ("w1", "w3", "w2"):
                errs[n] = rel(torch.cat([m[n] for m in gathered]), getattr(one, n).grad)
            ok = errs["gate_equal_on_ranks"] and all(v < tol for kk, v in errs.items() if kk != "gate_equal_on_ranks")
            key = f"{name}_T{tokens}"
            results[key] = {"ok": ok, "tol": tol, "rel_err": errs, "comm": layer._session.comm}
            print(f"[{'PASS' if ok else 'FAIL'}] {key} {json.dumps(results[key])}", flush=True)
            if not ok:
                failed.append(key)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multi_rank.json"), "w") as f:
            json.dump({"world": world, "results": results}, f, indent=1)
    flag = [len(failed)]
    dist.broadcast_object_list(flag, src=0)
    dist.destroy_process_group()
    sys.exit(1 if flag[0] else 0)


if __name__ == "__main__":
    main()
