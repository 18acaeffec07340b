"""The ring benchmark's smoke run on CPU: the script keeps up with the ring's API.

Timings mean nothing here (gloo, tiny shapes, host wall clock); what is checked is that every
part of `launch/bench_ring.py --quick` runs and reports: the ring and compute-only rows, the
efficiency, and one K/V hop alone.
"""

from __future__ import annotations

import re

from tests.dist_utils import REPO, torchrun


def test_bench_ring_quick_runs_over_gloo(tmp_path):
    record = (REPO / "BENCHMARKS.md").read_bytes()
    out = torchrun(REPO / "launch" / "bench_ring.py", "--quick", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 256 | ringflash |")]
    assert len(rows) == 2, out.stdout  # zigzag and contiguous
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[3:]), row  # fwd, fwd+bwd, compute-only, single/W, efficiency, TFLOP/s
    assert re.search(r"One K/V hop alone .*: 256 tokens/rank, nccl: [0-9.e+-]+ ms for 0\.0625 MiB", out.stdout)
    assert "## Ring attention" in out.stdout  # printed,
    assert (REPO / "BENCHMARKS.md").read_bytes() == record  # not recorded


def test_bench_ring_rows_per_kernel_backend(tmp_path):
    out = torchrun(REPO / "launch" / "bench_ring.py", "--quick", "--layouts", "zigzag", "--no-torch-cp",
                   "--kernel-backends", "auto,reference", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    impls = [line.split("|")[2].strip() for line in out.stdout.splitlines() if line.startswith("| 256 | ringflash")]
    assert impls == ["ringflash", "ringflash [reference]"], out.stdout
    bad = torchrun(REPO / "launch" / "bench_ring.py", "--quick", "--kernel-backends", "cudnn", cwd=tmp_path)
    assert bad.returncode != 0 and "--kernel-backends: each must be one of" in bad.stderr, bad.stderr[-3000:]
