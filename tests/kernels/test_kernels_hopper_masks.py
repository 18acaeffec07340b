"""`backend="hopper"` with per-row key intervals: sliding windows (causal and two-sided), packed
documents, a ring step's rectangle with rows that see nothing, per-batch documents; and logit
softcapping over the dense masks and the intervals. The Gluon
kernels are called directly (a fallback to the Triton kernels cannot pass for them) and compared
against float64 over the mask the intervals describe, no further from it than the Triton kernels.
"""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import AttnSpec, get_backend, visibility
from ringflash.kernels.hopper_bwd import hopper_attn_bwd, hopper_bwd_unsupported
from ringflash.kernels.hopper_fwd import hopper_attn_fwd, hopper_fwd_unsupported
from tests.truth import TOL, rel_err
from tests.truth_features import assert_close, attention, band

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="the Hopper kernels need an sm_90 GPU")


def _documents(lengths, causal):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return AttnSpec.documents(cu, sum(lengths), causal=causal), sum(lengths), sum(lengths)


def _ring_step():
    # Zigzag rank 0 of 2 at its second step: query chunks 0 and 3 against key chunks 1 and 2,
    # causal by global position: chunk 0's rows see nothing, chunk 3's see everything.
    c = 300
    q_pos = torch.cat([torch.arange(0, c), torch.arange(3 * c, 4 * c)]).cuda()
    k_pos = torch.arange(c, 3 * c).cuda()
    return AttnSpec(intervals=visibility(q_pos, k_pos, causal=True)), 2 * c, 2 * c


def _stripe_docs():
    # Two batch rows with their own documents, causal, keys at odd positions: per-batch intervals.
    n = 700
    pos = torch.arange(n).cuda()
    doc = torch.stack([torch.arange(n) // 250, torch.arange(n) // 90]).cuda()
    return AttnSpec(intervals=visibility(pos, pos, causal=True, q_doc=doc, k_doc=doc)), n, n


CASES = {
    "causal window 100": lambda: (AttnSpec(causal=True, window=100), 1000, 1000),
    "causal window 300, ragged": lambda: (AttnSpec(causal=True, window=300), 1111, 1111),
    "two-sided (64, 32)": lambda: (AttnSpec(window=(64, 32)), 1000, 1000),
    "two-sided (-1, 200)": lambda: (AttnSpec(window=(-1, 200)), 900, 900),
    "documents causal": lambda: _documents([5, 300, 1, 700, 250, 130], True),
    "documents full": lambda: _documents([5, 300, 1, 700, 250, 130], False),
    "ring step, empty rows": _ring_step,
    "per-batch documents": _stripe_docs,
}


def _visible(spec, q, k):
    """The `(B or 1, 1, Nq, Nk)` bool mask the spec's intervals describe."""
    vis = spec.intervals_for(q, k)
    j = torch.arange(k.shape[1], device=q.device)
    return ((j >= vis.kv_lo[..., None]) & (j < vis.kv_hi[..., None]))[:, None]


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dims", [(4, 2, 64), (2, 2, 128)], ids=["gqa-d64", "mha-d128"])
@pytest.mark.parametrize("case", CASES)
def test_intervals_as_close_to_float64_as_the_triton_kernels(case, dims, dtype):
    spec, Nq, Nk = CASES[case]()
    H, Hkv, D = dims
    B = 2
    g = torch.Generator().manual_seed(11)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", dtype)
    if spec.intervals is not None and spec.intervals.kv_lo.shape[0] == 1 and case.startswith("documents"):
        B = 1  # packed documents are one row
    q, k, v, do = mk(B, Nq, H, D), mk(B, Nk, Hkv, D), mk(B, Nk, Hkv, D), mk(B, Nq, H, D)
    truth = attention(q, k, v, visible=_visible(spec, q, k), do=do)
    assert hopper_fwd_unsupported(q, k, v, spec) is None and hopper_bwd_unsupported(q, k, v, spec) is None
    triton = get_backend("triton", q.device)
    o, lse = hopper_attn_fwd(q, k, v, spec)
    o_ref, lse_ref = triton.fwd_step(q, k, v, spec, None)
    err, base = rel_err(o, truth["o"]), rel_err(o_ref, truth["o"])
    assert err < TOL[dtype] and err <= 1.25 * base + 1e-5, f"o: {err:.2e} against Triton's {base:.2e}"
    seen = truth["lse"].isfinite()
    assert torch.equal(lse.isfinite(), seen), "rows that see no key must have lse = -inf, the others finite"
    assert (lse.double()[seen] - truth["lse"][seen]).abs().max() < 1e-3
    assert (o[~seen.transpose(1, 2)] == 0).all()
    got = hopper_attn_bwd(do, q, k, v, o_ref, lse_ref, spec)
    ref = triton.bwd_step(do, q, k, v, o_ref, lse_ref, spec, None)
    for name, gr, r in zip(("dq", "dk", "dv"), got, ref):
        err, base = rel_err(gr, truth[name]), rel_err(r, truth[name])
        assert err < TOL[dtype] and err <= 1.25 * base + 1e-5, f"{name}: {err:.2e} against Triton's {base:.2e}"


@pytest.mark.gpu
@sm90
def test_interval_steps_merge_like_one_call():
    # A ring's steps with intervals: the first block's float32 partials, the second merged into
    # them (the kernel's MERGE epilogue), equal to one call over both blocks.
    dtype, H, D, n = torch.bfloat16, 4, 128, 600
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, n, H, D, generator=g).to("cuda", dtype) for _ in range(3))
    pos = torch.arange(n, device="cuda")
    doc = (pos // 230).unsqueeze(0)
    hopper = get_backend("hopper", q.device, strict=True)  # the Gluon kernels or an error
    whole = AttnSpec(intervals=visibility(pos, pos, causal=True, q_doc=doc, k_doc=doc))
    o_all, lse_all = hopper.fwd_step(q, k, v, whole, None, out_dtype=torch.float32)
    halves = [slice(0, n // 2), slice(n // 2, n)]
    specs = [AttnSpec(intervals=visibility(pos, pos[s], causal=True, q_doc=doc, k_doc=doc[:, s])) for s in halves]
    o, lse = hopper.fwd_step(q, k[:, halves[0]], v[:, halves[0]], specs[0], None, out_dtype=torch.float32)
    hopper.fwd_step(q, k[:, halves[1]], v[:, halves[1]], specs[1], None, acc=(o, lse))
    truth = attention(q, k, v, visible=_visible(whole, q, k))
    # Each block rounds its own P to bf16 against its own running max: as far from float64 as one call.
    err, base = rel_err(o, truth["o"]), rel_err(o_all, truth["o"])
    assert err < TOL[dtype] and err <= 1.25 * base + 1e-5, f"merged o: {err:.2e} against one call's {base:.2e}"
    assert (lse - lse_all).abs().max() < 1e-4


SOFTCAP_CASES = {
    "causal": lambda: (AttnSpec(causal=True), 1000, 1000),
    "full, ragged": lambda: (AttnSpec(), 777, 777),
    "causal window 300, ragged": CASES["causal window 300, ragged"],
    "documents causal": CASES["documents causal"],
}


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dims", [(4, 2, 64), (2, 2, 128)], ids=["gqa-d64", "mha-d128"])
@pytest.mark.parametrize("case", SOFTCAP_CASES)
def test_softcap_matches_float64(case, dims, dtype):
    # Gemma 2's cap on the Gluon kernels, tanh on the MUFU: flash_attn's criterion against a naive
    # same-dtype implementation. Scores of a few times the cap, so that it bends them.
    spec, Nq, Nk = SOFTCAP_CASES[case]()
    cap = 5.0
    spec = spec.with_softcap(cap)
    (H, Hkv, D), B = dims, 1 if case.startswith("documents") else 2
    g = torch.Generator().manual_seed(5)
    mk = lambda *s, a=1.0: (a * torch.randn(*s, generator=g)).to("cuda", dtype)
    q, k, v, do = mk(B, Nq, H, D, a=2.0), mk(B, Nk, Hkv, D, a=2.0), mk(B, Nk, Hkv, D), mk(B, Nq, H, D)
    dense = spec.intervals_for(q, k) is None
    visible = band(Nq, Nk, causal=spec.causal).cuda() if dense else _visible(spec, q, k)
    truth = attention(q, k, v, visible=visible, softcap=cap, do=do)
    naive = attention(q, k, v, visible=visible, softcap=cap, do=do, dtype=dtype)
    assert hopper_fwd_unsupported(q, k, v, spec) is None and hopper_bwd_unsupported(q, k, v, spec) is None
    o, lse = hopper_attn_fwd(q, k, v, spec)
    dq, dk, dv = hopper_attn_bwd(do, q, k, v, o, lse, spec)
    got = {name: t.cpu() for name, t in dict(o=o, dq=dq, dk=dk, dv=dv).items()}
    assert_close(got, {n: t.cpu() for n, t in truth.items()}, {n: t.cpu() for n, t in naive.items()}, dtype)
    assert (lse.double() - truth["lse"].to(lse.device)).abs().max() < 1e-2
    uncapped, _ = hopper_attn_fwd(q, k, v, spec.with_softcap(0.0))
    assert (uncapped - o).abs().max() > 1e-2  # the cap bends these scores: a kernel ignoring it fails above
