"""Rows that see exactly one key return exactly that key's value, with zero gradients to q and k.

Softmax over one key is 1 whatever the logit, so o = v exactly and dS = P·(dP − rowsum(dO·O)) = 0
up to float32 rounding: dP = dO·V and rowsum(dO·O) are the same D products summed in different
orders, so dq and dk are bounded by D float32 ulps of |dO|·|V|, times |K|·scale.
Such rows arise from windows of one key, one-token documents, or any per-row interval of length
one, and they come after key blocks the row does not see at all: the online softmax must then
keep the row's running max at -inf (shifting by 0 only within the block it cannot see), or the
next block's logits are shifted by 0 instead of their own max and P underflows in fp16/bf16.
Logits from -30 to +30 cover both sides of that shift.
"""

from __future__ import annotations

import pytest
import torch

from ringflash.kernels import AttnSpec, attn_bwd, attn_fwd, attn_varlen_bwd, attn_varlen_fwd, visibility
from tests.kernels.steps import BACKEND_DEVICES, skip_unless_runs

N, H, D = 200, 2, 64  # several key blocks (the interpreter's are 64 keys; the GPU's 64-128)


def _inputs(dtype, device, seed=0):
    """q, k, v, do `(1, N, H, D)` with row i's logit against key i running over [-30, 30]."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, N, H, D, generator=g, dtype=torch.float64)
    logits = torch.linspace(-30, 30, N, dtype=torch.float64).view(1, N, 1, 1)
    # q_i = logit_i · k_i / (|k_i|² · scale) gives q_i·k_i·scale = logit_i (up to q's rounding).
    q = logits * k / (k.pow(2).sum(-1, keepdim=True) * D**-0.5)
    v, do = (torch.randn(1, N, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    return (t.to(device=device, dtype=dtype) for t in (q, k, v, do))


def _single_key_specs(q):
    """Three ways to let row i see key i alone."""
    pos = torch.arange(N, device=q.device)
    # Intervals without causality: row i's document is token i alone.
    intervals = visibility(pos, pos, causal=False, q_doc=pos, k_doc=pos)
    return {"window1": AttnSpec(causal=True, window=1), "intervals": AttnSpec(intervals=intervals)}


def _check(o, dq, dk, dv, q, k, v, do):
    assert torch.equal(o, v), f"{(o != v).sum().item()} of {o.numel()} entries differ from v"
    amax = lambda t: t.abs().max().item()
    bound = D * torch.finfo(torch.float32).eps * amax(do) * amax(v) * max(amax(q), amax(k)) * D**-0.5
    assert amax(dq) <= bound and amax(dk) <= bound, (amax(dq), amax(dk), bound)
    assert torch.equal(dv, do)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("how", ["window1", "intervals"])
def test_one_visible_key_returns_its_value(how, dtype, device, backend):
    skip_unless_runs(backend, device)
    q, k, v, do = _inputs(dtype, device)
    spec = _single_key_specs(q)[how]
    o, lse = attn_fwd(q, k, v, spec=spec, backend=backend)
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, spec=spec, backend=backend)
    _check(o, dq, dk, dv, q, k, v, do)


@pytest.mark.parametrize("backend,device", BACKEND_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_one_token_documents_return_their_value(dtype, device, backend):
    skip_unless_runs(backend, device)
    q, k, v, do = (t[0] for t in _inputs(dtype, device))
    cu = torch.arange(N + 1, dtype=torch.int32, device=device)
    o, lse = attn_varlen_fwd(q, k, v, cu, causal=True, backend=backend)
    dq, dk, dv = attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=True, backend=backend)
    _check(o, dq, dk, dv, q, k, v, do)
