"""`fwd_step(acc=(o_acc, lse_acc), out=...)`: the forward merges its result into a running float32
accumulator (in place, or written rounded to `out`).

This is a ring step in one launch: the accumulator holds attention over the keys seen so far, the
call adds a disjoint set of keys. Checked against float64 attention over the union of keys, on
both backends, with the accumulator given as strided views of larger buffers (as the ring's
`o[:, rows]`, `lse[:, :, rows]` are) and with rows that saw no key on either side or both.
"""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import attn_fwd, ref_merge
from tests.kernels.steps import fwd_step
from tests.truth import TOL, attention_f64, lse_err, rel_err

BACKENDS = ["triton", "reference"]
NEG_INF = float("-inf")


def _inputs(B, N, Nk, H, Hkv, D, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, N, H, D, generator=g) * scale).to(dtype)
    k = (torch.randn(B, Nk, Hkv, D, generator=g) * scale).to(dtype)
    v = torch.randn(B, Nk, Hkv, D, generator=g).to(dtype)
    return q, k, v


def _acc_views(B, N, H, D, pad=5):
    """A float32 accumulator `(B, N, H, D)`, `(B, H, N)` as row-slices of larger buffers, poisoned
    outside the slice so that a kernel writing the wrong rows is caught."""
    o_big = torch.full((B, N + 2 * pad, H, D), 7.0)
    lse_big = torch.full((B, H, N + 2 * pad), 7.0)
    return o_big, lse_big, o_big[:, pad : pad + N], lse_big[:, :, pad : pad + N]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("H", "Hkv", "D"), [(4, 2, 64), (2, 2, 96)])
def test_merged_equals_attention_over_union(H, Hkv, D, dtype, backend):
    # Keys in three disjoint parts; the first starts the accumulator (causal diagonal block, as
    # ring step 0), the other two are merged in by the kernel. Scores are scaled up so that the
    # parts' lse differ by several nats.
    B, N, Nk = 2, 70, 70 + 45 + 33
    q, k, v = _inputs(B, N, Nk, H, Hkv, D, dtype, seed=1, scale=1.5)
    parts = [slice(0, N), slice(N, N + 45), slice(N + 45, Nk)]
    o_big, lse_big, o_acc, lse_acc = _acc_views(B, N, H, D)
    o0, l0 = fwd_step(q, k[:, parts[0]], v[:, parts[0]], causal=True, out_dtype=torch.float32, backend=backend)
    o_acc.copy_(o0)
    lse_acc.copy_(l0)
    for p in parts[1:]:
        ret = fwd_step(q, k[:, p], v[:, p], acc=(o_acc, lse_acc), backend=backend)
        assert ret[0].data_ptr() == o_acc.data_ptr() and ret[1].data_ptr() == lse_acc.data_ptr()
    # Truth: the first part causal, the rest fully visible.
    mask = torch.ones(N, Nk, dtype=torch.bool)
    mask[:, :N] = torch.ones(N, N, dtype=torch.bool).tril()
    truth = _masked_f64(q, k, v, mask)
    tol = TOL[dtype]
    assert rel_err(o_acc, truth["o"]) < tol
    assert lse_err(lse_acc, truth["lse"]) < 10 * tol
    # Nothing outside the views was touched.
    assert (o_big[:, :5] == 7).all() and (o_big[:, 5 + N :] == 7).all()
    assert (lse_big[..., :5] == 7).all() and (lse_big[..., 5 + N :] == 7).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_on_either_side(backend):
    """Rows with lse = −inf in the accumulator take the block's result; a block with no keys
    leaves the accumulator as it was; rows empty on both sides stay (0, −inf), never NaN."""
    B, N, H, D = 1, 40, 2, 32
    q, k, v = _inputs(B, N, 2 * N, H, H, D, torch.float32, seed=2)
    ka, va, kb, vb = k[:, :N], v[:, :N], k[:, N:], v[:, N:]
    empty = torch.zeros(N, dtype=torch.bool)
    empty[3:17] = True

    o_acc, lse_acc = fwd_step(q, ka, va, out_dtype=torch.float32, backend=backend)
    o_acc[:, empty] = 0.0
    lse_acc[:, :, empty] = NEG_INF
    # The block has no keys: lse_blk = -inf on every row.
    before = o_acc.clone(), lse_acc.clone()
    fwd_step(q, k[:, :0], v[:, :0], acc=(o_acc, lse_acc), backend=backend)
    assert torch.equal(lse_acc, before[1]) and torch.allclose(o_acc, before[0], rtol=0, atol=0)
    assert (o_acc[:, empty] == 0).all() and torch.isneginf(lse_acc[:, :, empty]).all()

    fwd_step(q, kb, vb, acc=(o_acc, lse_acc), backend=backend)
    mask = torch.ones(N, 2 * N, dtype=torch.bool)
    mask[empty, :N] = False  # the empty rows saw none of the first keys
    truth = _masked_f64(q, k, v, mask)
    assert rel_err(o_acc, truth["o"]) < TOL[torch.float32]
    assert lse_err(lse_acc, truth["lse"]) < 1e-5

    # A fresh accumulator (o = 0, lse = -inf everywhere) merged with a block is the block.
    o_acc, lse_acc = torch.zeros(B, N, H, D), torch.full((B, H, N), NEG_INF)
    fwd_step(q, kb, vb, acc=(o_acc, lse_acc), backend=backend)
    o_b, l_b = fwd_step(q, kb, vb, out_dtype=torch.float32, backend=backend)
    torch.testing.assert_close(o_acc, o_b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse_acc, l_b, rtol=1e-6, atol=1e-6)

    # Empty on both sides.
    o_acc, lse_acc = torch.zeros(B, N, H, D), torch.full((B, H, N), NEG_INF)
    fwd_step(q, k[:, :0], v[:, :0], acc=(o_acc, lse_acc), backend=backend)
    assert (o_acc == 0).all() and torch.isneginf(lse_acc).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_lse_differences(backend):
    """|lse| in the hundreds and differences of tens of nats: the sigmoid weights stay exact."""
    B, N, H, D = 1, 33, 2, 64
    q, k, v = _inputs(B, N, 3 * N, H, H, D, torch.float32, seed=3)
    scale = 5.0  # scores of order ±100
    o_acc, lse_acc = fwd_step(q, k[:, :N], v[:, :N], softmax_scale=scale, out_dtype=torch.float32, backend=backend)
    fwd_step(q, k[:, N:], v[:, N:], softmax_scale=scale, acc=(o_acc, lse_acc), backend=backend)
    truth = attention_f64(q, k, v, False, scale)
    assert truth["lse"].abs().max() > 100
    assert rel_err(o_acc, truth["o"]) < 1e-5
    assert lse_err(lse_acc, truth["lse"]) < 1e-4


def test_fused_matches_separate_merge():
    """The Triton epilogue and `ref_merge` after an unfused call agree to float32 rounding."""
    B, N, H, D = 2, 50, 4, 64
    q, k, v = _inputs(B, N, 2 * N, H, 2, D, torch.bfloat16, seed=4)
    o0, l0 = fwd_step(q, k[:, :N], v[:, :N], causal=True, out_dtype=torch.float32, backend="triton")
    fused = fwd_step(q, k[:, N:], v[:, N:], acc=(o0.clone(), l0.clone()), backend="triton")
    o_blk, l_blk = fwd_step(q, k[:, N:], v[:, N:], out_dtype=torch.float32, backend="triton")
    o_sep, l_sep = o0.clone(), l0.clone()
    ref_merge(o_sep, l_sep, o_blk, l_blk)
    torch.testing.assert_close(fused[0], o_sep, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused[1], l_sep, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    ("backend", "device"),
    [("reference", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
def test_out_takes_the_merge_rounded(backend, device):
    """`out=` (the ring's last step): the merged o written rounded to out's dtype, bit-identical
    to merging in place and rounding after; o_acc only read, lse_acc updated as in place.
    (float16 on CPU: Triton's interpreter truncates to bfloat16 where GPUs round to nearest.)"""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    B, N, H, D = 2, 50, 4, 64
    q, k, v = (t.to(device) for t in _inputs(B, N, 2 * N, H, 2, D, dtype, seed=6))
    o0, l0 = fwd_step(q, k[:, :N], v[:, :N], causal=True, out_dtype=torch.float32, backend=backend)
    in_place = fwd_step(q, k[:, N:], v[:, N:], acc=(o0.clone(), l0.clone()), backend=backend)
    o_acc, lse_acc = o0.clone(), l0.clone()
    big = torch.full((B, N + 10, H, D), 7.0, dtype=dtype, device=device)
    out = big[:, 5 : 5 + N]  # a view: the rows around it must stay untouched
    ret = fwd_step(q, k[:, N:], v[:, N:], acc=(o_acc, lse_acc), out=out, backend=backend)
    assert ret[0] is out and ret[1] is lse_acc
    assert (big[:, :5] == 7).all() and (big[:, 5 + N :] == 7).all()
    assert torch.equal(out, in_place[0].to(dtype)) and torch.equal(lse_acc, in_place[1])
    assert torch.equal(o_acc, o0)
    # Without acc, out is simply where o goes.
    plain = attn_fwd(q, k, v, backend=backend)
    assert torch.equal(fwd_step(q, k, v, out=torch.empty_like(q), backend=backend)[0], plain[0])


@pytest.mark.parametrize(
    ("backend", "device"),
    [("reference", "cpu"), ("triton", "cpu"), pytest.param("triton", "cuda", marks=pytest.mark.gpu)],
)
def test_accumulator_in_the_inputs_dtype_is_only_read(backend, device):
    """With `out=`, o_acc may be in q's dtype (a block result its backend rounded, as cuDNN's are:
    `Backend.partial_dtype`): merged exactly as its float32 copy would be, and never written."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    B, N, H, D = 2, 50, 4, 64
    q, k, v = (t.to(device) for t in _inputs(B, N, 2 * N, H, 2, D, dtype, seed=7))
    o0, l0 = attn_fwd(q, k[:, :N], v[:, :N], causal=True, backend=backend)  # rounded to q's dtype
    want, lse_want = torch.empty_like(q), l0.clone()
    fwd_step(q, k[:, N:], v[:, N:], acc=(o0.float(), lse_want), out=want, backend=backend)
    got, lse_got, o_acc = torch.empty_like(q), l0.clone(), o0.clone()
    fwd_step(q, k[:, N:], v[:, N:], acc=(o_acc, lse_got), out=got, backend=backend)
    assert torch.equal(got, want) and torch.equal(lse_got, lse_want) and torch.equal(o_acc, o0)
    rule = r"acc o_acc must be float32 .*, or q's dtype torch\.\w+ \(with out= elsewhere"
    with pytest.raises(TypeError, match=rule):
        fwd_step(q, k[:, N:], v[:, N:], acc=(o0.clone(), l0.clone()), backend=backend)  # in place: refused
    with pytest.raises(TypeError, match=rule):
        fwd_step(q, k[:, N:], v[:, N:], acc=(o_acc, l0.clone()), out=o_acc, backend=backend)  # the same
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(TypeError, match="acc o_acc must be float32"):
        fwd_step(q, k[:, N:], v[:, N:], acc=(o0.to(other), l0.clone()), out=got, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_acc_names_the_argument(backend):
    q, k, v = _inputs(1, 8, 8, 2, 2, 32, torch.bfloat16)
    o, lse = torch.zeros(1, 8, 2, 32), torch.zeros(1, 2, 8)
    with pytest.raises(TypeError, match="acc must be a tuple"):
        fwd_step(q, k, v, acc=o, backend=backend)
    with pytest.raises(TypeError, match="acc o_acc must be float32"):
        fwd_step(q, k, v, acc=(o.bfloat16(), lse), backend=backend)
    with pytest.raises(ValueError, match="acc lse_acc must have shape"):
        fwd_step(q, k, v, acc=(o, lse[:, :1]), backend=backend)
    with pytest.raises(ValueError, match="acc o_acc must have a contiguous last dim"):
        fwd_step(q, k, v, acc=(o.transpose(1, 3).contiguous().transpose(1, 3), lse), backend=backend)
    with pytest.raises(ValueError, match="out_dtype must be None or float32"):
        fwd_step(q, k, v, acc=(o, lse), out_dtype=torch.bfloat16, backend=backend)
    with pytest.raises(ValueError, match=r"out must have shape \(B, Nq, H, Dv\)"):
        fwd_step(q, k, v, acc=(o, lse), out=q[:, :4], backend=backend)
    with pytest.raises(ValueError, match=r"out_dtype torch\.float32 differs from out.s dtype torch\.bfloat16"):
        fwd_step(q, k, v, out_dtype=torch.float32, out=torch.empty_like(q), backend=backend)
    with pytest.raises(TypeError, match=r"out must be float16, bfloat16 or float32, got torch\.float64"):
        fwd_step(q, k, v, out=q.to(torch.float64), backend=backend)
    with pytest.raises(ValueError, match=r"out must have a contiguous last dim \(stride 1\)"):
        fwd_step(q, k, v, out=torch.empty(1, 8, 2, 64, dtype=q.dtype)[..., ::2], backend=backend)
    # With out=, out_dtype may name out's own dtype: o_acc is then only read, so it need not be float32.
    g = torch.Generator().manual_seed(7)
    o, lse = torch.randn(1, 8, 2, 32, generator=g), torch.randn(1, 2, 8, generator=g)
    want = fwd_step(q, k, v, acc=(o.clone(), lse.clone()), out=torch.empty_like(q), backend=backend)
    got = fwd_step(q, k, v, acc=(o.clone(), lse.clone()), out=torch.empty_like(q), out_dtype=q.dtype, backend=backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _masked_f64(q, k, v, mask):
    """float64 attention with an explicit `(Nq, Nk)` visibility mask; empty rows give (0, −inf)."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    G = q.shape[2] // k.shape[2]
    kr, vr = k64.repeat_interleave(G, 2), v64.repeat_interleave(G, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kr) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, -1)
    p = torch.where(mask, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return {"o": torch.einsum("bhqk,bkhd->bqhd", p, vr), "lse": lse}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("N", "H", "Hkv", "D"), [(2048, 8, 2, 128), (1000, 4, 4, 64), (1536, 4, 1, 256)])
def test_gpu_merged_equals_attention_over_union(N, H, Hkv, D, dtype):
    B = 2
    q, k, v = (t.cuda() for t in _inputs(B, N, 2 * N, H, Hkv, D, dtype, seed=5))
    o_big = torch.full((B, N + 64, H, D), float("nan"), device="cuda")
    lse_big = torch.full((B, H, N + 64), float("nan"), device="cuda")
    o_acc, lse_acc = o_big[:, 32 : 32 + N], lse_big[:, :, 32 : 32 + N]
    o0, l0 = fwd_step(q, k[:, :N], v[:, :N], causal=True, out_dtype=torch.float32)
    o_acc.copy_(o0)
    lse_acc.copy_(l0)
    fwd_step(q, k[:, N:], v[:, N:], acc=(o_acc, lse_acc))
    mask = torch.ones(N, 2 * N, dtype=torch.bool, device="cuda")
    mask[:, :N] = torch.ones(N, N, dtype=torch.bool, device="cuda").tril()
    truth = _masked_f64(q, k, v, mask)
    assert rel_err(o_acc, truth["o"]) < TOL[dtype]
    assert lse_err(lse_acc, truth["lse"]) < 10 * TOL[dtype]
    assert torch.isnan(o_big[:, :32]).all() and torch.isnan(lse_big[..., 32 + N :]).all()
