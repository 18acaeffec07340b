"""What the fused merge saves: one ring step's forward as kernel + separate merge against
`attn_fwd(acc=...)`, which merges into the ring's float32 accumulators inside the kernel.

    python launch/bench_merge.py            # one GPU; appends to benchmarks/merge.jsonl

The shapes are the non-diagonal steps of a zigzag causal ring (bf16, H = 16, D = 128): all of this
rank's queries against half of a block's keys, and half of its queries against all of the keys.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ringflash.bench import BENCHMARKS_DIR, attn_flops, record, time_ms
from ringflash.kernels import FULL, get_backend, ref_merge


def step_times(n_q: int, n_k: int, heads: int, head_dim: int) -> tuple[float, float]:
    """(separate ms, fused ms) of one step: queries `n_q` rows of a float32 accumulator, keys `n_k`."""
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, n_q, heads, head_dim, device=dev, dtype=dt)
    k, v = (torch.randn(1, n_k, heads, head_dim, device=dev, dtype=dt) for _ in range(2))
    kern = get_backend("triton", q.device)
    o0, lse0 = kern.fwd_step(q, k, v, FULL, None, out_dtype=torch.float32)  # a realistic running accumulator
    o, lse = o0.clone(), lse0.clone()

    def separate():
        o_blk, lse_blk = kern.fwd_step(q, k, v, FULL, None, out_dtype=torch.float32)
        ref_merge(o, lse, o_blk, lse_blk)

    def fused():
        kern.fwd_step(q, k, v, FULL, None, acc=(o, lse))

    return time_ms(separate), time_ms(fused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens-per-rank", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-record", action="store_true", help="print only")
    ap.add_argument("--record-to", type=Path, default=BENCHMARKS_DIR, help="directory of the JSON-lines records")
    args = ap.parse_args()
    rows = []
    for n in args.tokens_per_rank:
        for n_q, n_k in ((n, n // 2), (n // 2, n)):
            sep, fus = step_times(n_q, n_k, args.heads, args.head_dim)
            tflops = attn_flops(1, args.heads, n_q, n_k, args.head_dim, causal=False) / fus / 1e9
            rows.append((n, f"{n_q}×{n_k}", sep, fus, sep - fus, sep / fus, tflops))
    headers = ("tokens/rank", "q rows × keys", "kernel + merge ms", "fused ms", "saved ms", "ratio", "fused TFLOP/s")
    record(
        "merge",
        f"Fused merge: one zigzag ring step's forward, bf16, H={args.heads}, D={args.head_dim}",
        headers,
        rows,
        args=dict(dtype="bf16", tokens_per_rank=args.tokens_per_rank, heads=args.heads, head_dim=args.head_dim),
        notes="kernel + merge = `fwd_step(out_dtype=float32)` then `kernels.ref_merge` (the pre-fusion ring step); "
        "fused = `attn_fwd(acc=(o, lse))`.",
        directory=None if args.no_record else args.record_to,
    )


if __name__ == "__main__":
    main()
