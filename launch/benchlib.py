"""What every benchmark script shares: FLOP counts, timing, the run's metadata, and its record.

FLOPs follow FlashAttention's convention: forward `4·B·H·N²·D` (halved when causal), backward
2.5× forward. Times are medians of CUDA-event timings (`triton.testing.do_bench`) after warm-up.

Results are data: `record` appends one JSON line per run to `benchmarks/<benchmark>.jsonl`
(`RECORD_KEYS` below); `launch/benchmarks_md.py` turns those files into BENCHMARKS.md and the plots.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

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
    """End a torchrun script with `code` (None: 0) once its work is done, skipping the interpreter's
    teardown: on CPU (gloo) a rank sometimes aborts there after main() returned, its groups
    destroyed and everything written ("terminate called without an active exception", from a C++
    thread of torch's; about 1 run in 15 with 2-4 ranks on 2 busy cores, torch 2.13), and the run
    fails. docs/RELIABILITY.md has the measurements."""
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
