"""The backends' step API with the public functions' mask arguments, for tests that check both
the kernels' results and their write / merge / accumulate modes on the same calls; and the
(backend, device) pairs a kernel test runs on."""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import AttnSpec, get_backend, interpreting

_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# The CPU pairs run in the CPU suite (the Triton kernels under the interpreter), the CUDA ones under -m gpu.
BACKEND_DEVICES = [
    ("reference", "cpu"),
    ("triton", "cpu"),
    pytest.param("triton", "cuda", marks=pytest.mark.gpu),
    pytest.param("hopper", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _sm90, reason="needs sm_90")]),
]


def skip_unless_runs(backend: str, device: str) -> None:
    if device == "cpu" and backend == "triton" and not interpreting():
        pytest.skip("the Triton kernels run on CPU only in the interpreter (the CPU suite)")


def _spec(causal, window, visibility) -> AttnSpec:
    if visibility is not None:
        return AttnSpec(intervals=visibility, causal=causal, window=window)
    return AttnSpec(causal=causal, window=window)


def fwd_step(q, k, v, *, causal=False, softmax_scale=None, window=None, visibility=None, backend=None, **step):
    """`Backend.fwd_step` (out_dtype=, acc=, out=) of the backend `backend` names."""
    return get_backend(backend, q.device).fwd_step(q, k, v, _spec(causal, window, visibility), softmax_scale, **step)


def bwd_step(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, window=None, visibility=None, backend=None,
             **step):
    """`Backend.bwd_step` (grad_dtype=, out=, accumulate=, acc=, after_dkdv=) of the backend `backend` names."""
    spec = _spec(causal, window, visibility)
    return get_backend(backend, q.device).bwd_step(do, q, k, v, o, lse, spec, softmax_scale, **step)
