"""launch/kernel_report.py compiles the Triton kernels for an H100 on this CPU machine and reads ptxas.

What is checked is that the report keeps up with the kernels (their constexprs and arguments) and
parses what ptxas says; the register counts themselves are the installed Triton's and not asserted.
It runs as its own process: the test suite's interpreter (TRITON_INTERPRET=1) compiles nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.dist_utils import REPO


def _report(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(REPO / "launch" / "kernel_report.py"), *args], env=env, cwd=REPO.parent,
                          capture_output=True, text=True, timeout=600)


def _rows(out: str, kernel: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in out.splitlines()
            if line.startswith(f"| {kernel} |")]


def test_every_kernel_compiles_for_sm90_and_ptxas_reports_it():
    out = _report("--head-dims", "64", "--causal", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    # hopper_*: Gluon, compiled the same way; hopper_fwd_step: its merging epilogue, as a ring runs it
    for kernel in ("fwd", "dkdv", "dq", "hopper_fwd", "hopper_fwd_step", "hopper_bwd"):
        (row,) = _rows(out.stdout, kernel)
        registers, spilled, shared_kb, serialised = row[5], row[6], row[7], row[8]
        assert 0 < int(registers) <= 255, row  # ptxas's ceiling per thread
        assert re.fullmatch(r"\d+ / \d+", spilled), row
        assert 0 < int(shared_kb) <= 228, row  # an H100's shared memory per block
        assert serialised in ("no", "yes (C7514)"), row


def test_softcap_variant_compiles_for_sm90():
    # The SOFTCAP branch of the Triton kernels, which the CPU suite runs only in the interpreter,
    # and of the Gluon kernels (tanh on the MUFU), which it never runs: neither spills at D64.
    out = _report("--kernels", "fwd", "dkdv", "dq", "hopper_fwd", "hopper_bwd", "--head-dims", "64", "--causal", "1",
                  "--softcap")
    assert out.returncode == 0, out.stderr[-3000:]
    for kernel in ("fwd", "dkdv", "dq", "hopper_fwd", "hopper_bwd"):
        (row,) = _rows(out.stdout, kernel)
        assert 0 < int(row[5]) <= 255, row
    for kernel in ("hopper_fwd", "hopper_bwd"):
        (row,) = _rows(out.stdout, kernel)
        assert row[6] == "0 / 0", row  # the backward's tile shrinks with a softcap for this


def test_interval_variant_of_the_gluon_kernels_compiles_for_sm90():
    # RANGES: per-row key intervals (documents, windows, a ring step's rectangle), which the GPU
    # tests run and the CPU suite otherwise never compiles. One head dim: each build takes seconds.
    out = _report("--kernels", "hopper_fwd", "hopper_fwd_step", "hopper_bwd", "--head-dims", "128", "--causal", "0",
                  "--ranges")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "per-row key intervals" in out.stdout
    for kernel in ("hopper_fwd", "hopper_fwd_step", "hopper_bwd"):
        (row,) = _rows(out.stdout, kernel)
        assert 0 < int(row[5]) <= 255, row
    bad = _report("--kernels", "fwd", "--ranges")
    assert bad.returncode == 2 and "--ranges: the Gluon kernels' variant" in bad.stderr


def test_tiles_given_are_reported_one_row_each_and_bad_ones_refused_by_name():
    out = _report("--kernels", "dkdv", "--head-dims", "64", "--causal", "1", "--group", "8",
                  "--tiles", "64,64,4,3", "128,32,4,3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [row[4] for row in _rows(out.stdout, "dkdv")] == ["(64, 64, 4, 3)", "(128, 32, 4, 3)"]
    bad = _report("--tiles", "128,64,8")
    assert bad.returncode == 2 and "--tiles: expected outer,inner,warps,stages" in bad.stderr, bad.stderr


def test_value_head_dim_variant_compiles_for_sm90():
    # DeepSeek's MLA shape: q·k over 192 (pointer loads, masked to 256), v and o over 128.
    out = _report("--kernels", "fwd", "dkdv", "dq", "--head-dims", "192", "--dv", "128", "--causal", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    for kernel in ("fwd", "dkdv", "dq"):
        (row,) = _rows(out.stdout, kernel)
        assert 0 < int(row[5]) <= 255 and 0 < int(row[7]) <= 228, row
    bad = _report("--kernels", "hopper_fwd", "--dv", "128")
    assert bad.returncode == 2 and "--dv: the Gluon kernels run one head dim" in bad.stderr, bad.stderr
