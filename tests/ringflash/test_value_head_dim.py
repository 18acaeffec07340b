"""A value head dim of its own through the ring's checks: what one rank gets wrong, or the ranks
disagree on, or a backend cannot run, raises on every rank, naming `v.shape[3]`. (Exactness with
it: tests/ringflash/test_ring.py, test_allgather.py, test_hybrid.py, test_hf_features.py.)"""

from __future__ import annotations

import pytest
import torch

from ringflash import ring_flash_attn_func, shard
from tests.dist_utils import run_ranks

OTHER = r"rank\(s\) \[1\] of the group rejected"


def _inputs(rank, world, dv, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    B, n, H, Hkv, D = 1, 8, 4, 2, 16
    q, k = torch.randn(B, world * n, H, D, generator=g), torch.randn(B, world * n, Hkv, D, generator=g)
    v = torch.randn(B, world * n, Hkv, dv, generator=g)
    return [shard(t, 1, rank, world, "zigzag").to(device, dtype) for t in (q, k, v)]


def _error_worker(rank, world, what, scheme):
    dv = {"differs": 8 if rank == 1 else 24, "too_large": 300 if rank == 1 else 24}[what]
    q, k, v = _inputs(rank, world, dv)
    if what == "differs":  # each rank's own input is fine: the agreement check names it
        expect = r"v.shape\[3\] is 24 on ranks 0, 2, 8 on rank 1"
    else:
        expect = r"v.shape\[3\] \(value head_dim\) must be in \[1, 256\], got 300" if rank == 1 else OTHER
    with pytest.raises(ValueError, match=expect) as err:
        ring_flash_attn_func(q, k, v, causal=True, scheme=scheme)
    q, k, v = _inputs(rank, world, 24)
    ring_flash_attn_func(q, k, v, causal=True, scheme=scheme)  # nothing left in flight: the group still runs
    return str(err.value)


@pytest.mark.parametrize("scheme", ["ring", "allgather"])
@pytest.mark.parametrize("what", ["differs", "too_large"])
def test_bad_value_head_dims_raise_on_every_rank(what, scheme):
    assert len(run_ranks(_error_worker, 3, (what, scheme), timeout_s=30)) == 3


def _cudnn_worker(rank, world):
    torch.cuda.set_device(0)  # the ranks share one GPU (gloo stages through host memory)
    q, k, v = _inputs(rank, world, 64, "cuda", torch.bfloat16)
    with pytest.raises(ValueError, match=r"backend='cudnn' needs v.shape\[3\] \(value head_dim\) equal to q.shape"):
        ring_flash_attn_func(q, k, v, causal=True, backend="cudnn")
    return ring_flash_attn_func(q, k, v, causal=True, backend="hopper").shape  # the Triton kernels run it


@pytest.mark.gpu
def test_cudnn_refuses_it_on_every_rank():
    shapes = run_ranks(_cudnn_worker, 2, start_method="spawn", timeout_s=120)
    assert shapes == [torch.Size([1, 8, 4, 64])] * 2
