"""Packed documents, sliding windows and masks at global positions (kernels/masks.py, kernels/varlen.py).

Every case is checked against a float64 ground truth built independently of the kernels' interval
representation: per-document attention (tests/truth.py on each document's slice) for packed
sequences, and an explicit `(Nq, Nk)` mask from positions and document ids otherwise. o, lse, dq,
dk and dv, both backends, fp32/fp16/bf16, GQA, odd document lengths. One test poisons the keys
and queries that no row sees with NaN: it passes only if the Triton kernels skip their blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from ringflash import kernels
from ringflash.kernels import (
    Visibility,
    attn_bwd,
    attn_fwd,
    attn_varlen_bwd,
    attn_varlen_fwd,
    varlen_visibility,
    visibility,
)
from tests.kernels.steps import bwd_step, fwd_step
from tests.truth import TOL, attention_f64, lse_err, rel_err

BACKENDS = ["triton", "reference"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEG_INF = float("-inf")


def _randn(*shape, g, dtype, device="cpu"):
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _packed(lens, H, Hkv, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, do = _randn(T, H, D, g=g, dtype=dtype, device=device), _randn(T, H, D, g=g, dtype=dtype, device=device)
    k, v = _randn(T, Hkv, D, g=g, dtype=dtype, device=device), _randn(T, Hkv, D, g=g, dtype=dtype, device=device)
    return q, k, v, do, cu


def _per_document_truth(q, k, v, do, cu, causal, scale=None):
    """float64 attention of each document on its own, concatenated: o, lse (H, total), grads."""
    outs = {"o": [], "lse": [], "dq": [], "dk": [], "dv": []}
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        t = attention_f64(q[None, a:b], k[None, a:b], v[None, a:b], causal, scale, do=do[None, a:b])
        for name in outs:
            outs[name].append(t[name][0])
    return {n: torch.cat(x, dim=1 if n == "lse" else 0) for n, x in outs.items()}


def masked_f64(q, k, v, mask, scale=None, do=None):
    """float64 attention of q `(B, Nq, H, D)` over k, v `(B, Nk, Hkv, D)` under an explicit mask
    `(B or 1, Nq, Nk)`; rows that see nothing give o = 0, lse = −inf and zero gradients."""
    q64, k64, v64 = (t.detach().double().requires_grad_(do is not None) for t in (q, k, v))
    G = q.shape[2] // k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64.repeat_interleave(G, 2)) * scale
    m = mask[:, None]  # over heads
    empty = ~m.any(-1, keepdim=True)
    s = torch.where(m, s, NEG_INF)
    s = torch.where(empty, 0.0, s)  # keeps logsumexp and its gradient finite on empty rows
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(m, torch.exp(s - lse), 0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p, v64.repeat_interleave(G, 2))
    out = {"o": o.detach(), "lse": torch.where(empty, NEG_INF, lse)[..., 0].detach()}
    if do is not None:
        o.backward(do.double())
        out.update(dq=q64.grad, dk=k64.grad, dv=v64.grad)
    return out


def _mask(q_pos, k_pos, causal, window=None, q_doc=None, k_doc=None):
    """The mask by definition, `(Nq, Nk)`: same document, key at or before the query, in the window."""
    qp, kp = q_pos[:, None], k_pos[None, :]
    m = torch.ones(len(q_pos), len(k_pos), dtype=torch.bool, device=q_pos.device)
    if q_doc is not None:
        m &= q_doc[:, None] == k_doc[None, :]
    if causal:
        m &= kp <= qp
    if window is not None:
        m &= qp - kp < window
    return m


def _assert_close(got, truth, dtype, names=("o", "dq", "dk", "dv")):
    tol = TOL[dtype]
    # A window of 1 leaves each row one key: the scores get no gradient, dq = dk = 0 exactly in
    # float64 and rounding noise here, so zero truths are held to an absolute bound instead.
    errs = {n: rel_err(got[n], truth[n]) if truth[n].abs().max() > 0 else got[n].abs().max().item()
            for n in names}
    assert all(e < tol for e in errs.values()), f"{errs} exceed {tol}"
    assert lse_err(got["lse"], truth["lse"]) < 10 * tol


# ---------------------------------------------------------------------------------------------
# Packed documents (varlen)

VARLEN_CASES = [  # (document lengths, H, Hkv, D, causal)
    ((1, 17, 100, 5, 33), 4, 2, 64, True),
    ((70, 1, 63, 2, 64), 2, 1, 32, False),
    ((130, 9), 3, 3, 96, True),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: "-".join(map(str, c[0])) + ("c" if c[4] else "f"))
def test_varlen_matches_per_document(case, dtype, backend):
    lens, H, Hkv, D, causal = case
    q, k, v, do, cu = _packed(lens, H, Hkv, D, dtype, seed=len(lens))
    o, lse = attn_varlen_fwd(q, k, v, cu, max(lens), causal=causal, backend=backend)
    dq, dk, dv = attn_varlen_bwd(do, q, k, v, o, lse, cu, max(lens), causal=causal, backend=backend)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    truth = _per_document_truth(q, k, v, do, cu, causal)
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, dtype)


def test_varlen_is_not_causal_by_default():
    # flash_attn_varlen_func's default, and attn_fwd's: attention over the whole document.
    q, k, v, do, cu = _packed((20, 7), 2, 1, 32, torch.float32, seed=3)
    o, lse = attn_varlen_fwd(q, k, v, cu, backend="reference")
    assert torch.equal(o, attn_varlen_fwd(q, k, v, cu, causal=False, backend="reference")[0])
    assert not torch.allclose(o, attn_varlen_fwd(q, k, v, cu, causal=True, backend="reference")[0])
    grads = attn_varlen_bwd(do, q, k, v, o, lse, cu, backend="reference")
    full = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=False, backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(grads, full))


def test_varlen_builds_the_documents_once_per_boundaries_tensor():
    # A model passes one cu_seqlens to every layer: its intervals are built once, and built again
    # when the tensor is written in place (a data loader reusing its buffer) or is another tensor.
    from ringflash.kernels.varlen import _documents

    q, k, v, do, cu = _packed((20, 7, 33), 2, 1, 32, torch.float32, seed=4)
    first = _documents(cu, q.shape[0], True, (-1, -1), None)
    assert _documents(cu, q.shape[0], True, (-1, -1), None) is first
    assert _documents(cu, q.shape[0], False, (-1, -1), None) is not first  # another mask, another spec
    assert _documents(cu.clone(), q.shape[0], True, (-1, -1), None) is not first
    cu[1:3] = torch.tensor([5, 40], dtype=cu.dtype)  # new boundaries, same tensor
    o, lse = attn_varlen_fwd(q, k, v, cu, causal=True, backend="reference")
    grads = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, backend="reference")
    truth = _per_document_truth(q, k, v, do, cu, True)
    _assert_close(dict(o=o, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]), truth, torch.float32)


def test_spec_is_the_whole_mask_and_refuses_causal_or_window_beside_it():
    # A spec built once serves forward and backward; a causal= or window= next to it would be ignored.
    q, k, v, do, cu = _packed((20, 7), 2, 1, 32, torch.float32, seed=4)
    spec = kernels.AttnSpec.documents(cu, q.shape[0], causal=True, window=5)
    o, lse = attn_varlen_fwd(q, k, v, cu, spec=spec, backend="reference")
    o_built, lse_built = attn_varlen_fwd(q, k, v, cu, causal=True, window_size=(4, 0), backend="reference")
    assert torch.equal(o, o_built) and torch.equal(lse, lse_built)
    grads = attn_varlen_bwd(do, q, k, v, o, lse, cu, spec=spec, backend="reference")
    built = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, window_size=(4, 0), backend="reference")
    assert all(torch.equal(a, b) for a, b in zip(grads, built))
    rest = (
        "beside spec=: the spec already holds the documents' mask; build it with "
        "AttnSpec.documents(cu_seqlens, total, causal=, window=) and pass spec= alone"
    )
    with pytest.raises(ValueError) as err:
        attn_varlen_fwd(q, k, v, cu, causal=True, spec=spec, backend="reference")
    assert str(err.value) == f"causal=True, window_size=(-1, -1) {rest}"
    with pytest.raises(ValueError) as err:
        attn_varlen_bwd(do, q, k, v, o, lse, cu, window_size=(4, 0), spec=spec, backend="reference")
    assert str(err.value) == f"causal=False, window_size=(4, 0) {rest}"


def test_the_ops_refuse_causal_or_window_beside_intervals():
    q, k, v = (torch.randn(1, 8, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    vis = list(kernels.dense_visibility(8, window=2))
    o, lse = torch.ops.ringflash.attn_fwd(q, k, v, vis, backend="reference")
    assert torch.equal(o, attn_fwd(q, k, v, causal=True, window_size=(1, 0), backend="reference")[0])
    said = (
        "intervals already say which keys each query sees: give them without causal or window (build them with "
        "kernels.visibility(..., causal=True, window=...))"
    )
    for extra in (dict(causal=True), dict(causal=True, window_size=[1, 0])):
        with pytest.raises(ValueError) as err:
            torch.ops.ringflash.attn_fwd(q, k, v, vis, backend="reference", **extra)
        assert str(err.value) == said
        with pytest.raises(ValueError) as err:
            torch.ops.ringflash.attn_bwd(torch.ones_like(o), q, k, v, o, lse, vis, backend="reference", **extra)
        assert str(err.value) == said


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [1, 6, 40])
def test_varlen_window(window, dtype, backend):
    lens = (3, 90, 1, 57)
    q, k, v, do, cu = _packed(lens, 4, 1, 32, dtype, seed=window)
    o, lse = attn_varlen_fwd(q, k, v, cu, causal=True, window_size=(window - 1, 0), backend=backend)
    dq, dk, dv = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, window_size=(window - 1, 0), backend=backend)
    pos = torch.arange(q.shape[0])
    doc = kernels.masks.cu_seqlens_to_doc_ids(cu, q.shape[0])
    truth = masked_f64(q[None], k[None], v[None], _mask(pos, pos, True, window, doc, doc)[None], do=do[None])
    truth = {n: t[0] for n, t in truth.items()}
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_passes_scale(backend):
    """softmax_scale reaches the kernels; results come back in the inputs' dtype."""
    lens = (5, 30, 12)
    q, k, v, do, cu = _packed(lens, 2, 1, 32, torch.bfloat16, seed=8)
    o, lse = attn_varlen_fwd(q, k, v, cu, causal=True, softmax_scale=0.3, backend=backend)
    dq, dk, dv = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, softmax_scale=0.3, backend=backend)
    assert all(t.dtype == torch.bfloat16 for t in (o, dq, dk, dv))
    truth = _per_document_truth(q, k, v, do, cu, True, scale=0.3)
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Sliding window, batch form


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("N", "window", "dtype"),
    [(97, 1, torch.float16), (130, 33, torch.float32), (130, 33, torch.bfloat16), (64, 64, torch.float32),
     (45, 200, torch.bfloat16)],
    ids=str,
)
def test_window_batch_form(N, window, dtype, backend):
    B, H, Hkv, D = 2, 4, 2, 64
    g = torch.Generator().manual_seed(N)
    q, do = _randn(B, N, H, D, g=g, dtype=dtype), _randn(B, N, H, D, g=g, dtype=dtype)
    k, v = _randn(B, N, Hkv, D, g=g, dtype=dtype), _randn(B, N, Hkv, D, g=g, dtype=dtype)
    o, lse = attn_fwd(q, k, v, causal=True, window_size=(window - 1, 0), backend=backend)
    grads = attn_bwd(do, q, k, v, o, lse, causal=True, window_size=(window - 1, 0), backend=backend)
    pos = torch.arange(N)
    truth = masked_f64(q, k, v, _mask(pos, pos, True, window)[None], do=do)
    _assert_close(dict(o=o, lse=lse, dq=grads[0], dk=grads[1], dv=grads[2]), truth, dtype)
    if window >= N:  # a window as long as the sequence is plain causal attention
        ref = attention_f64(q, k, v, True)
        assert rel_err(o, ref["o"]) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
# Rows at global positions: what a ring step on a zigzag shard passes


def _zigzag_case(dtype, seed=0, doc_lens=(5, 40, 1, 17, 33, 64), c=40, H=4, Hkv=2, D=32, B=2):
    """A global packed sequence of 4 chunks of c tokens with documents crossing chunk
    boundaries, laid out zigzag over 2 ranks: rank 0 holds chunks (0, 3), rank 1 (1, 2)."""
    assert sum(doc_lens) == 4 * c
    g = torch.Generator().manual_seed(seed)
    N = 4 * c
    q, do = _randn(B, N, H, D, g=g, dtype=dtype), _randn(B, N, H, D, g=g, dtype=dtype)
    k, v = _randn(B, N, Hkv, D, g=g, dtype=dtype), _randn(B, N, Hkv, D, g=g, dtype=dtype)
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    rows = {0: torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)]), 1: torch.arange(c, 3 * c)}
    return q, k, v, do, doc, rows


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("window", "dtype"), [(None, torch.float32), (50, torch.bfloat16)], ids=str)
def test_ring_steps_at_global_positions(window, dtype, backend):
    """Each rank's queries against each rank's keys (the two steps of a 2-rank ring), with
    `visibility` built from global positions and document ids, forward merged into float32
    accumulators with `acc=`, backward with the merged o and lse: the pieces add up to
    attention over the whole packed sequence. Some steps leave rows with no visible key."""
    q, k, v, do, doc, rows = _zigzag_case(dtype, seed=3)
    N = q.shape[1]
    pos = torch.arange(N)
    truth = masked_f64(q, k, v, _mask(pos, pos, True, window, doc, doc)[None], do=do)
    # Each rank's key block has its float32 dK/dV accumulators, to which both ranks' queries add
    # (in the ring they travel with the block).
    dkv = {r: torch.zeros((2, *k[:, rows[r]].shape)) for r in (0, 1)}
    for r in (0, 1):
        qr = rows[r]
        o_acc = torch.zeros(q[:, qr].shape, dtype=torch.float32)
        lse_acc = torch.full((q.shape[0], q.shape[2], len(qr)), NEG_INF)
        steps = []
        for s in (0, 1):
            kr = rows[(r - s) % 2]
            vis = visibility(qr, kr, causal=True, window=window, q_doc=doc[qr], k_doc=doc[kr])
            steps.append(((r - s) % 2, vis))
            fwd_step(q[:, qr], k[:, kr], v[:, kr], acc=(o_acc, lse_acc), visibility=vis, backend=backend)
        tol = TOL[dtype]
        assert rel_err(o_acc, truth["o"][:, qr]) < tol
        assert lse_err(lse_acc, truth["lse"][..., qr]) < 10 * tol
        dq = torch.zeros(q[:, qr].shape, dtype=torch.float32)
        for kv_rank, vis in steps:
            kr, acc = rows[kv_rank], dkv[kv_rank]
            bwd_step(do[:, qr], q[:, qr], k[:, kr], v[:, kr], o_acc.to(dtype), lse_acc, visibility=vis,
                     grad_dtype=torch.float32, out=(dq, acc[0], acc[1]), accumulate=True, backend=backend)
        assert rel_err(dq, truth["dq"][:, qr]) < tol
    for r in (0, 1):
        dk, dv = truth["dk"][:, rows[r]], truth["dv"][:, rows[r]]
        assert rel_err(dkv[r][0], dk) < TOL[dtype] and rel_err(dkv[r][1], dv) < TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_visibility_rows_with_no_key(backend):
    """Query rows whose documents have no key in this block: o = 0, lse = −inf, zero gradients."""
    B, H, D = 1, 2, 32
    g = torch.Generator().manual_seed(9)
    q, do = _randn(B, 70, H, D, g=g, dtype=torch.float32), _randn(B, 70, H, D, g=g, dtype=torch.float32)
    k, v = _randn(B, 50, H, D, g=g, dtype=torch.float32), _randn(B, 50, H, D, g=g, dtype=torch.float32)
    q_pos, k_pos = torch.arange(100, 170), torch.arange(0, 50)  # keys all before the queries
    q_doc = torch.where(q_pos < 130, 1, 2)  # rows of document 2 see none of these keys
    k_doc = torch.where(k_pos < 20, 0, 1)
    vis = visibility(q_pos, k_pos, causal=True, q_doc=q_doc, k_doc=k_doc)
    o, lse = fwd_step(q, k, v, visibility=vis, backend=backend)
    dq, dk, dv = bwd_step(do, q, k, v, o, lse, visibility=vis, backend=backend)
    truth = masked_f64(q, k, v, _mask(q_pos, k_pos, True, None, q_doc, k_doc)[None], do=do)
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, torch.float32)
    assert (o[:, 30:] == 0).all() and torch.isneginf(lse[..., 30:]).all() and (dq[:, 30:] == 0).all()
    assert (dk[:, :20] == 0).all() and (dv[:, :20] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_of_packed_sequences(backend):
    """The batch form with different documents per batch element (`q_doc`, `k_doc` of shape (B, N))."""
    B, N, H, Hkv, D = 2, 75, 4, 2, 32
    g = torch.Generator().manual_seed(10)
    q, do = _randn(B, N, H, D, g=g, dtype=torch.float32), _randn(B, N, H, D, g=g, dtype=torch.float32)
    k, v = _randn(B, N, Hkv, D, g=g, dtype=torch.float32), _randn(B, N, Hkv, D, g=g, dtype=torch.float32)
    pos = torch.arange(N)
    doc = torch.stack([pos // 30, (pos >= 7).long() + (pos >= 70).long()])
    vis = visibility(pos, pos, causal=True, window=20, q_doc=doc, k_doc=doc)
    assert vis.kv_lo.shape == (B, N)
    o, lse = fwd_step(q, k, v, visibility=vis, backend=backend)
    dq, dk, dv = bwd_step(do, q, k, v, o, lse, visibility=vis, backend=backend)
    mask = torch.stack([_mask(pos, pos, True, 20, d, d) for d in doc])
    truth = masked_f64(q, k, v, mask, do=do)
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, torch.float32)


def test_visibility_intervals():
    """The interval form against the mask it stands for, and its inverse against the transpose."""
    q_pos = torch.tensor([0, 1, 2, 3, 10, 11, 12, 13])
    k_pos = torch.tensor([2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    q_doc = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    k_doc = torch.tensor([1, 1, 1, 2, 2, 2, 2, 2, 2, 2])
    for causal, window in ((True, None), (True, 4), (False, None)):
        vis = visibility(q_pos, k_pos, causal=causal, window=window, q_doc=q_doc, k_doc=k_doc)
        want = _mask(q_pos, k_pos, causal, window, q_doc, k_doc)
        j, i = torch.arange(len(k_pos)), torch.arange(len(q_pos))
        got = (j >= vis.kv_lo[0, :, None]) & (j < vis.kv_hi[0, :, None])
        got_t = (i >= vis.q_lo[0, :, None]) & (i < vis.q_hi[0, :, None])
        assert torch.equal(got, want) and torch.equal(got_t, want.T)
        assert all(t.dtype == torch.int32 and t.shape[0] == 1 for t in vis)
    # Batched positions and documents: one Visibility row per batch element.
    vis = visibility(q_pos, k_pos, causal=True, q_doc=torch.stack([q_doc, q_doc * 0 + 2]),
                     k_doc=torch.stack([k_doc, k_doc * 0 + 2]))
    assert vis.kv_lo.shape == (2, 8) and vis.q_hi.shape == (2, 10)


@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_triton_skips_blocks_no_row_sees(kind):
    """NaN in every key (or query) block that no row sees: any block the kernel visited would
    turn its output NaN (0·NaN in P·V), so finite, correct outputs mean those blocks were skipped.
    Query rows 64..127 see keys 96..159 (interpreter tiles are 64 × 32: block-aligned)."""
    B, H, D, Nq, Nk = 1, 2, 32, 192, 256
    g = torch.Generator().manual_seed(11)
    q, do = _randn(B, Nq, H, D, g=g, dtype=torch.float32), _randn(B, Nq, H, D, g=g, dtype=torch.float32)
    k, v = _randn(B, Nk, H, D, g=g, dtype=torch.float32), _randn(B, Nk, H, D, g=g, dtype=torch.float32)
    seen_q, seen_k = slice(64, 128), slice(96, 160)
    mask = torch.zeros(1, Nq, Nk, dtype=torch.bool)
    mask[:, seen_q, seen_k] = True
    mask[:, seen_q, seen_k] &= torch.ones(64, 64, dtype=torch.bool).tril()  # and causal inside
    truth = masked_f64(q, k, v, mask, do=do)
    i, j = torch.arange(Nq), torch.arange(Nk)
    rows_see = (i >= 64) & (i < 128)
    kv_lo = torch.where(rows_see, 96, 0).int()
    kv_hi = torch.where(rows_see, 96 + i - 64 + 1, 0).int()
    cols_seen = (j >= 96) & (j < 160)
    q_lo = torch.where(cols_seen, j - 96 + 64, 0).int()
    q_hi = torch.where(cols_seen, 128, 0).int()
    vis = Visibility(kv_lo[None], kv_hi[None], q_lo[None], q_hi[None])
    poisoned = lambda t, keep: torch.where(keep[None, :, None, None], t, float("nan"))
    if kind == "fwd":
        o, lse = fwd_step(q, k, poisoned(v, cols_seen), visibility=vis, backend="triton")
        _assert_close(dict(o=o, lse=lse), truth, torch.float32, names=("o",))
        return
    o, lse = truth["o"].float(), truth["lse"].float()
    if kind == "dq":  # the dq kernel loops over key blocks
        dq, _, _ = bwd_step(do, q, poisoned(k, cols_seen), poisoned(v, cols_seen), o, lse, visibility=vis,
                            backend="triton")
        assert rel_err(dq, truth["dq"]) < TOL[torch.float32]
    else:  # the dK/dV kernel loops over query blocks
        _, dk, dv = bwd_step(poisoned(do, rows_see), poisoned(q, rows_see), k, v, poisoned(o, rows_see), lse,
                             visibility=vis, backend="triton")
        assert rel_err(dk, truth["dk"]) < TOL[torch.float32] and rel_err(dv, truth["dv"]) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_mask_arguments_name_the_argument(backend):
    g = torch.Generator().manual_seed(0)
    q, k, v = (_randn(1, 8, 2, 32, g=g, dtype=torch.float32) for _ in range(3))
    vis = kernels.dense_visibility(8, window=2)
    with pytest.raises(TypeError) as err:  # the old name, pointed at the new one
        attn_fwd(q, k, v, causal=True, window=3, backend=backend)
    assert str(err.value) == (
        "window=3 is now window_size=(left, right), flash_attn's form (-1: no limit): a causal window of w keys is "
        "window_size=(w - 1, 0)"
    )
    with pytest.raises(ValueError, match=r"window_size=\(2, 1\) with causal=True: a causal window has no keys"):
        attn_fwd(q, k, v, causal=True, window_size=(2, 1), backend=backend)
    with pytest.raises(ValueError, match=r"window_size=\(-2, 0\): entries must be >= 0"):
        attn_fwd(q, k, v, causal=True, window_size=(-2, 0), backend=backend)
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        attn_fwd(q, k, v, causal=True, window_size=3, backend=backend)
    with pytest.raises(ValueError, match="intervals already say"):
        fwd_step(q, k, v, causal=True, visibility=vis, backend=backend)
    with pytest.raises(ValueError, match=r"visibility.kv_lo must have shape \(1, 5\)"):
        fwd_step(q[:, :5], k, v, visibility=vis, backend=backend)
    with pytest.raises(TypeError, match=r"visibility\.q_hi must be int32"):
        fwd_step(q, k, v, visibility=vis._replace(q_hi=vis.q_hi.long()), backend=backend)
    with pytest.raises(ValueError, match=r"visibility\.kv_lo must have shape \(1, 8\), got \(3, 8\)"):
        fwd_step(q, k, v, visibility=vis._replace(kv_lo=vis.kv_lo.expand(3, -1).contiguous()), backend=backend)
    strided = torch.stack([vis.kv_hi, vis.kv_hi], dim=-1)[..., 0]  # (1, 8), row stride 2
    with pytest.raises(ValueError, match=r"visibility\.kv_hi must be contiguous"):
        fwd_step(q, k, v, visibility=vis._replace(kv_hi=strided), backend=backend)
    with pytest.raises(ValueError, match="intervals already say"):  # a window would be ignored
        fwd_step(q, k, v, causal=True, window=2, visibility=vis, backend=backend)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end"):
        attn_varlen_fwd(q[0], k[0], v[0], cu[:2], backend=backend)
    with pytest.raises(TypeError, match="cu_seqlens must be int32 or int64"):
        attn_varlen_fwd(q[0], k[0], v[0], cu.float(), backend=backend)
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 .*got 1 \.\.\. 8"):
        attn_varlen_fwd(q[0], k[0], v[0], torch.tensor([1, 3, 8], dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        attn_varlen_fwd(q[0], k[0], v[0], torch.tensor([0, 5, 3, 8], dtype=torch.int32), backend=backend)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        attn_varlen_fwd(q, k[0], v[0], cu, backend=backend)
    with pytest.raises(ValueError, match="k_pos must be increasing"):
        visibility(torch.arange(4), torch.tensor([0, 2, 1, 3]), causal=True)
    with pytest.raises(ValueError, match="q_doc and k_doc must be given together"):
        visibility(torch.arange(4), torch.arange(4), causal=True, q_doc=torch.zeros(4))
    with pytest.raises(ValueError, match="window needs causal=True"):
        visibility(torch.arange(4), torch.arange(4), causal=False, window=2)
    with pytest.raises(ValueError, match=r"one batch size \(or 1\), got \[2, 3\]"):
        visibility(torch.arange(4), torch.arange(4), causal=True, q_doc=torch.zeros(2, 4, dtype=torch.long),
                   k_doc=torch.zeros(3, 4, dtype=torch.long))
    assert varlen_visibility(cu, 8, causal=True).kv_lo.shape == (1, 8)


# ---------------------------------------------------------------------------------------------
# GPU: realistic sizes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("D", "H", "Hkv"), [(128, 8, 2), (64, 4, 4)])
def test_gpu_varlen_matches_per_document(D, H, Hkv, dtype):
    lens = (1, 17, 100, 1000, 3001, 64, 2048, 129, 1)
    q, k, v, do, cu = _packed(lens, H, Hkv, D, dtype, seed=12, device="cuda")
    o, lse = attn_varlen_fwd(q, k, v, cu, max(lens), causal=True)
    dq, dk, dv = attn_varlen_bwd(do, q, k, v, o, lse, cu, max(lens), causal=True)
    truth = _per_document_truth(q, k, v, do, cu, True)
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "hopper"])
def test_gpu_varlen_never_waits_for_the_device(backend):
    # Building the documents' intervals, checking them and launching the kernels: no host sync.
    lens = (100, 3000, 1, 900)
    q, k, v, do, cu = _packed(lens, 8, 2, 128, torch.bfloat16, seed=13, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        o, lse = attn_varlen_fwd(q, k, v, cu.clone(), causal=True, backend=backend)
        attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
@pytest.mark.parametrize(("N", "window", "D"), [(4096, 512, 128), (3000, 1000, 64), (2048, 129, 256)])
def test_gpu_window(N, window, D, dtype):
    B, H, Hkv = 1, 4, 2
    g = torch.Generator().manual_seed(13)
    q, do = _randn(B, N, H, D, g=g, dtype=dtype, device="cuda"), _randn(B, N, H, D, g=g, dtype=dtype, device="cuda")
    k, v = (_randn(B, N, Hkv, D, g=g, dtype=dtype, device="cuda") for _ in range(2))
    o, lse = attn_fwd(q, k, v, causal=True, window_size=(window - 1, 0))
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, causal=True, window_size=(window - 1, 0))
    pos = torch.arange(N, device="cuda")
    truth = masked_f64(q, k, v, ((pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window))[None], do=do)
    _assert_close(dict(o=o, lse=lse, dq=dq, dk=dk, dv=dv), truth, dtype)


@pytest.mark.gpu
def test_gpu_ring_steps_at_global_positions():
    q, k, v, do, doc, rows = _zigzag_case(torch.bfloat16, seed=14, doc_lens=(1, 700, 2000, 3, 1391, 1), c=1024,
                                          H=8, Hkv=2, D=128, B=1)
    q, k, v, do, doc = (t.cuda() for t in (q, k, v, do, doc))
    N = q.shape[1]
    pos = torch.arange(N, device="cuda")
    truth = masked_f64(q, k, v, _mask(pos, pos, True, 300, doc, doc)[None], do=do)
    for r in (0, 1):
        qr = rows[r].cuda()
        o_acc = torch.zeros(q[:, qr].shape, dtype=torch.float32, device="cuda")
        lse_acc = torch.full((1, 8, len(qr)), NEG_INF, device="cuda")
        for s in (0, 1):
            kr = rows[(r - s) % 2].cuda()
            vis = visibility(qr, kr, causal=True, window=300, q_doc=doc[qr], k_doc=doc[kr])
            fwd_step(q[:, qr], k[:, kr], v[:, kr], acc=(o_acc, lse_acc), visibility=vis)
        assert rel_err(o_acc, truth["o"][:, qr]) < TOL[torch.bfloat16]
        assert lse_err(lse_acc, truth["lse"][..., qr]) < 10 * TOL[torch.bfloat16]
