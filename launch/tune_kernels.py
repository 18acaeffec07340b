"""Time every candidate tile of each Triton kernel on the benchmark shapes; print the best.

    python launch/tune_kernels.py [--head-dims 64 128] [--seqlens 4096 16384]
    python launch/tune_kernels.py --head-dims 64 --seqlens 8192 16384 --tokens 16384 --group 8 --causal 1

Fills `kernels/tuning.py`'s TUNED table (and, with --group, GQA_TUNED) by hand from its output
(what the sweeps taught: docs/performance.md). Needs a CUDA GPU.
A tool, not a benchmark: it records nothing under benchmarks/; --out writes every timing as JSON.
"""

from __future__ import annotations

import argparse
import json

import torch

from ringflash.bench import attn_flops, markdown_table, time_ms
from ringflash.kernels import AttnSpec
from ringflash.kernels.launch_utils import block_d, tma_ok
from ringflash.kernels.triton_bwd import triton_attn_bwd
from ringflash.kernels.triton_fwd import triton_attn_fwd
from ringflash.kernels.tuning import KERNELS, candidates, tile_for


def _runner(kernel, tile, q, k, v, do, o, lse, causal):
    if kernel == "fwd":
        return lambda: triton_attn_fwd(q, k, v, AttnSpec(causal=causal), tile=tile)
    return lambda: triton_attn_bwd(do, q, k, v, o, lse, AttnSpec(causal=causal), tiles={kernel: tile})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384])
    ap.add_argument("--tokens", type=int, default=32768, help="B·N")
    ap.add_argument("--hidden", type=int, default=2048, help="H·D")
    ap.add_argument("--causal", type=int, nargs="+", default=[1, 0])
    ap.add_argument("--group", type=int, default=1, help="query heads per K/V head (GQA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    results, best_rows = [], []
    for D in args.head_dims:
        for N in args.seqlens:
            for causal in map(bool, args.causal):
                B, H = args.tokens // N, args.hidden // D
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(B, N, H // args.group if i in (1, 2) else H, D, device="cuda",
                                           dtype=torch.bfloat16, generator=g) for i in range(4))
                o, lse = triton_attn_fwd(q, k, v, AttnSpec(causal=causal))
                for kernel in KERNELS:
                    mode = "fwd" if kernel == "fwd" else "bwd"
                    timed = []
                    for tile in candidates(kernel, block_d(D)):
                        try:
                            ms = time_ms(_runner(kernel, tile, q, k, v, do, o, lse, causal),
                                         warmup_ms=25, rep_ms=100)
                        except Exception as e:  # out of shared memory / registers for this tile
                            print(f"  {kernel} {tile}: failed ({type(e).__name__})")
                            continue
                        tflops = attn_flops(B, H, N, N, D, causal, mode) / ms * 1e-9
                        timed.append((ms, tile))
                        results.append(dict(kernel=kernel, D=D, N=N, causal=causal, tile=tile, ms=ms,
                                            tflops=tflops))
                        print(f"  D={D} N={N} causal={causal} {kernel} {tile}: {ms:.3f} ms {tflops:.0f} TFLOP/s",
                              flush=True)
                    ms, tile = min(timed)
                    default = tile_for(kernel, block_d(D), descriptors=tma_ok(q, k, v),
                                       group=args.group, queries=N)
                    default_ms = next((m for m, t in timed if t == default), float("nan"))
                    best_rows.append((kernel, D, N, causal, str(tile), f"{ms:.3f}", str(default),
                                      f"{default_ms:.3f}"))
    print(markdown_table(["kernel", "D", "N", "causal", "best tile", "ms", "current default", "ms"], best_rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
