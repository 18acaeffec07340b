"""A value head dim of its own (DeepSeek's MLA: q·k over 192, v and o over 128): the kernels,
forward and backward, dense and with documents, through the ring-step arguments, against a
float64 ground truth with flash_attn's criterion; the backends that cannot run it say so."""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import AttnSpec, attn_bwd, attn_fwd, attn_varlen_bwd, attn_varlen_fwd
from ringflash.kernels.cudnn import check_cudnn
from ringflash.kernels.hopper_bwd import hopper_bwd_unsupported
from ringflash.kernels.hopper_fwd import hopper_fwd_unsupported
from tests.kernels.steps import BACKEND_DEVICES, bwd_step, fwd_step, skip_unless_runs
from tests.truth_features import assert_close, attention, band

# (D, Dv): MLA's, and small ones either way round (64 over 32 masks nothing; 32 over 64 widens o).
DIMS = [(192, 128), (64, 32), (32, 64)]
# (B, N, H, Hkv): a ragged length over several key blocks, GQA.
SHAPE = (1, 70, 4, 2)


def _inputs(B, N, H, Hkv, D, Dv, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
    return mk(B, N, H, D), mk(B, N, Hkv, D), mk(B, N, Hkv, Dv), mk(B, N, H, Dv)


def _ids(d):
    return f"{d[0]}-{d[1]}"


@pytest.mark.parametrize(("backend", "device"), BACKEND_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dims", DIMS, ids=_ids)
def test_matches_float64(dims, causal, dtype, backend, device):
    skip_unless_runs(backend, device)
    q, k, v, do = _inputs(*SHAPE, *dims, dtype, device)
    visible = band(SHAPE[1], SHAPE[1], causal=True).to(device) if causal else None
    truth = attention(q, k, v, visible=visible, do=do)
    naive = attention(q, k, v, visible=visible, do=do, dtype=dtype)
    o, lse = attn_fwd(q, k, v, causal=causal, backend=backend)
    assert o.shape == (*q.shape[:3], dims[1]) and o.dtype == dtype
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, causal=causal, backend=backend)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert_close(dict(o=o, dq=dq, dk=dk, dv=dv), truth, naive, dtype)
    assert (lse.double() - truth["lse"]).abs().max() < (1e-4 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(("backend", "device"), BACKEND_DEVICES)
@pytest.mark.parametrize("dims", DIMS[1:], ids=_ids)
def test_documents(dims, backend, device):
    # Packed documents (per-row key intervals) with a causal window: the masked kernel stages.
    skip_unless_runs(backend, device)
    lens, H, Hkv = [30, 1, 39], 4, 2
    T = sum(lens)
    q, k, v, do = (t[0] for t in _inputs(1, T, H, Hkv, *dims, torch.float32, device, seed=3))
    cu = torch.tensor([0, 30, 31, 70], dtype=torch.int32, device=device)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor(lens)).to(device)
    visible = (doc[:, None] == doc[None, :]) & band(T, T, 11, 0, causal=True).to(device)
    truth = attention(q[None], k[None], v[None], visible=visible, do=do[None])
    o, lse = attn_varlen_fwd(q, k, v, cu, causal=True, window_size=(11, 0), backend=backend)
    dq, dk, dv = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, window_size=(11, 0), backend=backend)
    got = dict(o=o[None], dq=dq[None], dk=dk[None], dv=dv[None])
    assert_close(got, truth, truth, torch.float32)


@pytest.mark.parametrize(("backend", "device"), BACKEND_DEVICES)
@pytest.mark.parametrize("dims", [(192, 128), (32, 64)], ids=_ids)
def test_ring_steps(dims, backend, device):
    # What a ring does with two key blocks: float32 partials, the second merged into them with o
    # rounded into a view of a wider buffer (out=), then the backward of each block added into
    # float32 sums (acc=) against the global (o, lse).
    skip_unless_runs(backend, device)
    q, k, v, do = _inputs(*SHAPE, *dims, torch.bfloat16, device, seed=4)
    half = SHAPE[1] // 2
    blocks = [(k[:, :half], v[:, :half]), (k[:, half:], v[:, half:])]
    o32, lse = fwd_step(q, *blocks[0], out_dtype=torch.float32, backend=backend)
    wide = torch.zeros(*q.shape[:3], 2 * dims[1], dtype=torch.bfloat16, device=device)
    o, _ = fwd_step(q, *blocks[1], acc=(o32, lse), out=wide[..., : dims[1]], backend=backend)
    assert not wide[..., dims[1] :].any()
    dq = torch.zeros(q.shape, device=device)
    dkv = []
    for kb, vb in blocks:
        sums = (dq, torch.zeros(kb.shape, device=device), torch.zeros(vb.shape, device=device))
        dkv.append(bwd_step(do, q, kb, vb, o, lse, grad_dtype=torch.float32, out=sums, acc=sums, backend=backend)[1:])
    truth = attention(q, k, v, do=do)
    naive = attention(q, k, v, do=do, dtype=torch.bfloat16)
    got = dict(o=o, dq=dq, dk=torch.cat([dkv[0][0], dkv[1][0]], 1), dv=torch.cat([dkv[0][1], dkv[1][1]], 1))
    assert_close(got, truth, naive, torch.bfloat16)


def test_kernel_op_takes_a_value_head_dim():
    # torch.compile's view of the kernels: the fake gives o v's head dim, the gradients their inputs'.
    q, k, v, _ = _inputs(*SHAPE, 64, 32, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    opts = dict(causal=True, backend="reference")
    torch.library.opcheck(torch.ops.ringflash.attn_fwd.default, (q, k, v, []), opts)
    o, _ = torch.ops.ringflash.attn_fwd(q, k, v, [], **opts)
    assert o.shape == (*q.shape[:3], 32)
    o.sum().backward()
    assert v.grad.shape == v.shape and k.grad.shape == k.shape


def test_compiled_op_matches_eager():
    q, k, v, _ = _inputs(*SHAPE, 64, 32, torch.float32)
    f = lambda q, k, v: torch.ops.ringflash.attn_fwd(q, k, v, [], causal=True, backend="reference")[0]
    got = torch.compile(f, fullgraph=True, backend="eager")(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    ((2, 70, 2, 32), r"v.shape\[:3\] \(batch, seqlen, heads\) must equal k's"),
    ((1, 70, 2, 300), r"v.shape\[3\] \(value head_dim\) must be in \[1, 256\], got 300"),
])  # fmt: skip
def test_bad_value_shapes_are_named(bad, match):
    q, k, _, _ = _inputs(*SHAPE, 64, 32, torch.float32)
    for backend in ("reference", "triton"):
        skip_unless_runs(backend, "cpu")
        with pytest.raises(ValueError, match=match):
            attn_fwd(q, k, torch.randn(bad), backend=backend)


def test_cudnn_refuses_it_by_name():
    q, k, v, _ = _inputs(*SHAPE, 64, 32, torch.bfloat16)
    with pytest.raises(ValueError, match=r"backend='cudnn' needs v.shape\[3\] \(value head_dim\) equal to q.shape"):
        check_cudnn(q, k, v, AttnSpec(causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Hopper kernels need an sm_90 GPU",
)
def test_hopper_reports_it_and_runs_the_triton_kernels():
    q, k, v, do = _inputs(*SHAPE, 128, 64, torch.bfloat16, "cuda")
    for why in (hopper_fwd_unsupported(q, k, v, AttnSpec()), hopper_bwd_unsupported(q, k, v, AttnSpec())):
        assert "needs v.shape[3] == q.shape[3] (one head dim), got 64 and 128" in why
    o, lse = attn_fwd(q, k, v, causal=True, backend="hopper")
    torch.testing.assert_close(o, attn_fwd(q, k, v, causal=True, backend="triton")[0], rtol=0, atol=0)
    got = attn_bwd(do, q, k, v, o, lse, causal=True, backend="hopper")
    want = attn_bwd(do, q, k, v, o, lse, causal=True, backend="triton")
    assert all(torch.equal(a, b) for a, b in zip(got, want))
