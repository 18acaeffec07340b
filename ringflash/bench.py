"""What the benchmark scripts in launch/ share: FLOP counts, timing, peers, the run's record.

FLOPs follow FlashAttention's convention: forward `4·B·H·N²·D` (halved when causal), backward
2.5× forward. Times are medians of CUDA-event timings (`triton.testing.do_bench`) after warm-up;
`time_collective` times calls every rank makes, in steady state. `bench_single`,
`bench_single_sdpa` and `bench_torch_cp` time the one-GPU baselines and torch's context parallel;
`profile_calls` prints where a call's GPU time goes and where each rank's compute stream waits.

Results are data: `record` appends one JSON line per run to `benchmarks/<benchmark>.jsonl`
(`RECORD_KEYS` below); `launch/benchmarks_md.py` turns those files into BENCHMARKS.md and the plots.
`REPO` is the source checkout this module runs from: the scripts record into its `benchmarks/`.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from ringflash.kernels import attn_bwd, attn_fwd

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_DIR = REPO / "benchmarks"

# Every record has these keys (None or empty where unknown, e.g. in history converted from markdown):
# benchmark: the file stem; title: one line; device, date ("YYYY-MM-DD HH:MM UTC"), commit;
# versions: {torch, triton, cuda, driver, python}; args: the shapes and options of the run;
# results: the table, one dict per row (column -> value); peers: the other implementations
# measured in the same run; ceilings: the device's limits measured in the same run; notes: text.
RECORD_KEYS = ("benchmark", "title", "device", "date", "commit", "versions", "args", "results", "peers",
               "ceilings", "notes")
SIGNIFICANT_DIGITS = 4  # stored figures: finer than the run-to-run noise (±1-5%), short to read
_MESH = None  # torch CP's device mesh, made once for every call


def attn_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool,
               mode: str = "fwd") -> float:
    """FLOPs of attention in FlashAttention's convention; `mode` is `fwd`, `bwd` or `fwd_bwd`."""
    fwd = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    if causal:
        fwd /= 2
    return {"fwd": fwd, "bwd": 2.5 * fwd, "fwd_bwd": 3.5 * fwd}[mode]


def time_ms(fn: Callable[[], object], warmup_ms: float = 100, rep_ms: float = 500) -> float:
    """Median milliseconds of `fn()` on the current CUDA device."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def exit_without_teardown(code: int | None = 0) -> NoReturn:
    """End a torchrun script (training, a benchmark, a check) with `code` (None: 0) once its work
    is done, skipping the interpreter's teardown: on CPU (gloo) a rank sometimes aborts there after
    main() returned, its groups destroyed and everything written ("terminate called without an
    active exception", from a C++ thread of torch's; about 1 run in 15 with 2-4 ranks on 2 busy
    cores, torch 2.13), and the run fails. docs/RELIABILITY.md has the measurements."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def git_commit() -> str:
    """HEAD's short hash; `RINGFLASH_COMMIT` wins (the GPU machines get the tree without .git)."""
    if os.environ.get("RINGFLASH_COMMIT"):
        return os.environ["RINGFLASH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _driver_version() -> str | None:
    """The NVIDIA driver's version from nvidia-smi, or None (no GPU, or nvidia-smi missing)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=30).stdout
        return out.splitlines()[0].strip() or None
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def run_metadata() -> dict:
    """Device, date, commit and versions: what every record says about where it ran."""
    import triton

    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
    return {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "driver": _driver_version() if torch.cuda.is_available() else None,
            "python": platform.python_version(),
        },
    }


def fmt(x: object) -> str:
    """One cell of a progress table: floats to 3 significant digits, None empty."""
    if x is None:
        return ""
    return f"{x:.3g}" if isinstance(x, float) else str(x)


def cell(x: object) -> str:
    """One stored figure as BENCHMARKS.md shows it: every digit kept, None empty."""
    if x is None:
        return ""
    return f"{x:.6g}" if isinstance(x, float) else str(x)


def results_table(results: Sequence[dict]) -> str:
    """A record's `results` as a markdown table; columns in first-seen order."""
    headers = list(dict.fromkeys(k for row in results for k in row))
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(row.get(h)) for h in headers) + " |" for row in results]
    return "\n".join(lines)


def describe_ceilings(c: dict) -> list[str]:
    """The device's limits measured in the run, one phrase each."""
    out = []
    for k, v in c.items():
        if k == "matmul_tflops":
            out.append(f"dense bf16 matmul (8192³) {cell(v)} TFLOP/s")
        elif k == "copy_tbps":
            out.append(f"device copy (1 GiB, read + written) {v:.2f} TB/s")
        elif k == "kv_hop_alone":
            out += [f"one K/V hop alone ({h['tokens_per_rank']} tokens/rank, {h['transport']}): {cell(h['ms'])} ms "
                    f"for {cell(h['MiB'])} MiB ({cell(h['GB/s'])} GB/s)" for h in v]
        else:
            out.append(f"{k} {v}")
    return out


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def _stored(x: object) -> object:
    """A figure as stored: floats rounded to SIGNIFICANT_DIGITS, NaN/inf as None (JSON has neither)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{SIGNIFICANT_DIGITS}g}")
    return None if x == "" else x


def results(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[dict]:
    """A table as records' `results`: one dict per row, keys in column order."""
    return [{h: _stored(x) for h, x in zip(headers, row)} for row in rows]


def make_record(benchmark: str, title: str, headers: Sequence[str], rows: Sequence[Sequence[object]], *,
                args: dict, peers: Sequence[str] = (), ceilings: dict | None = None, notes: str = "",
                meta: dict | None = None) -> dict:
    """One run as a record (`RECORD_KEYS`); `meta` (device, date, commit, versions) defaults to this run's."""
    return {"benchmark": benchmark, "title": title, **(meta or run_metadata()), "args": args,
            "results": results(headers, rows), "peers": list(peers),
            "ceilings": {k: _stored(v) for k, v in (ceilings or {}).items()}, "notes": notes}


def record(benchmark: str, title: str, headers: Sequence[str], rows: Sequence[Sequence[object]], *,
           args: dict, peers: Sequence[str] = (), ceilings: dict | None = None, notes: str = "",
           directory: Path | None = BENCHMARKS_DIR) -> dict:
    """Print the table and, unless `directory` is None, append the run to `directory/<benchmark>.jsonl`.

    One JSON object per line, so concurrent branches append without rewriting each other's lines
    and the history merges like any text file. Returns the record.
    """
    rec = make_record(benchmark, title, headers, rows, args=args, peers=peers, ceilings=ceilings, notes=notes)
    print(f"## {title}\n\n{results_table(rec['results'])}\n")
    if rec["ceilings"]:
        print("ceilings in the same run: " + "; ".join(describe_ceilings(rec["ceilings"])))
    if notes:
        print(f"\n{notes}\n", flush=True)
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{benchmark}.jsonl"
        with path.open("a") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        print(f"recorded: {path} (python launch/benchmarks_md.py regenerates BENCHMARKS.md and the plots)")
    return rec


def parse_tokens(s: str) -> list[int]:
    """A command-line list of token counts: "8k,32k" -> [8192, 32768] (the inverse of `tokens_label`)."""
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in s.split(",")]


def tokens_label(n: float) -> str:
    """4096 -> "4k", 1048576 -> "1M", 1000 -> "1000"."""
    n = int(n)
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def doc_lengths(n_global: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Document lengths, log-uniform in [lo, hi], filling `n_global` tokens (the last one cut)."""
    g = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < n_global:
        u = torch.rand((), generator=g).item()
        length = round(math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo))))
        lens.append(min(length, n_global - sum(lens)))
    return lens


def visible_fraction(n_global: int, docs: list[int] | None, window: int | None) -> float:
    """Visible (query, key) pairs under documents or a window, over dense causal's n(n+1)/2."""
    if docs is not None:
        pairs = sum(n * (n + 1) // 2 for n in docs)
    else:
        w = min(window, n_global)
        pairs = w * (w + 1) // 2 + (n_global - w) * w
    return pairs / (n_global * (n_global + 1) // 2)


def synchronize() -> None:
    """Wait for the current CUDA device, where there is one."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


PRIMING_CALLS = 3  # untimed calls queued before each timed run's start event (time_collective)


def time_collective(fn, iters: int, warmup: int, repeats: int = 5) -> float:
    """ms per call of `fn`, which every rank calls the same number of times (it communicates).

    Calls run back to back, as they do in training (the host queues the next call while the GPU
    works on this one), `iters` at a time between two CUDA events; the median of `repeats` such
    runs, and the slowest rank's, is reported. Synchronising the host after every call instead
    would add the CPU's launch latency to each one, which single-device timings do not pay.
    For the same reason the start event is queued behind `PRIMING_CALLS` untimed calls: the
    steady state of a run, where the host is ahead of the GPU. Recorded on an idle GPU, it
    would also time the host's lead being built up: at small sizes the host's time per call is
    close to the GPU's, so it takes a few calls to get ahead, and until then the GPU waits for
    launches.
    """
    for _ in range(warmup):
        fn()
    synchronize()
    dist.barrier()
    runs = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(PRIMING_CALLS):
                fn()
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            runs.append((time.perf_counter() - t0) * 1e3 / iters)
    # On the group's device: NCCL reduces CUDA tensors only.
    med = torch.tensor([statistics.median(runs)], dtype=torch.float64, device=_device())
    dist.all_reduce(med, op=dist.ReduceOp.MAX)  # the ring is as fast as its slowest rank
    return med.item()


def time_local(fn, iters: int, warmup: int) -> float:
    """Median ms per call of a function that does not communicate."""
    if torch.cuda.is_available():
        return time_ms(fn)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_single(args, n_global, dev, dtype, backend=None, profile: Callable | None = None):
    """One device's fwd+bwd ms on the whole sequence with the same kernels (no autograd).

    `args` gives batch, heads, kv_heads, head_dim, iters, warmup; `profile(fn, title)`, when
    given, profiles the call first (the per-kernel baseline of a ring's compute-only table)."""
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, n_global, H, D, device=dev, dtype=dtype)
    k, v = (torch.randn(B, n_global, Hkv, D, device=dev, dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)

    def fwd_bwd():
        o, lse = attn_fwd(q, k, v, causal=True, backend=backend)
        attn_bwd(do, q, k, v, o, lse, causal=True, backend=backend)

    if profile is not None:
        profile(fwd_bwd, f"single device, {n_global} tokens (divide by the ranks)")
    return time_local(fwd_bwd, args.iters, args.warmup)


def _sdpa_fwd_bwd(q, k, v, do, sdpa_backend: str):
    """Causal SDPA forward + `autograd.grad` with the `sdpa_backend` ("flash" or "cudnn") kernels;
    q, k, v `(B, H, N, D)` requiring grad."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[sdpa_backend]

    def fwd_bwd():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), do)

    return fwd_bwd


def bench_single_sdpa(args, n_global, dev, dtype, sdpa_backend: str) -> float:
    """One device's fwd+bwd ms on the whole sequence with SDPA's `sdpa_backend` kernels: torch
    CP's efficiency is relative to its own kernels, as ours is to ours."""
    B, H, D = args.batch, args.heads, args.head_dim
    q, k, v = (torch.randn(B, H, n_global, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(B, H, n_global, D, device=dev, dtype=dtype)
    return time_local(_sdpa_fwd_bwd(q, k, v, do, sdpa_backend), args.iters, args.warmup)


def bench_torch_cp(args, n_global, dev, dtype, sdpa_backend: str) -> tuple[float | None, str]:
    """torch context_parallel fwd+bwd ms on the same shapes, or (None, reason); `args` as for
    `bench_single`, plus cp_rotate (None: torch's default rotate method)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel

        if args.cp_rotate:
            from torch.distributed.tensor.experimental._attention import set_rotate_method

            set_rotate_method(args.cp_rotate)
        if dev.type != "cuda":
            return None, "needs CUDA"
        if args.kv_heads != args.heads:
            return None, "GQA not benchmarked"
        global _MESH
        _MESH = _MESH or init_device_mesh("cuda", (dist.get_world_size(),))  # one mesh for every call
        mesh = _MESH
        B, H, D = args.batch, args.heads, args.head_dim
        # SDPA layout (B, H, N, D); the context shards these buffers in place along dim 2.
        bufs = [torch.randn(B, H, n_global, D, device=dev, dtype=dtype) for _ in range(4)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)):
            q, k, v, do = bufs
            for t in (q, k, v):
                t.requires_grad_()
            return time_collective(_sdpa_fwd_bwd(q, k, v, do, sdpa_backend), args.iters, args.warmup), ""
    except Exception as e:  # an experimental API: report why, keep benchmarking
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def profile_calls(fn, title: str, trace_dir: str | None = None, name: str = "", iters: int = 3) -> None:
    """Print rank 0's GPU time per kernel (torch.profiler) over `iters` calls of `fn`, and every
    rank's timeline: how busy its compute stream is and where it waits (`idle_gaps`). With
    `trace_dir`, every rank's chrome trace is kept there as `{name}_rank{r}.json`."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        text = Path(f.name).read_text()
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        (Path(trace_dir) / f"{name}_rank{dist.get_rank()}.json").write_text(text)
    events = json.loads(text)["traceEvents"]
    timelines = [None] * dist.get_world_size()
    dist.all_gather_object(timelines, idle_gaps(events, iters))
    if dist.get_rank() == 0:
        print(f"== profile: {title} ({iters} calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        for r, lines in enumerate(timelines):
            print(f"-- rank {r}: " + "\n   ".join(lines))


def idle_gaps(events: list[dict], calls: int, top: int = 8) -> list[str]:
    """Where the compute stream waits, from a chrome trace: busy/span per call, NCCL kernels' time
    per call, and the idle gaps (> 5 µs) summed by the kernels on either side, largest first."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams: dict[int, list[dict]] = {}
    for e in gpu:
        streams.setdefault(e["args"].get("stream", -1), []).append(e)
    nccl = [e for e in gpu if e["name"].startswith("nccl")]
    nccl_streams = {e["args"].get("stream", -1) for e in nccl}
    compute_streams = [s for sid, s in streams.items() if sid not in nccl_streams]
    if not compute_streams:
        return ["no compute kernels in the trace (CPU run?)"]
    compute = max(compute_streams, key=lambda s: sum(e["dur"] for e in s))
    compute.sort(key=lambda e: e["ts"])
    span = compute[-1]["ts"] + compute[-1]["dur"] - compute[0]["ts"]
    busy = sum(e["dur"] for e in compute)
    gaps: dict[tuple[str, str], list[float]] = {}
    for a, b in itertools.pairwise(compute):
        idle = b["ts"] - (a["ts"] + a["dur"])
        if idle > 5:
            gaps.setdefault((_short_name(a["name"]), _short_name(b["name"])), []).append(idle)
    lines = [
        f"compute stream busy {busy / calls / 1e3:.3f} of {span / calls / 1e3:.3f} ms per call; "
        f"NCCL kernels {sum(e['dur'] for e in nccl) / calls / 1e3:.3f} ms per call ({len(nccl) // calls} per call, "
        f"up to {max((math.prod(e['args'].get('grid', [0])) for e in nccl), default=0)} blocks)"
    ]
    if nccl and len(nccl) % calls == 0:  # each transfer's kernel, in call order (waiting for the peer included)
        per_call = len(nccl) // calls
        nccl.sort(key=lambda e: e["ts"])
        ms = [statistics.median(e["dur"] for e in nccl[i::per_call]) / 1e3 for i in range(per_call)]
        lines.append("NCCL kernels in order, median ms: " + ", ".join(f"{t:.3f}" for t in ms))
    for (a, b), g in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"idle {sum(g) / calls / 1e3:.3f} ms/call ({len(g) / calls:.3g}×) between {a} → {b}")
    return lines


def _short_name(kernel: str) -> str:
    return kernel.split("(")[0].split("<")[0][:28]
