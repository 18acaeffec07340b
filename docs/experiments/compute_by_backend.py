"""Experiment: the ring's compute on each kernel backend, on one GPU, against that backend's single/W.

    python docs/experiments/compute_by_backend.py 8192 32768        # tokens per rank; W = 2
    python docs/experiments/compute_by_backend.py 8192 --world 4 --backends triton
    python docs/experiments/compute_by_backend.py 8192 --profile    # GPU time per kernel instead

For each tokens-per-rank N: every rank r of W runs `ring_forward` + `ring_backward` with
`NullComm(r, W)` (all of the ring's kernels and passes, no transfers: what `bench_ring` calls
compute-only, as whole calls here, casts and merges included), and one GPU runs the causal
forward + backward of the whole W·N sequence, divided by W (single/W, the efficiency's
numerator), each with `kernels.attn_fwd/attn_bwd`'s `backend=` (zigzag, causal, bf16, B = 1,
H = 16, D = 128). Calls are queued back to back between CUDA events (median of 5 runs); the last
column is the host's time to queue one ring call (rank 0; no transfers, no cross-rank check):
where it nears the GPU's, the ring waits for its host. The backends alternate for three rounds,
because the GPU's clock drifts under sustained load. (Queued behind ~100 ms of
`torch.cuda._sleep`, every time here drops by 4–8%, single/W as much as the ring: docs/PERF_NOTES.md,
"GPU clocks"; the prefilled times of host_overhead.py are optimistic in the same way.) The
2×H200 numbers that count come from `launch/bench_ring.py`; this is what one GPU can say about
them (docs/PERF_NOTES.md, "cuDNN backend"). `--profile` lists instead, per case, each kernel's
GPU time per call (torch.profiler over 10 calls): where a ring call's time goes beyond single/W.
"""

import argparse
import collections
import statistics
import time

import torch

from ringflash import NullComm
from ringflash.kernels import attn_bwd, attn_fwd, get_backend
from ringflash.layout import ring_schedule
from ringflash.ring import ring_backward, ring_forward

H, D = 16, 128


def timed(call, calls: int, repeats: int = 5) -> tuple[float, float]:
    """Median (GPU ms, host ms) per call over `repeats` runs of `calls` queued calls. The host's
    is its time to queue them (nothing here waits for the GPU): near the GPU's, the ring would
    wait for its launches."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    runs, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        for _ in range(calls):
            call()
        end.record()
        host.append((time.perf_counter() - t0) * 1000 / calls)
        end.synchronize()
        runs.append(start.elapsed_time(end) / calls)
    return statistics.median(runs), statistics.median(host)


def _inputs(n: int):
    return (torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))


def ring_call(n: int, rank: int, world: int, backend: str):
    q, k, v, do = _inputs(n)
    plan = ring_schedule(rank, world, n, True, "zigzag")
    opts = dict(scale=D**-0.5, kernels=get_backend(backend, torch.device("cuda")), comm=NullComm(rank, world))

    def call():
        o, lse, kv = ring_forward(q, k, v, plan, **opts)
        ring_backward(do, q, kv, o, lse, plan, **opts)

    return call


def single_call(n_global: int, backend: str):
    q, k, v, do = _inputs(n_global)

    def call():
        o, lse = attn_fwd(q, k, v, causal=True, backend=backend)
        attn_bwd(do, q, k, v, o, lse, causal=True, backend=backend)

    return call


def profiled(name: str, call, per: int = 1, calls: int = 10) -> None:
    """Print each CUDA kernel's GPU time per call of `call` (÷ `per`), heaviest first."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    spent = collections.defaultdict(lambda: [0.0, 0])  # name: [µs, launches]
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            spent[e.name][0] += e.device_time
            spent[e.name][1] += 1
    total = sum(us for us, _ in spent.values()) / 1000 / calls / per
    print(f"\n{name}: GPU busy {total:.3f} ms a call")
    for kernel, (us, n) in sorted(spent.items(), key=lambda kv: -kv[1][0]):
        print(f"  {us / 1000 / calls / per:8.4f} ms  ×{n / calls:<4g} {kernel[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokens_per_rank", type=int, nargs="+")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backends", default="triton,cudnn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel instead of whole-call timings")
    args = ap.parse_args()
    backends, W = args.backends.split(","), args.world
    if args.profile:
        for n in args.tokens_per_rank:
            for backend in backends:
                profiled(f"{backend}, {n} tokens/rank: single/W", single_call(W * n, backend), per=W)
                for r in range(W):
                    profiled(f"{backend}, {n} tokens/rank: rank {r} of {W}", ring_call(n, r, W, backend))
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, W = {W}; ms per fwd+bwd call")
    ranks = " | ".join(f"rank {r}" for r in range(W))
    print(f"| tokens/rank | backend | single/W | {ranks} | single/W ÷ slowest | host, rank 0 |")
    print("|---" * (W + 5) + "|")
    for n in args.tokens_per_rank:
        calls = max(4, 160_000 // n)
        times: dict[tuple[str, str], list[float]] = {}
        host: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for backend in backends:
                times.setdefault((backend, "single"), []).append(timed(single_call(W * n, backend), calls)[0] / W)
                for r in range(W):
                    gpu, cpu = timed(ring_call(n, r, W, backend), calls)
                    times.setdefault((backend, f"r{r}"), []).append(gpu)
                    if r == 0:
                        host.setdefault(backend, []).append(cpu)
                torch.cuda.empty_cache()
        for backend in backends:
            med = {key: statistics.median(t) for (b, key), t in times.items() if b == backend}
            spread = {key: f"{min(t):.3f}–{max(t):.3f}" for (b, key), t in times.items() if b == backend}
            slowest = max(med[f"r{r}"] for r in range(W))
            cells = [spread["single"]] + [spread[f"r{r}"] for r in range(W)]
            print(f"| {n} | {backend} | " + " | ".join(cells) + f" | {med['single'] / slowest:.3f} | "
                  f"{statistics.median(host[backend]):.3f} |", flush=True)


if __name__ == "__main__":
    main()
