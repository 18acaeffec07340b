"""flash_attn's two functions the vendored peer scripts call, as a float64 ground truth on CPU.

ringflash's own code, not the peer's: flash_attn is CUDA only, so the scripts import these
instead. Same arguments and returns as flash_attn 2.x with `return_attn_probs=True`: `(out, lse,
None)`, out in the input dtype, lse float32 `(B, H, N)` (or `(H, total)` for varlen, flash_attn's
current convention). Math in float64 with autograd, shared with nothing in ringflash; the
gradients come back in the inputs' dtype (rounded once, as flash_attn's are).
"""

import itertools

import torch


def _attention(q, k, v, causal, softmax_scale):
    """q, k, v `(N, H, D)` -> out `(N, H, D)` float64 (differentiable), lse `(H, N)` float32."""
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s.detach(), dim=-1).float()
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.double()), lse


def _check(dropout_p, window_size, alibi_slopes):
    assert dropout_p == 0 and tuple(window_size) == (-1, -1) and alibi_slopes is None, "reference: not supported"


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """qkv `(B, N, 3, H, D)`."""
    _check(dropout_p, window_size, alibi_slopes)
    outs, lses = zip(*(_attention(*x.unbind(1), causal, softmax_scale) for x in qkv))
    out = torch.stack(outs).to(qkv.dtype)
    return (out, torch.stack(lses), None) if return_attn_probs else out


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):  # fmt: skip
    """qkv `(total, 3, H, D)`, documents at offsets `cu_seqlens`."""
    _check(dropout_p, window_size, alibi_slopes)
    cu = cu_seqlens.tolist()
    outs, lses = zip(*(_attention(*qkv[a:b].unbind(1), causal, softmax_scale) for a, b in itertools.pairwise(cu)))
    out = torch.cat(outs).to(qkv.dtype)
    return (out, torch.cat(lses, dim=1), None) if return_attn_probs else out
