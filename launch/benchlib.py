"""What every benchmark script shares: FLOP counts, timing, the run's metadata, and BENCHMARKS.md.

FLOPs follow FlashAttention's convention: forward `4·B·H·N²·D` (halved when causal), backward
2.5× forward. Times are medians of CUDA-event timings (`triton.testing.do_bench`) after warm-up.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO / "BENCHMARKS.md"


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


def run_metadata() -> dict[str, str]:
    """Device, date, commit and versions: the header of every BENCHMARKS.md entry."""
    import triton

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        device = f"{n}x {torch.cuda.get_device_name(0)}"
    else:
        device = f"CPU ({platform.processor() or platform.machine()})"
    return {
        "device": device,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "versions": f"torch {torch.__version__}, triton {triton.__version__}, "
                    f"CUDA {torch.version.cuda}, python {platform.python_version()}",
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(x: object) -> str:
        return f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def record(title: str, table: str, notes: str = "", path: Path = BENCHMARKS_MD) -> None:
    """Print `table` and append it, with the run's metadata, to BENCHMARKS.md."""
    meta = run_metadata()
    header = f"## {title}\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items())
    entry = f"{header}\n\n{table}\n" + (f"\n{notes}\n" if notes else "")
    print(entry)
    if not path.exists():
        path.write_text("# Benchmarks\n\nAppended by the scripts in `launch/`; newest last.\n\n")
    with path.open("a") as f:
        f.write("\n" + entry)


def parse_tokens(s: str) -> list[int]:
    """A command-line list of token counts: "8k,32k" -> [8192, 32768] (the inverse of the labels below)."""
    return [int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in s.split(",")]


def _tokens_label(n: float) -> str:
    """4096 -> "4k", 1048576 -> "1M", 1000 -> "1000"."""
    n = int(n)
    for unit, size in (("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def plot_lines(panels: dict[str, list[tuple[str, float, float]]], path: Path, xlabel: str, ylabel: str) -> None:
    """One subplot per panel title, one line per series: `panels[title] = [(series, x, y), ...]`.
    x on a base-2 log axis (sequence lengths), ticked at the measured points ("8k", "16k", ...).
    Skipped, with a message, where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, points) in zip(axes[0], panels.items()):
        for series in dict.fromkeys(name for name, _, _ in points):
            xy = sorted((x, y) for name, x, y in points if name == series)
            ax.plot(*zip(*xy), marker="o", label=series)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.set_xscale("log", base=2)
        xs = sorted({x for _, x, _ in points})
        ax.set_xticks(xs, [_tokens_label(x) for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")

