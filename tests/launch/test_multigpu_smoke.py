"""Smoke tests of issue 29's multi-GPU scripts on CPU gloo: the hybrid exactness check of
launch/check_ring_nccl.py (4 ranks, U = 2; the all-gather scheme and the attention features) and
launch/bench_scaling.py --smoke with its record, every scheme and packed documents; a row failing
on any rank is skipped on all.

They launch torchrun, so they are in the slow set (pytest -m slow)."""

from __future__ import annotations

import json

import pytest
import torch

from ringflash.plan import model_version
from tests.dist_utils import REPO, launch_script, run_ranks, torchrun

pytestmark = pytest.mark.slow  # torchrun launches
bench_scaling = launch_script("bench_scaling")  # in the parent, once: forked ranks inherit it


def test_check_ring_nccl_hybrid_passes_on_gloo(tmp_path):
    out = torchrun(REPO / "launch" / "check_ring_nccl.py", "--head-parallel", "2", "--tokens-per-rank", "64",
                   "--head-dim", "32", nproc=4, cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hybrid u=2 head x r=2 ring over 4 gloo ranks" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "PASS", out.stdout
    assert "FAIL" not in out.stdout


@pytest.mark.parametrize(
    "args, header",
    [(("--scheme", "allgather", "--head-parallel", "2", "--window-size", "40,0"), "hybrid u=2 head x r=2 allgather"),
     (("--softcap", "5", "--sink", "--window-size", "30,9"), "ring over 4 gloo ranks")],
)  # fmt: skip
def test_check_ring_nccl_features_pass_on_gloo(tmp_path, args, header):
    # The features' naive references: a window, softcapping and a sink's gradient summed over ranks.
    out = torchrun(REPO / "launch" / "check_ring_nccl.py", *args, "--tokens-per-rank", "32", "--head-dim", "16",
                   nproc=4, cwd=tmp_path, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert header in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "PASS", out.stdout
    assert "FAIL" not in out.stdout and ("dsink" in out.stdout) == ("--sink" in args)


def test_bench_scaling_smoke_records_every_scheme_and_mask_with_prediction(tmp_path):
    out = torchrun(REPO / "launch" / "bench_scaling.py", "--smoke", "--shapes", "gqa", "--docs", "--record-to",
                   str(tmp_path), nproc=2, cwd=tmp_path, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    lines = (tmp_path / "scaling.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert rec["benchmark"] == "scaling" and rec["args"]["world"] == 2 and rec["args"]["smoke"]
    assert rec["args"]["schemes"] == ["ring", "allgather"] and rec["args"]["docs"]
    assert rec["args"]["plan_model"] == model_version()  # the model beside its predictions (plan_validation)
    rows = {(row["scaling"], row["impl"], row["scheme"], row["mask"] == "dense causal"): row for row in rec["results"]}
    # W = 2: u = 1 once per scheme, u = 2 (head-parallel, r = 1: no scheme) once; weak and strong; dense and docs.
    runs = [("ring", "ring"), ("allgather", "allgather"), ("head-parallel", None)]
    assert set(rows) == {(m, i, s, d) for m in ("weak", "strong") for i, s in runs for d in (True, False)}
    assert len(rec["results"]) == len(rows)
    for (*_, dense), row in rows.items():
        assert row["u"] * row["r"] == 2 and row["fwd+bwd ms"] > 0 and row["TFLOP/s/GPU"] > 0
        if not dense:
            assert " docs 4–32" in row["mask"] and 0 < row["visible"] < 1 and row["efficiency"] is None
            continue
        assert row["visible"] == 1 and row["efficiency"] > 0
        assert row["predicted ms"] > 0 and 0 < row["predicted efficiency"] <= 1.5
    printed = [line for line in out.stdout.splitlines() if line.startswith("| weak | 2 | gqa |")]
    assert len(printed) == 2 * 6  # each row as it finished, then in the record's table


def _fail_on(rank, world, failing):
    """bench_scaling.guarded on `world` gloo ranks, `fn` raising out of memory on the ranks in `failing`."""

    def fn():
        if rank in failing:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return 1.5

    return bench_scaling.guarded(fn, torch.device("cpu"))


@pytest.mark.parametrize("failing", [(), (0, 1), (1,)])
def test_bench_scaling_skips_a_row_that_fails_on_any_rank(failing):
    results = run_ranks(_fail_on, 2, args=(failing,))
    if not failing:
        assert results == [(1.5, ""), (1.5, "")]
        return
    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert results == [(None, oom if r in failing else "failed on another rank") for r in range(2)]
