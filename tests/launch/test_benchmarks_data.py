"""Benchmark results as data: the record writer, BENCHMARKS.md generated from the records, the history.

`ringflash.bench.record` appends JSON lines to benchmarks/<benchmark>.jsonl, and
`launch/benchmarks_md.py` is the only writer of BENCHMARKS.md; these tests pin the format both
sides rely on, on CPU and without a GPU run.
"""

from __future__ import annotations

import json

import pytest

from ringflash.bench import RECORD_KEYS, record
from tests.dist_utils import REPO, launch_script

benchmarks_md = launch_script("benchmarks_md")


def test_record_appends_json_lines_with_every_key(tmp_path, capsys):
    headers = ["impl", "N", "fwd ms", "compute-only ms", "efficiency"]
    rows = [["ringflash", 8192, 5.123456, None, float("nan")], ["torch CP (flash)", 8192, 8.4, "", 0.75]]
    for _ in range(2):
        record("ring", "Ring attention, test", headers, rows, args={"world": 2}, peers=["torch CP (flash)"],
               ceilings={"matmul_tflops": 690.123}, notes="a note", directory=tmp_path)
    lines = (tmp_path / "ring.jsonl").read_text().splitlines()
    assert len(lines) == 2  # appended, one object a line
    rec = json.loads(lines[0])
    assert set(RECORD_KEYS) <= set(rec)
    assert rec["benchmark"] == "ring" and rec["title"] == "Ring attention, test" and rec["notes"] == "a note"
    assert {"device", "date", "commit"} <= set(rec) and all(isinstance(rec[k], str) for k in ("device", "date"))
    assert set(rec["versions"]) == {"torch", "triton", "cuda", "driver", "python"}
    assert rec["results"][0] == {"impl": "ringflash", "N": 8192, "fwd ms": 5.123, "compute-only ms": None,
                                 "efficiency": None}  # 4 significant digits; blank and NaN as null
    assert rec["results"][1]["compute-only ms"] is None
    assert rec["peers"] == ["torch CP (flash)"] and rec["ceilings"] == {"matmul_tflops": 690.1}
    assert "| ringflash | 8192 | 5.123 |  |  |" in capsys.readouterr().out  # printed as recorded


def test_record_without_a_directory_writes_nothing():
    before = {p: p.read_bytes() for p in (REPO / "benchmarks").iterdir()}
    rec = record("merge", "t", ["a"], [[1]], args={}, directory=None)
    assert rec["results"] == [{"a": 1}]
    assert {p: p.read_bytes() for p in (REPO / "benchmarks").iterdir()} == before


def _rec(title, date, commit, rows, **kw):
    return {"benchmark": "ring", "title": title, "device": "2x GPU", "date": date, "commit": commit,
            "versions": {"torch": "2.11", "triton": "3.6", "cuda": "13.0", "driver": None, "python": "3.12"},
            "args": {"world": 2}, "results": rows, "peers": [], "ceilings": {}, "notes": "", **kw}


def test_generator_renders_the_newest_record_of_each_table_newest_first(tmp_path):
    old = _rec("old run", "2026-11-22 20:00 UTC", "aaa1111", [{"impl": "ringflash", "ms": 6.26}])
    new = _rec("new run", "2026-11-23 09:36 UTC", "bbb2222", [{"impl": "ringflash", "ms": 5.0, "note": None}],
               peers=["torch CP (cudnn)"], ceilings={"kv_hop_alone": [
                   {"tokens_per_rank": 8192, "transport": "nccl", "ms": 0.25, "MiB": 64.0, "GB/s": 268.4}]})
    same_day = _rec("dated by day only", "2026-11-23", None, [{"impl": "ringflash", "ms": 5.5}])
    # Two earlier runs of "new run"'s table (one on another machine of the same GPUs) and a note on them
    superseded = _rec("new run", "2026-11-23 08:00 UTC", "ccc3333", [{"impl": "ringflash", "ms": 5.9}])
    elsewhere = _rec("new run", "2026-11-23 07:00 UTC", "ddd4444", [{"impl": "ringflash", "ms": 5.8}],
                     device="2x GPU (another host)")
    note = _rec("correction to the runs above", "2026-11-23 10:00 UTC", "eee5555", [], notes="read them as ...")
    other_device = _rec("new run", "2026-11-22 21:00 UTC", "fff6666", [{"impl": "ringflash", "ms": 4.1}],
                        device="4x GPU")
    records = (old, superseded, new, elsewhere, same_day, note, other_device)
    (tmp_path / "ring.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = benchmarks_md.render(benchmarks_md.load(tmp_path))
    order = ["- commit: bbb2222", "### dated by day only", "- commit: fff6666", "### old run"]
    assert [text.index(s) for s in order] == sorted(text.index(s) for s in order)
    for hidden in ("ccc3333", "ddd4444", "correction to the runs above"):
        assert hidden not in text
    expected = (
        "### new run\n\n"
        "- device: 2x GPU\n"
        "- date: 2026-11-23 09:36 UTC\n"
        "- commit: bbb2222\n"
        "- versions: torch 2.11, triton 3.6, CUDA 13.0, python 3.12\n"
        "- arguments: world=2\n"
        "- peers in the same run: torch CP (cudnn)\n"
        "- ceilings in the same run: one K/V hop alone (8192 tokens/rank, nccl): 0.25 ms for 64 MiB (268.4 GB/s)\n"
        "\n"
        "| impl | ms | note |\n"
        "|---|---|---|\n"
        "| ringflash | 5 |  |\n"
    )
    assert expected in text
    assert "`benchmarks/ring.jsonl`, 7 records, 4 tables shown, newest 2026-11-23 10:00 UTC at eee5555" in text


def test_generated_file_is_up_to_date():
    assert benchmarks_md.main(["--check"]) == 0, "run: python launch/benchmarks_md.py"


# Converted from the hand-kept BENCHMARKS.md by the one-off launch/convert_benchmarks_md.py (commit b91a71c):
# 56 sections, two introductions folded into the run after them.
HISTORY = {"kernels": 12, "ring": 34, "steps": 2, "merge": 1, "training": 5}


@pytest.mark.parametrize("bench", sorted(HISTORY))
def test_committed_history_parses(bench):
    lines = (REPO / "benchmarks" / f"{bench}.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    history = [r for r in records if r.get("source", "").startswith("BENCHMARKS.md at 4e79a42")]
    assert len(history) == HISTORY[bench]
    for rec in records:
        assert set(RECORD_KEYS) <= set(rec) and rec["benchmark"] == bench
        assert all(isinstance(row, dict) for row in rec["results"])
