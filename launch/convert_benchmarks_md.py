"""One-off: the hand-kept, chronological BENCHMARKS.md (before benchmarks/*.jsonl) as JSON records.

    python launch/convert_benchmarks_md.py OLD_BENCHMARKS.md    # writes benchmarks/*.jsonl

Every `## ` section becomes one record (`benchlib.RECORD_KEYS`, plus `info` for other header lines,
`context` for the text before the table and `source`). Header bullets give device, date, commit and
versions; the first table gives `results`; the text after it `notes`. A section with neither header
nor table introduced the next one and is kept as that record's context. Title patterns give the
benchmark, the arguments and the peers; the kernel tables' ceiling sentence becomes `ceilings`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from benchlib import BENCHMARKS_DIR

SOURCE = "BENCHMARKS.md at 4e79a42 (hand-kept, converted)"
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?\d+\.\d*(?:e[+-]?\d+)?|-?\d+e[+-]?\d+")
_CEILING_OLD = re.compile(r"Dense bf16 matmul \(8192³\) in the same run: (\d+) TFLOP/s\.")
_CEILING_NEW = re.compile(r"Ceilings in the same run: dense bf16 matmul \(8192³\) (\d+) TFLOP/s; "
                          r"device copy \(1 GiB, read \+ written\) ([\d.]+) TB/s\.")
_TITLE_ARGS = [
    (r"Kernels: bf16 attention, B·N = (\d+), H·D = (\d+)", ("tokens", "hidden"), {"dtype": "bf16"}),
    (r"Kernels: masks on one packed sequence, bf16, N = (\d+), H = (\d+), D = (\d+)", ("N", "H", "D"),
     {"dtype": "bf16", "masks": True}),
    (r"Ring attention(?: with document/window masks)?, (\d+) ranks \((\w+)\), (\w+), causal, "
     r"B=(\d+) H=(\d+) Hkv=(\d+) D=(\d+)", ("world", "process_group", "dtype", "batch", "heads", "kv_heads",
                                          "head_dim"), {"causal": True}),
    (r"Fused merge: one zigzag ring step's forward, (\w+), H=(\d+), D=(\d+)", ("dtype", "heads", "head_dim"), {}),
    (r"Ring step kernels vs one GPU, W=(\d+) zigzag causal, (\w+), H=(\d+), D=(\d+)",
     ("world", "dtype", "heads", "head_dim"), {"layout": "zigzag", "causal": True}),
]


def benchmark_of(title: str) -> str:
    for prefix, name in (("Kernels", "kernels"), ("Ring step kernels", "steps"), ("dK/dV kernel", "steps"),
                         ("Fused merge", "merge"), ("Training", "training")):
        if title.startswith(prefix):
            return name
    return "ring"


def value(s: str):
    s = s.strip()
    if s == "":
        return None
    if _INT.fullmatch(s):
        return int(s)
    if _FLOAT.fullmatch(s):
        return float(s)
    return s


def split_table(lines: list[str]) -> tuple[str, list[dict] | None, str]:
    """(text before, rows, text after) of the section body's first table."""
    starts = [i for i, line in enumerate(lines) if line.startswith("|")]
    if not starts:
        return "\n".join(lines).strip(), None, ""
    a = starts[0]
    b = a
    while b < len(lines) and lines[b].startswith("|"):
        b += 1
    assert not any(line.startswith("|") for line in lines[b:]), "two tables in one section"
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[a:b]]
    headers, body = cells[0], cells[2:]
    rows = [{h: value(c) for h, c in zip(headers, row)} for row in body]
    return "\n".join(lines[:a]).strip(), rows, "\n".join(lines[b:]).strip()


def header(lines: list[str]) -> tuple[dict, list[str]]:
    """The leading `- key: value` bullets (continuation lines indented) and the lines after them."""
    i = 0
    while i < len(lines) and not lines[i].strip():
        i += 1
    fields: dict[str, str] = {}
    key = None
    while i < len(lines) and lines[i].strip():
        line = lines[i]
        m = re.match(r"- (\w[\w ]*): (.*)", line)
        if m:
            key = m.group(1)
            fields[key] = m.group(2).strip()
        elif line.startswith("  ") and key:
            fields[key] += " " + line.strip()
        else:
            break
        i += 1
    if not fields:
        return {}, lines
    return fields, lines[i:]


def versions(s: str | None) -> dict | None:
    if s is None:
        return None
    m = re.fullmatch(r"torch (\S+), triton (\S+), CUDA (\S+), python (\S+)", s)
    if not m:
        return {"raw": s}
    return dict(zip(("torch", "triton", "cuda", "python"), m.groups()), driver=None)


def to_record(title: str, body: list[str]) -> dict | None:
    fields, rest = header(body)
    context, rows, notes = split_table(rest)
    if not fields and rows is None:
        return None  # an introduction: the caller hands it to the next record
    bench = benchmark_of(title)
    date, commit = fields.pop("date", None), fields.pop("commit", None)
    if date and ", commit " in date and commit is None:
        date, commit = date.split(", commit ", 1)
    if date is None and re.search(r"\d{4}-\d{2}-\d{2}", title):
        date = re.search(r"\d{4}-\d{2}-\d{2}", title).group(0)  # "(2x H200, 2026-11-23)" in the title
    args: dict = {}
    for pattern, names, fixed in _TITLE_ARGS:
        m = re.fullmatch(pattern, title)
        if m:
            args = {**fixed, **{k: value(v) for k, v in zip(names, m.groups())}}
    if "masks" in title:
        args["masks"] = True
    lengths = list(dict.fromkeys(r["tokens/rank"] for r in rows or [] if isinstance(r.get("tokens/rank"), int)))
    if lengths:
        args["tokens_per_rank"] = lengths
    ceilings = {}
    for pattern, keys in ((_CEILING_NEW, ("matmul_tflops", "copy_tbps")), (_CEILING_OLD, ("matmul_tflops",))):
        m = pattern.search(notes)
        if m:
            ceilings = {k: value(v) for k, v in zip(keys, m.groups())}
            notes = (notes[: m.start()] + notes[m.end():]).strip()
    impls = [r.get("impl") for r in rows or [] if isinstance(r.get("impl"), str)]
    if bench == "kernels":
        peers = [i for i in dict.fromkeys(impls) if i != "ringflash"]
    else:
        peers = sorted({r["impl"] for r in rows or [] if str(r.get("impl", "")).startswith("torch CP")
                        and r.get("fwd+bwd ms") != "n/a"})
    return {
        "benchmark": bench, "title": title, "device": fields.pop("device", None), "date": date, "commit": commit,
        "versions": versions(fields.pop("versions", None)), "args": args, "results": rows or [], "peers": peers,
        "ceilings": ceilings, "notes": notes, "info": fields, "context": context, "source": SOURCE,
    }


def convert(text: str) -> list[dict]:
    parts = re.split(r"^## ", text, flags=re.M)[1:]
    records, intro = [], ""
    for part in parts:
        title, _, body = part.partition("\n")
        rec = to_record(title.strip(), body.splitlines())
        if rec is None:
            intro += f"**{title.strip()}**\n\n{body.strip()}\n\n"
            continue
        if intro:
            rec["context"] = (intro + rec["context"]).strip()
            intro = ""
        records.append(rec)
    assert not intro, "an introduction with nothing after it"
    return records


def main() -> None:
    records = convert(Path(sys.argv[1]).read_text())
    by_bench: dict[str, list[dict]] = {}
    for rec in records:
        by_bench.setdefault(rec["benchmark"], []).append(rec)
    BENCHMARKS_DIR.mkdir(exist_ok=True)
    for bench, recs in by_bench.items():
        path = BENCHMARKS_DIR / f"{bench}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
        print(f"{path}: {len(recs)} records")


if __name__ == "__main__":
    main()
