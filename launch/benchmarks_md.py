"""BENCHMARKS.md and the benchmark plots, generated from the records in benchmarks/*.jsonl.

    python launch/benchmarks_md.py            # rewrite BENCHMARKS.md and docs/bench_*.png
    python launch/benchmarks_md.py --check    # exit 1 if BENCHMARKS.md is not what the records give
    python launch/benchmarks_md.py --no-plots

The records are the data (`ringflash.bench.record` appends them, one JSON object a line); this file is
the only writer of BENCHMARKS.md, so the two never disagree. One section per benchmark; in it, the
newest record of each table (a title on one kind of device), newest first: the records hold every
run, and BENCHMARKS.md what a reader should quote now. Plots: docs/bench_kernels.png (the newest
full kernel table), docs/bench_ring.png (the newest ring table over three or more lengths) and
docs/bench_ring_history.png (our ring's efficiency in every recorded run).
Needs matplotlib for the plots only (the `dev` extra).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from ringflash.bench import BENCHMARKS_DIR, REPO, describe_ceilings, results_table, tokens_label

BENCHMARKS_MD = REPO / "BENCHMARKS.md"
DOCS = REPO / "docs"
# Section order and headings; a benchmark not named here follows, alphabetically.
SECTIONS = {
    "kernels": "Kernels (`launch/bench_kernels.py`)",
    "ring": "Ring attention (`launch/bench_ring.py`)",
    "steps": "Ring step kernels (`launch/bench_steps.py`)",
    "merge": "Fused merge (`launch/bench_merge.py`)",
    "training": "Training (`launch/train.py`, recorded by hand)",
    "scaling": "Ring, all-gather and head parallelism against the planner (`launch/bench_scaling.py`)",
    "hf": "transformers models (`launch/bench_hf.py`)",
    "ring_compute": "Ring compute alone, per kernel backend (recorded by hand)",
    "acceptance": "GPU acceptance run (`launch/gpu_acceptance.sh`)",
}
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}(?: \d{2}:\d{2})?")


def load(directory: Path = BENCHMARKS_DIR) -> dict[str, list[dict]]:
    """Every record per benchmark, in file order; the benchmark is the file's stem."""
    out = {}
    for path in sorted(directory.glob("*.jsonl")):
        with path.open() as f:
            out[path.stem] = [json.loads(line) for line in f if line.strip()]
    return out


def newest_first(records: list[dict]) -> list[dict]:
    """By the date's `YYYY-MM-DD HH:MM` (a bare day sorts before that day's timed runs); at equal
    dates the later line first, as it was appended later. Undated records last."""
    def key(item):
        i, rec = item
        m = _DATE.search(rec.get("date") or "")
        return (m.group(0) if m else "", i)

    return [rec for _, rec in sorted(enumerate(records), key=key, reverse=True)]


def _table_key(rec: dict) -> tuple[str, str]:
    """Which table a record is a run of: its title on its kind of device. A device's parenthesised
    detail (which machine, which of its GPUs) does not make a new table."""
    return rec["title"], re.sub(r"\s*\(.*?\)", "", rec.get("device") or "")


def newest_per_table(records: list[dict]) -> list[dict]:
    """The newest record of each table, newest first. A record without results is a note on other
    runs (a correction, say), kept in the records but not a table to show."""
    shown: dict[tuple[str, str], dict] = {}
    for rec in newest_first(records):
        if rec.get("results"):
            shown.setdefault(_table_key(rec), rec)
    return list(shown.values())


def _versions(v: dict | None) -> str:
    if not v:
        return ""
    if "raw" in v:
        return v["raw"]
    names = {"torch": "torch", "triton": "triton", "cuda": "CUDA", "driver": "driver", "python": "python"}
    return ", ".join(f"{names.get(k, k)} {x}" for k, x in v.items() if x is not None)


def _args(a: dict) -> str:
    def val(x):
        return ",".join(map(str, x)) if isinstance(x, list) else str(x)

    return ", ".join(f"{k}={val(x)}" for k, x in a.items() if x is not None)


def render_record(rec: dict) -> str:
    lines = [f"### {rec['title']}", ""]
    for key in ("device", "date", "commit"):
        if rec.get(key):
            lines.append(f"- {key}: {rec[key]}")
    if _versions(rec.get("versions")):
        lines.append(f"- versions: {_versions(rec['versions'])}")
    lines += [f"- {k}: {v}" for k, v in (rec.get("info") or {}).items()]
    if rec.get("args"):
        lines.append(f"- arguments: {_args(rec['args'])}")
    if rec.get("peers"):
        lines.append(f"- peers in the same run: {', '.join(rec['peers'])}")
    ceilings = describe_ceilings(rec.get("ceilings") or {})
    if ceilings:
        lines.append("- ceilings in the same run: " + "; ".join(ceilings))
    for part in (rec.get("context"), results_table(rec["results"]) if rec.get("results") else "", rec.get("notes")):
        if part:
            lines += ["", part]
    return "\n".join(lines) + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def render(by_benchmark: dict[str, list[dict]]) -> str:
    order = [b for b in SECTIONS if b in by_benchmark] + sorted(set(by_benchmark) - set(SECTIONS))
    out = [
        "# Benchmarks",
        "",
        "Generated by `python launch/benchmarks_md.py` from `benchmarks/*.jsonl`: do not edit by hand. "
        "Each benchmark script in `launch/` appends one JSON record per run (device, date, commit, versions, "
        "arguments, the figures, the peers and ceilings measured in the same run; `ringflash/bench.py`). "
        "This page shows the newest record of each table (a title on one kind of device); every earlier "
        "run stays in the records. What the figures mean and what was learnt from them: `docs/performance.md`.",
        "",
        "Records dated before 2026-11-24 were converted from a hand-kept, chronological markdown file: "
        "where their notes say \"above\" or \"below\", they mean that file's order (oldest first), and "
        "their figures keep the digits that file printed.",
        "",
        "## Contents",
        "",
    ]
    for b in order:
        recs = newest_first(by_benchmark[b])
        heading = SECTIONS.get(b, b)
        latest = next((r for r in recs if r.get("date")), recs[0])
        count = f"{len(recs)} record" + "s" * (len(recs) != 1)
        tables = len(newest_per_table(recs))
        out.append(f"- [{heading}](#{_anchor(heading)}): `benchmarks/{b}.jsonl`, {count}, {tables} table"
                   + "s" * (tables != 1) + f" shown, newest {latest.get('date')} at {latest.get('commit')}")
    for b in order:
        out += ["", f"## {SECTIONS.get(b, b)}", ""]
        out.append("\n".join(render_record(r) for r in newest_per_table(by_benchmark[b])))
    return "\n".join(out).rstrip("\n") + "\n"


def _numbers(results: Iterable[dict], *keys: str):
    for row in results:
        vals = [row.get(k) for k in keys]
        if all(isinstance(v, (int, float)) for v in vals[-1:]):
            yield vals


def plot_lines(panels: dict[str, list[tuple[str, float, float]]], path: Path, xlabel: str, ylabel: str,
               title: str = "", log2_x: bool = True) -> None:
    """One subplot per panel title, one line per series: `panels[title] = [(series, x, y), ...]`.
    With `log2_x`, x (sequence lengths) on a base-2 log axis ticked at the measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False)
    for ax, (name, points) in zip(axes[0], panels.items()):
        for series in dict.fromkeys(s for s, _, _ in points):
            xy = sorted((x, y) for s, x, y in points if s == series)
            ax.plot(*zip(*xy), marker="o", label=series)
        ax.set(title=name, xlabel=xlabel, ylabel=ylabel)
        if log2_x:
            ax.set_xscale("log", base=2)
            xs = sorted({x for _, x, _ in points})
            ax.set_xticks(xs, [tokens_label(x) for x in xs])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if not log2_x:
        fig.autofmt_xdate()
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")


def plot_kernels(records: list[dict], path: Path) -> None:
    """fwd+bwd TFLOP/s against N, one panel per (D, causal), from the newest dense kernel table with
    the most panels: a later run of fewer head dims (a follow-up of one change) does not replace it."""
    tables = [r for r in newest_first(records) if r["title"].startswith("Kernels: bf16 attention")]
    rec = max(tables, key=lambda r: len({(row.get("D"), row.get("causal")) for row in r["results"]}))
    panels: dict[str, list] = {}
    for impl, D, causal, N, tfb in _numbers(rec["results"], "impl", "D", "causal", "N", "fwd+bwd TFLOP/s"):
        panels.setdefault(f"D={D}, {'causal' if causal == 'yes' else 'full'}", []).append((impl, N, tfb))
    plot_lines(dict(sorted(panels.items())), path, "sequence length", "fwd+bwd TFLOP/s",
               title=f"{rec['device']}, {rec['date']}, {rec['commit']}")


def plot_ring(records: list[dict], path: Path) -> None:
    """TFLOP/s per GPU against tokens per rank, from the newest ring table over three or more lengths."""
    def lengths(r):
        return {row.get("tokens/rank") for row in r.get("results") or []}

    rec = next(r for r in newest_first(records)
               if r["title"].startswith("Ring attention, ") and len(lengths(r)) >= 3)
    series = [(f"{impl} {layout}", n, tf)
              for impl, layout, n, tf in _numbers(rec["results"], "impl", "layout", "tokens/rank", "TFLOP/s/GPU")]
    plot_lines({rec["title"].split(",")[1].strip() + ", causal": series}, path, "tokens per rank",
               "fwd+bwd TFLOP/s per GPU", title=f"{rec['device']}, {rec['date']}, {rec['commit']}")


def plot_ring_history(records: list[dict], path: Path) -> None:
    """Our zigzag ring's efficiency at 8k and 32k tokens per rank (Triton kernels; NCCL and copy
    engine) in every 2-rank run, by date: the two ring-efficiency goals (docs/performance.md) over time."""
    import datetime

    panels: dict[int, list] = {8192: [], 32768: []}
    for rec in records:
        m = re.fullmatch(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC", rec.get("date") or "")
        if not m or not rec["title"].startswith("Ring attention, 2 ranks"):
            continue
        when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M")
        for impl, layout, n, eff in _numbers(rec["results"], "impl", "layout", "tokens/rank", "efficiency"):
            if layout == "zigzag" and impl in ("ringflash", "ringflash (copy-engine)") and n in panels:
                panels[n].append((impl, when, eff))
    plot_lines({f"{tokens_label(n)} tokens/rank": points for n, points in panels.items()}, path, "date (UTC)",
               "efficiency", title="ringflash zigzag, 2 ranks: (single/W) ÷ ring fwd+bwd", log2_x=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=Path, default=BENCHMARKS_DIR, help="directory of the *.jsonl records")
    ap.add_argument("--out", type=Path, default=BENCHMARKS_MD)
    ap.add_argument("--check", action="store_true", help="only compare --out with what the records give")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    data = load(args.records)
    text = render(data)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is not what {args.records} gives: run python launch/benchmarks_md.py", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}")
    if not args.no_plots:
        if "kernels" in data:
            plot_kernels(data["kernels"], DOCS / "bench_kernels.png")
        if "ring" in data:
            plot_ring(data["ring"], DOCS / "bench_ring.png")
            plot_ring_history(data["ring"], DOCS / "bench_ring_history.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
