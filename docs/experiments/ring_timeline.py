"""Experiment: where a ring call's GPU time goes, launch by launch, in steady state.

    torchrun --standalone --nproc_per_node=2 docs/experiments/ring_timeline.py 8192

A CUDA event is recorded on the compute stream before and after every kernel call, transfer
post and transfer wait of `ring_forward` / `ring_backward` (the Triton backend's step calls and
the transports' methods, wrapped here), and around the forward and the whole fwd+bwd of
`ring_flash_attn_func` (causal zigzag bf16, H = 16, D = 128, cross-rank check on). 20 calls are
queued back to back behind 3 untimed ones, as `bench_ring` times them; the table gives, per rank,
the median ms between consecutive events. A span between two kernel launches is GPU work the
ring queues there (casts, copies, memsets, signal kernels) or a wait; a span over a kernel call
is the kernel, plus anything it waited for. No profiler, so the host keeps its lead. Run it from
the tree under test. (docs/PERF_NOTES.md, "Where a ring call's GPU time goes", has what it found.)
"""

import os
import statistics
import sys

import torch
import torch.distributed as dist

from ringflash import nccl_options, ring_flash_attn_func
from ringflash.kernels import backend_named
from ringflash.transport import copy_engine, p2p

CALLS, PRIMED = 20, 3
_marks: list[list[tuple[str, torch.cuda.Event]]] = []  # per call: (name, event) in order


def mark(name: str) -> None:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    _marks[-1].append((name, event))


def instrument() -> None:
    """Wrap the ring's kernel calls and transfers so that each records an event before and after."""
    kern = backend_named("triton")
    fwd, bwd = kern.fwd_step, kern.bwd_step

    def attn_fwd(*args, **kwargs):
        mark("fwd<")
        out = fwd(*args, **kwargs)
        mark("fwd>")
        return out

    def attn_bwd(*args, after_dkdv, **kwargs):
        def between():
            mark("dkdv>")
            after_dkdv()
            mark("pass_on>")

        mark("bwd<")
        out = bwd(*args, after_dkdv=between, **kwargs)
        mark("dq>")
        return out

    kern.fwd_step, kern.bwd_step = attn_fwd, attn_bwd  # the instance every call resolves "triton" to
    for cls in (p2p._Transfer, copy_engine._CopyTransfer):
        def wait(self, _wait=cls.wait):
            _wait(self)
            mark("wait>")

        cls.wait = wait
    # CopyEngineComm's send_recv, for CUDA blocks, does not go through RingComm's.
    for cls in (p2p.RingComm, copy_engine.CopyEngineComm):
        def post(self, *args, _send_recv=cls.send_recv, **kwargs):
            mark("post<")
            transfer = _send_recv(self, *args, **kwargs)
            mark("post>")
            return transfer

        cls.send_recv = post


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", pg_options=nccl_options())
    rank, world = dist.get_rank(), dist.get_world_size()
    n = int(sys.argv[1])
    dev = torch.device("cuda", torch.cuda.current_device())
    q, k, v = (torch.randn(1, n, 16, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    instrument()
    for transport in ("copy-engine", "nccl"):
        def call(transport=transport):
            _marks.append([])
            mark("call<")
            o = ring_flash_attn_func(q, k, v, causal=True, layout="zigzag", transport=transport)
            mark("fwd_done")
            torch.autograd.grad(o, (q, k, v), do)
            mark("call>")

        for _ in range(5):  # compile, allocate, lay out the copy engine's heap
            call()
        torch.cuda.synchronize()
        dist.barrier()
        _marks.clear()
        for _ in range(PRIMED + CALLS):
            call()
        torch.cuda.synchronize()
        calls = _marks[PRIMED:]
        names = [name for name, _ in calls[0]]
        rows = [
            f"{i:2d} {names[i - 1]:>9s} -> {names[i]:<9s} "
            f"{statistics.median(c[i - 1][1].elapsed_time(c[i][1]) for c in calls):7.3f}"
            for i in range(1, len(names))
        ]
        total = statistics.median(c[0][1].elapsed_time(c[-1][1]) for c in calls)
        rows.append(f"fwd+bwd {total:.3f} ms")
        per_rank = [None] * world
        dist.all_gather_object(per_rank, rows)
        if rank == 0:
            print(f"== {transport}, {n} tokens per rank; ms, median of {CALLS} calls; ranks 0 .. {world - 1}")
            for cols in zip(*per_rank):
                print(" | ".join(f"{c:36s}" for c in cols))
            print(flush=True)
        _marks.clear()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
