"""Experiment: is the ring at a given size waiting for its host?
(docs/PERF_NOTES.md, "The host and the benchmark's timing")

    torchrun --standalone --nproc_per_node=2 docs/experiments/host_overhead.py 8192 label

Per transport, 10 back-to-back fwd+bwd calls of `ring_flash_attn_func` (cross-rank check on),
GPU ms per call (median of 5 runs, slowest rank) timed five ways: `cold`, the start event
recorded on an idle GPU; `primed` / `primed3`, behind one / three untimed calls (bench_ring's
`time_collective` uses three); `prefilled`, the GPU asleep (~75 ms, `torch.cuda._sleep`, private)
while the host queues every call, so no launch is ever late; `busy`, the same with the GPU
multiplying matrices (~50 ms) instead of asleep, so the calls do not start on a cool GPU. And
the host's ms per call. If `cold` is well above `prefilled`, the GPU waits for launches; if
`busy` is well above `prefilled`, part of that is the clocks. Run it from the tree under test.
"""
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ringflash import nccl_options, ring_flash_attn_func

MODES = ("cold", "primed", "primed3", "prefilled", "busy")


def timed(fn, mode: str, iters: int = 10) -> tuple[float, float]:
    """(GPU ms, host ms) per call of `fn` over `iters` calls, started as `mode` says."""
    torch.cuda.synchronize()
    dist.barrier()
    if mode == "prefilled":
        torch.cuda._sleep(int(1.5e8))
    if mode == "busy":
        a = torch.randn(8192, 8192, device=torch.cuda.current_device(), dtype=torch.bfloat16)
        for _ in range(40):  # ~1.4 ms each on an H200
            a @ a
    for _ in range({"primed": 1, "primed3": 3}.get(mode, 0)):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / iters
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters, host


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", pg_options=nccl_options())
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    n, label = int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else ""
    q, k, v = (torch.randn(1, n, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    for transport in ("copy-engine", "nccl"):
        def fn(transport=transport):
            o = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", transport=transport)
            torch.autograd.grad(o, (q, k, v), do)

        for _ in range(3):
            fn()
        row = []
        for mode in MODES:
            runs = [timed(fn, mode) for _ in range(5)]
            row.append((statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)))
        rows = [None] * world
        dist.all_gather_object(rows, row)
        if rank == 0:
            gpu = [max(r[i][0] for r in rows) for i in range(len(MODES))]
            host = max(r[0][1] for r in rows)
            print(f"{label} {n} {transport:12s} GPU ms " + " ".join(f"{m} {g:.3f}" for m, g in zip(MODES, gpu))
                  + f" | host ms/call {host:.2f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
