"""Test-suite set-up shared by every test module.

Two suites share these files:
- the CPU suite (`python -m pytest`, what CI runs): the Triton kernels run in Triton's
  interpreter, the ring as gloo processes. It is the same run on every machine: on one with
  GPUs, they are hidden from it.
- the GPU suites (`-m gpu`, `-m multigpu`): compiled kernels on CUDA tensors, NCCL rings.
One process cannot do both (the interpreter is switched on for the whole process, before
`triton` is first imported), so the marker expression picks. `pytest_configure` runs before any
test module is imported and before anything asks CUDA for its devices.
"""

import os
import tempfile

import pytest
import torch

_GPU_MARKERS = ("gpu", "multigpu")


def _selects_gpu_tests(markexpr: str) -> bool:
    words = markexpr.replace("(", " ").replace(")", " ").split()
    return "not" not in words and any(m in words for m in _GPU_MARKERS)


def pytest_configure(config):
    # torch.compile's on-disk cache can hand a test a graph compiled against an earlier version of
    # a custom op's fake implementation: every session (and the ranks it starts) compiles afresh.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ringflash-inductor-"))
    if not _selects_gpu_tests(config.getoption("markexpr") or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # inherited by the ranks the tests start
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    how = "; GPU tests run with `python -m pytest -m gpu` (or multigpu)"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU" + how)
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs" + how)
    for item in items:
        if "gpu" in item.keywords and n_gpus < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)
