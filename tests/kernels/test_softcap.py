"""Logit softcapping (`AttnSpec.softcap`, Gemma 2's `c·tanh(s/c)`) in the kernels, forward and
backward, against a float64 ground truth with flash_attn's criterion; the backends that cannot
run it say so."""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import AttnSpec, attn_bwd, attn_fwd, dense_visibility
from ringflash.kernels.cudnn import check_cudnn
from tests.kernels.steps import BACKEND_DEVICES, skip_unless_runs
from tests.truth_features import assert_close, attention, band

# (B, N, H, Hkv, D): ragged lengths, several key blocks per query block, GQA.
SHAPES = [(1, 97, 2, 1, 32), (2, 70, 4, 2, 64)]


def _inputs(shape, dtype, seed=0):
    B, N, H, Hkv, D = shape
    g = torch.Generator().manual_seed(seed)
    # Scores of size ~4·c/… so that the cap bends them (randn·3: |s| reaches well past c = 5).
    mk = lambda *s, a=1.0: (a * torch.randn(*s, generator=g)).to(dtype)
    return mk(B, N, H, D, a=3.0), mk(B, N, Hkv, D, a=3.0), mk(B, N, Hkv, D), mk(B, N, H, D)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)  # hopper: its Gluon kernels at D64, Triton at D32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask", ["full", "causal", "window"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_softcap_matches_float64(shape, mask, dtype, backend, device):
    skip_unless_runs(backend, device)
    q, k, v, do = _inputs(shape, dtype)
    n, cap = shape[1], 5.0
    spec = {"full": AttnSpec(softcap=cap), "causal": AttnSpec(causal=True, softcap=cap),
            "window": AttnSpec(intervals=dense_visibility(n, window=20, device=device), softcap=cap)}[mask]  # fmt: skip
    visible = {"full": None, "causal": band(n, n, causal=True), "window": band(n, n, 19, 0)}[mask]
    truth = attention(q, k, v, visible=visible, softcap=cap, do=do)
    naive = attention(q, k, v, visible=visible, softcap=cap, do=do, dtype=dtype)
    q, k, v, do = (t.to(device) for t in (q, k, v, do))
    o, lse = attn_fwd(q, k, v, spec=spec, backend=backend)
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, spec=spec, backend=backend)
    assert_close({n: t.cpu() for n, t in dict(o=o, dq=dq, dk=dk, dv=dv).items()}, truth, naive, dtype)
    assert (lse.cpu().double() - truth["lse"]).abs().max() < 1e-4 * (1 if dtype == torch.float32 else 100)


def test_softcap_changes_the_result():
    # Guards the test above against a softcap the kernels ignore: at c = 5 the outputs differ.
    q, k, v, _ = _inputs(SHAPES[0], torch.float32)
    capped, _ = attn_fwd(q, k, v, spec=AttnSpec(softcap=5.0), backend="triton")
    plain, _ = attn_fwd(q, k, v, backend="triton")
    assert (capped - plain).abs().max() > 1e-2


@pytest.mark.parametrize("bad, error", [(-1.0, ValueError), (float("inf"), ValueError), ("30", TypeError),
                                        (True, TypeError)])  # fmt: skip
def test_bad_softcap_named(bad, error):
    with pytest.raises(error, match="softcap"):
        AttnSpec(softcap=bad)


def test_backends_that_cannot_softcap_say_so():
    spec = AttnSpec(causal=True, softcap=30.0)
    assert not spec.dense  # what cuDNN runs
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="softcap"):
        check_cudnn(q, q, q, spec)


def test_kernel_op_takes_softcap():
    # torch.compile's view of the kernels: the custom op with its fake and its autograd formula.
    q, k, v, _ = _inputs(SHAPES[0], torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    opts = dict(causal=True, backend="reference", softcap=5.0)
    torch.library.opcheck(torch.ops.ringflash.attn_fwd.default, (q, k, v, []), opts)
    o, _ = torch.ops.ringflash.attn_fwd(q, k, v, [], **opts)
    want, _ = attn_fwd(q, k, v, spec=AttnSpec(causal=True, softcap=5.0), backend="reference")
    torch.testing.assert_close(o, want, rtol=0, atol=0)


def test_flash_style_softcap_keyword():
    q, k, v, do = _inputs(SHAPES[0], torch.float32)
    o, lse = attn_fwd(q, k, v, causal=True, softcap=5.0, backend="reference")
    want, _ = attn_fwd(q, k, v, spec=AttnSpec(causal=True, softcap=5.0), backend="reference")
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    grads = attn_bwd(do, q, k, v, o, lse, causal=True, softcap=5.0, backend="reference")
    spec = AttnSpec(causal=True, softcap=5.0)
    for g, w in zip(grads, attn_bwd(do, q, k, v, o, lse, spec=spec, backend="reference")):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="softcap"):
        attn_fwd(q, k, v, spec=spec, softcap=5.0)
