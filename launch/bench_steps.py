"""Where the ring's compute goes, kernel by kernel: its per-step calls against one GPU's whole problem.

    python launch/bench_steps.py --tokens-per-rank 8k,32k          # one GPU; appends to benchmarks/steps.jsonl
    python launch/bench_steps.py --tokens-per-rank 32k --world 4 --no-record

For N tokens per rank on W ranks (zigzag, causal, bf16, B = 1, H = 16, D = 128) this times, with
torch.profiler, each Triton kernel (forward, dK/dV, dQ) of
- single: one GPU's causal forward and backward on the whole W·N sequence, divided by W (the
  denominator of the ring's efficiency), and
- every rank's ring steps: `ringflash/ring.py`'s own `ring_forward` and `ring_backward` run as
  rank r of W with `NullComm` (no transfers), so the kernels are called exactly as the ring calls
  them (float32 outputs, merges and accumulation in the kernels).
What `bench_ring.py` calls compute-only, per rank and per kernel; only the three Triton kernels
are counted, not the copies and casts around them. Cases run in rounds that interleave them,
because the GPU's clock drops under sustained load; the table gives each kernel's median over
the rounds. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from ringflash import NullComm
from ringflash.bench import BENCHMARKS_DIR, parse_tokens, record
from ringflash.kernels import attn_bwd, attn_fwd, get_backend
from ringflash.layout import ring_schedule
from ringflash.ring import ring_backward, ring_forward

KERNELS = {"_attn_fwd_kernel": "fwd", "_bwd_dkdv": "dK/dV", "_bwd_dq": "dQ"}
DEVICE = "cuda"


def _single(n_global: int, heads: int, head_dim: int):
    dev, dt = DEVICE, torch.bfloat16
    q, k, v, do = (torch.randn(1, n_global, heads, head_dim, device=dev, dtype=dt) for _ in range(4))

    def run():
        o, lse = attn_fwd(q, k, v, causal=True)
        attn_bwd(do, q, k, v, o, lse, causal=True)

    return run


def _rank_steps(rank: int, world: int, n: int, heads: int, head_dim: int):
    """Rank `rank`'s ring forward and backward, without communication (bench_ring's compute-only)."""
    q, k, v, do = (torch.randn(1, n, heads, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(4))
    plan = ring_schedule(rank, world, n, True, "zigzag")
    opts = dict(scale=head_dim**-0.5, kernels=get_backend(None, q.device), comm=NullComm(rank, world))

    def run():
        o, lse, kv = ring_forward(q, k, v, plan, **opts)
        ring_backward(do, q, kv, o, lse, plan, **opts)

    return run


def _kernel_ms(run, calls: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    ms = {name: 0.0 for name in KERNELS.values()}
    for e in prof.key_averages():
        if e.key in KERNELS:
            ms[KERNELS[e.key]] += e.device_time_total / 1e3 / calls
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens-per-rank", type=parse_tokens, default=parse_tokens("8k,32k"))
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-record", action="store_true", help="print only")
    ap.add_argument("--record-to", type=Path, default=BENCHMARKS_DIR, help="directory of the JSON-lines records")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_steps.py times CUDA kernels with torch.profiler: it needs a CUDA GPU")
    if args.world < 2:
        sys.exit(f"--world must be at least 2, got {args.world}")

    rows = []
    for n in args.tokens_per_rank:
        cases = {"single ÷ W": _single(n * args.world, args.heads, args.head_dim)}
        for r in range(args.world):
            cases[f"rank {r} steps"] = _rank_steps(r, args.world, n, args.heads, args.head_dim)
        calls = max(3, 2**32 // n**2)  # about the same kernel time per case and round at any N
        rounds = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, run in cases.items():
                rounds[name].append(_kernel_ms(run, calls))
        median = {name: {k: statistics.median(r[k] for r in results) for k in KERNELS.values()}
                  for name, results in rounds.items()}
        median["single ÷ W"] = {k: t / args.world for k, t in median["single ÷ W"].items()}
        base = sum(median["single ÷ W"].values())
        for name, ms in median.items():
            total = sum(ms.values())
            rows.append([n, name, *(ms[k] for k in KERNELS.values()), total, total / base])
        del cases
        torch.cuda.empty_cache()
    headers = ["tokens/rank", "what", *(f"{k} ms" for k in KERNELS.values()), "total ms", "÷ single/W"]
    title = f"Ring step kernels vs one GPU, W={args.world} zigzag causal, bf16, H={args.heads}, D={args.head_dim}"
    notes = (
        "Kernel time only (torch.profiler), median of rounds that interleave the cases; rank r's steps are "
        "ringflash/ring.py's ring_forward and ring_backward with NullComm (no transfers); the copies and casts "
        "around the kernels are not counted."
    )
    record("steps", title, headers, rows, notes=notes, directory=None if args.no_record else args.record_to,
           args=dict(dtype="bf16", layout="zigzag", causal=True, world=args.world, heads=args.heads,
                     head_dim=args.head_dim, tokens_per_rank=args.tokens_per_rank, rounds=args.rounds))


if __name__ == "__main__":
    main()
