"""`backend="cudnn"`: cuDNN's attention behind the kernel contract (kernels/cudnn.py).

On a GPU (`-m gpu`): results against float64 attention, the ring-step arguments (`acc=`, `out=`,
`accumulate=`, global `o`/`lse`), strided views and GQA. On CPU: the arguments it refuses, each
error naming what is wrong.
"""

from __future__ import annotations

import pytest
import torch

from ringflash import kernels
from ringflash.kernels import FULL, AttnSpec, attn_bwd, attn_fwd, backend_named, dense_visibility
from ringflash.kernels.cudnn import cudnn_attn_bwd, cudnn_attn_fwd
from tests.kernels.steps import bwd_step, fwd_step
from tests.truth import TOL, attention_f64, lse_err, rel_err

gpu = pytest.mark.gpu


def _inputs(B, Nq, Nk, H, Hkv, D, dtype, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Nq, H, D, generator=g).to(device, dtype)
    k = torch.randn(B, Nk, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(B, Nk, Hkv, D, generator=g).to(device, dtype)
    do = torch.randn(B, Nq, H, D, generator=g).to(device, dtype)
    return q, k, v, do


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    ("B", "Nq", "Nk", "H", "Hkv", "D", "causal"),
    [
        (2, 300, 300, 4, 4, 128, True),
        (1, 256, 700, 4, 4, 64, False),  # a ring step's rectangle: more keys than queries
        (2, 200, 200, 8, 2, 128, True),  # GQA
    ],
)
def test_matches_float64(B, Nq, Nk, H, Hkv, D, causal, dtype):
    q, k, v, do = _inputs(B, Nq, Nk, H, Hkv, D, dtype)
    truth = attention_f64(q, k, v, causal, do=do)
    o, lse = attn_fwd(q, k, v, causal=causal, backend="cudnn")
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (B, H, Nq)
    assert rel_err(o, truth["o"]) < TOL[dtype]
    assert lse_err(lse, truth["lse"]) < 1e-2  # natural log, as the contract says
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, causal=causal, backend="cudnn")
    for name, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert got.dtype == dtype
        assert rel_err(got, truth[name]) < TOL[dtype], name


@gpu
def test_views_of_a_packed_qkv_and_a_scale():
    # q, k, v as views of one (B, N, 3, H, D) buffer, as a fused QKV projection gives them.
    B, N, H, D = 2, 333, 4, 64
    qkv = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(2)
    do = torch.randn_like(q)
    truth = attention_f64(q, k, v, True, scale=0.2, do=do)
    o, lse = attn_fwd(q, k, v, causal=True, softmax_scale=0.2, backend="cudnn")
    grads = attn_bwd(do, q, k, v, o, lse, causal=True, softmax_scale=0.2, backend="cudnn")
    assert rel_err(o, truth["o"]) < TOL[torch.bfloat16]
    for name, got in zip(("dq", "dk", "dv"), grads):
        assert rel_err(got, truth[name]) < TOL[torch.bfloat16], name


@gpu
def test_ring_steps_merge_and_sum_to_attention_over_all_keys():
    # Keys in three disjoint parts, as three ring steps: the first causal (the diagonal, starting
    # float32 accumulators), the others merged in (`acc=`), the last written rounded (`out=`).
    # Backward with the global o and lse: step 0 writes float32 sums, later steps add to them,
    # the last writes the totals rounded. Both must equal attention over all keys.
    B, N, H, D, dt = 1, 256, 4, 128, torch.bfloat16
    q, k, v, do = _inputs(B, N, 3 * N, H, H, D, dt, seed=3)
    parts = [slice(0, N), slice(N, 2 * N), slice(2 * N, 3 * N)]
    mask = torch.ones(N, 3 * N, dtype=torch.bool).tril(diagonal=0)
    mask[:, N:] = True
    truth = _masked_f64(q, k, v, do, mask.cuda())

    o, lse = fwd_step(q, k[:, parts[0]], v[:, parts[0]], causal=True, out_dtype=torch.float32, backend="cudnn")
    fwd_step(q, k[:, parts[1]], v[:, parts[1]], acc=(o, lse), backend="cudnn")
    out = torch.empty_like(q)
    ret = fwd_step(q, k[:, parts[2]], v[:, parts[2]], acc=(o, lse), out=out, backend="cudnn")
    assert ret[0] is out and ret[1] is lse
    assert rel_err(out, truth["o"]) < TOL[dt]
    assert lse_err(lse, truth["lse"]) < 1e-2

    dq = torch.empty(q.shape, device="cuda")
    dkv = torch.zeros((2, *k.shape), device="cuda")  # each part's keys: nothing summed yet
    final = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    for i, p in enumerate(parts):
        sums = (dq, dkv[0][:, p], dkv[1][:, p])
        last = i == len(parts) - 1
        bwd_step(do, q, k[:, p], v[:, p], out, lse, causal=i == 0, grad_dtype=dt if last else torch.float32,
                 out=(final[0], final[1][:, p], final[2][:, p]) if last else sums,
                 acc=None if i == 0 else sums, backend="cudnn")
    # the last step wrote only its own keys' dK/dV rounded; the others are the float32 sums
    final[1][:, :2 * N].copy_(dkv[0][:, :2 * N])
    final[2][:, :2 * N].copy_(dkv[1][:, :2 * N])
    for name, got in zip(("dq", "dk", "dv"), final):
        assert got.dtype == dt
        assert rel_err(got, truth[name]) < TOL[dt], name


def _masked_f64(q, k, v, do, mask):
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * q.shape[-1] ** -0.5
    s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v64)
    o.backward(do.double())
    return dict(o=o.detach(), lse=torch.logsumexp(s, -1).detach(), dq=q64.grad, dk=k64.grad, dv=v64.grad)


@gpu
def test_accumulate_adds_to_out():
    q, k, v, do = _inputs(1, 128, 128, 2, 2, 64, torch.float16, seed=5)
    o, lse = attn_fwd(q, k, v, causal=True, backend="cudnn")
    grads = bwd_step(do, q, k, v, o, lse, causal=True, grad_dtype=torch.float32, backend="cudnn")
    start = tuple(torch.randn_like(g) for g in grads)
    out = tuple(s.clone() for s in start)
    bwd_step(do, q, k, v, o, lse, causal=True, grad_dtype=torch.float32, out=out, accumulate=True, backend="cudnn")
    for got, s, g in zip(out, start, grads):
        torch.testing.assert_close(got, s + g)


@gpu
@pytest.mark.parametrize("n_keys", [96, 0])
def test_the_ring_step_contract(n_keys):
    # What tests/kernels/test_kernels_out.py checks of the Triton kernels, with cuDNN's rounded block
    # gradients (so tolerances, not bit-equality): `acc=` is only read and the totals written to
    # `out` rounded; `after_dkdv` runs once, with dK/dV final and dQ not yet written; no keys
    # means zero gradients, or sums unchanged.
    q, k, v, do = _inputs(2, 80, 96, 4, 2, 64, torch.bfloat16, seed=7)
    k, v = k[:, :n_keys], v[:, :n_keys]
    if n_keys:
        o, lse = attn_fwd(q, k, v, backend="cudnn")
        grads = bwd_step(do, q, k, v, o, lse, grad_dtype=torch.float32, backend="cudnn")
    else:
        o, lse = torch.zeros_like(q), torch.full((2, 4, 80), float("-inf"), device="cuda")
        grads = (torch.zeros(q.shape, device="cuda"), torch.zeros(k.shape, device="cuda"),
                 torch.zeros(v.shape, device="cuda"))
    gen = torch.Generator().manual_seed(8)
    sums = tuple(torch.randn(g.shape, generator=gen).cuda() for g in grads)
    before = tuple(t.clone() for t in sums)
    out = (torch.full_like(q, 7.0), torch.full_like(k, 7.0), torch.full_like(v, 7.0))
    seen = []

    def hook():
        torch.cuda.synchronize()
        seen.append((all(rel_err(out[i], sums[i] + grads[i]) < 1e-2 for i in (1, 2)), bool((out[0] == 7.0).all())))

    ret = bwd_step(do, q, k, v, o, lse, out=out, acc=sums, after_dkdv=hook, backend="cudnn")
    assert all(r is t for r, t in zip(ret, out))
    assert seen == [(True, True)]
    for got, s, b, g in zip(out, sums, before, grads):
        assert torch.equal(s, b)  # acc is read, never written
        assert rel_err(got, b + g) < 1e-2


@gpu
def test_partials_in_the_inputs_dtype_change_nothing():
    # A W = 2 ring keeps cuDNN's step-0 o and gradients in bf16 (`Backend.partial_dtype`), not in
    # float32 copies: the last step's merge and sums must come out bit-identical either way.
    assert kernels.backend_named("cudnn").partial_dtype(torch.bfloat16) == torch.bfloat16
    B, N, H, D, dt = 1, 256, 4, 128, torch.bfloat16
    q, k, v, do = _inputs(B, N, 2 * N, H, 2, D, dt, seed=9)
    results = {}
    for partial in (torch.float32, dt):
        o, lse = fwd_step(q, k[:, :N], v[:, :N], causal=True, out_dtype=partial, backend="cudnn")
        assert o.dtype == partial
        out = torch.empty_like(q)
        fwd_step(q, k[:, N:], v[:, N:], acc=(o, lse), out=out, backend="cudnn")
        sums = bwd_step(do, q, k[:, :N], v[:, :N], out, lse, causal=True, grad_dtype=partial, backend="cudnn")
        final = (torch.empty_like(q), torch.empty_like(k[:, N:]), torch.empty_like(v[:, N:]))
        zeros = (sums[0], torch.zeros_like(final[1], dtype=partial), torch.zeros_like(final[2], dtype=partial))
        bwd_step(do, q, k[:, N:], v[:, N:], out, lse, out=final, acc=zeros, backend="cudnn")
        results[partial] = (out, lse, *final, *(g.to(dt) for g in sums[1:]))
    for a, b in zip(results[torch.float32], results[dt]):
        assert torch.equal(a, b)


@gpu
def test_o_is_contiguous_whatever_q_strides():
    # cuDNN writes o in q's stride order; the contract (and the ring, and torch.compile's fake
    # implementations) promise a contiguous o, as the Triton kernels return.
    q, k, v, _ = _inputs(1, 128, 128, 4, 4, 64, torch.bfloat16, seed=11)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, N, D) memory, seen as (B, N, H, D)
    o, lse = attn_fwd(q, k, v, causal=True, backend="cudnn")
    assert not q.is_contiguous() and o.is_contiguous() and lse.is_contiguous()
    torch.testing.assert_close(o, attn_fwd(q.contiguous(), k, v, causal=True, backend="cudnn")[0], atol=0, rtol=0)


def test_refuses_masks_and_float32_naming_them():
    q, k, v, do = _inputs(1, 16, 16, 2, 2, 32, torch.bfloat16, device="cpu")
    with pytest.raises(ValueError, match="windows and document masks"):
        cudnn_attn_fwd(q, k, v, AttnSpec(causal=True, window=4))
    with pytest.raises(ValueError, match="windows and document masks"):
        cudnn_attn_bwd(do, q, k, v, q, torch.zeros(1, 2, 16), AttnSpec(intervals=dense_visibility(16, window=4)))
    with pytest.raises(TypeError, match=r"float16 or bfloat16 inputs, got torch\.float32"):
        cudnn_attn_fwd(q.float(), k.float(), v.float(), FULL)
    with pytest.raises(ValueError, match="needs CUDA tensors, got q on cpu"):
        cudnn_attn_fwd(q, k, v, FULL)
    # What a config can be told before any tensor exists.
    cudnn = backend_named("cudnn")
    assert cudnn.supports("causal", torch.bfloat16, 128) is None
    assert "windows and document masks" in cudnn.supports("window", None, None)
    assert "windows and document masks" in cudnn.supports("intervals", None, None)
    assert "float16 or bfloat16" in cudnn.supports(None, torch.float32, None)
    assert "multiple of 8" in cudnn.supports(None, None, 60)


@gpu
def test_ring_refuses_what_cudnn_cannot_run_before_the_ring_starts(monkeypatch):
    # Checked in the API with the other arguments, not by cuDNN in the middle of a ring: the op that
    # runs the ring must not even be called.
    import ringflash
    from ringflash import api, ring_flash_attn_func

    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 64, torch.bfloat16)
    o = ring_flash_attn_func(q, k, v, causal=True, backend="cudnn")  # one rank: a single cuDNN call
    torch.testing.assert_close(o, attn_fwd(q, k, v, causal=True, backend="cudnn")[0], atol=0, rtol=0)

    def started(*args, **kwargs):
        raise AssertionError("the ring started")

    monkeypatch.setattr(api.ops, "ring_attn_eager", started)
    with pytest.raises(ValueError, match="backend='cudnn' runs causal or full attention only"):
        ring_flash_attn_func(q, k, v, causal=True, window_size=(15, 0), backend="cudnn")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        ring_flash_attn_func(q.float(), k.float(), v.float(), causal=True, backend="cudnn")
    q60, k60, v60 = (t[..., :60] for t in (q, k, v))
    with pytest.raises(ValueError, match=r"q.shape\[3\] \(head_dim\) a multiple of 8"):
        ring_flash_attn_func(q60, k60, v60, causal=True, backend="cudnn")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    with pytest.raises(ValueError, match="not deterministic"):
        ring_flash_attn_func(q, k, v, causal=True, backend="cudnn")
    with pytest.raises(ValueError, match="backend='cudnn' runs causal or full attention only"):
        ringflash.RingFlashAttention(backend="cudnn", window_size=(15, 0))
