"""Tensors on any GPU: rank r puts its tensors on `cuda:r` and never calls `torch.cuda.set_device`
(as ring-flash-attention's test scripts and many users' scripts do), so every rank but rank 0
calls the library with device 0 current. The kernels (each backend), the ring over NCCL (each
transport) and the cross-rank check must run on the inputs' GPU, give the same results as on
one device, and leave the current device as they found it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringflash import ring_flash_attn_func, shard
from ringflash.kernels import attn_bwd, attn_fwd
from tests.dist_utils import run_ranks

B, N_LOCAL, H, HKV, D = 1, 1024, 8, 2, 128
_sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _rel(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def _worker(rank, world, backend, transport):
    assert torch.cuda.current_device() == 0  # nobody called set_device
    dev = torch.device("cuda", rank)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, N_LOCAL * world, h, D, generator=g).to(dev, torch.bfloat16)
                   for h in (H, HKV, HKV, H))  # fmt: skip
    # One device: the kernels' own API, on this rank's GPU.
    o1, lse1 = attn_fwd(q, k, v, causal=True, backend=backend)
    single = [o1, *attn_bwd(do, q, k, v, o1, lse1, causal=True, backend=backend)]
    # float32 SDPA on the whole sequence: the reference both are measured against.
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    rep = [leaves[0], *(t.repeat_interleave(H // HKV, dim=2) for t in leaves[1:])]
    ref_o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in rep), is_causal=True).transpose(1, 2)
    ref_o.backward(do.float())
    ref = [ref_o.detach(), *(t.grad for t in leaves)]
    # The ring on this rank's shard.
    local = [shard(t, 1, rank, world).detach().requires_grad_() for t in (q, k, v)]
    o = ring_flash_attn_func(*local, causal=True, group=dist.group.WORLD, backend=backend, transport=transport)
    o.backward(shard(do, 1, rank, world))
    ring = [o, *(t.grad for t in local)]
    assert all(t.device == dev for t in ring)
    for name, r, s, want in zip(("o", "dq", "dk", "dv"), ring, single, ref):
        want = shard(want, 1, rank, world)
        err, base = _rel(r, want), _rel(shard(s, 1, rank, world), want)
        assert err <= 2 * base + 1e-4, f"rank {rank} {name}: ring {err:.3g}, one device {base:.3g}"
    torch.cuda.synchronize(dev)
    assert torch.cuda.current_device() == 0  # the library left it as it found it
    return True


@pytest.mark.multigpu
@pytest.mark.parametrize("transport", ["nccl", "copy-engine"])
@pytest.mark.parametrize(
    "backend", ["triton", "cudnn", pytest.param("hopper", marks=pytest.mark.skipif(not _sm90, reason="needs sm_90"))]
)
def test_ring_runs_on_the_inputs_gpu_without_set_device(backend, transport):
    world = min(torch.cuda.device_count(), 4)
    results = run_ranks(_worker, world, (backend, transport), backend="nccl", start_method="spawn", timeout_s=240)
    assert results == [True] * world
