"""A decoder-only transformer: RMSNorm, RoPE, SwiGLU, grouped-query attention.

The model knows nothing about distribution. Each block's attention calls `self.core(q, k, v)`
on `(B, N, H, D)` / `(B, N, Hkv, D)` tensors; by default that is causal attention over the local
sequence, and `train.parallel.parallelize` swaps in `RingFlashAttention` over the cp group.
`Transformer.forward(idx, pos, mask)` hands an optional attention mask, unopened, to every
block's core as `core(q, k, v, mask=mask)`: whoever swapped the core in builds a mask it
understands (the trainer: `ringflash.ring_mask`, once per batch). The default core understands
`DocumentMask` and rejects anything else. For
the same reason RoPE takes explicit positions: under context parallelism a rank holds tokens
from several places in the sequence (zigzag), and each must be rotated by its *global* position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ringflash.kernels import AttnSpec
from ringflash.train.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the autocast dtype: the mean of squares is what overflows.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_angles(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `(N, head_dim/2)` float32 for integer positions `pos (N,)`."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=pos.device, dtype=torch.float64) / head_dim)
    # float64 for the product: at positions ~1e6 float32 angles lose the low-frequency bits.
    angles = pos.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x (B, N, H, D)` pairwise (x[2i], x[2i+1]) by the angles `(N, D/2)`."""
    xf = x.float().unflatten(-1, (-1, 2))  # (B, N, H, D/2, 2)
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).to(x.dtype)


@dataclass(frozen=True)
class DocumentMask:
    """The default core's mask: packed documents that never attend across their boundaries.

    `doc_ids (B, N)` integer, the document of every position of the (whole, unsharded) sequence,
    non-decreasing along each row.
    """

    doc_ids: torch.Tensor


class LocalCausalAttention(nn.Module):
    """Causal softmax attention over the local sequence: the model's default `core`.

    `window` (None: off; the library's causal window, `ModelConfig.attn_spec`) restricts query i
    to keys i − window < j <= i; a `DocumentMask` further to keys of its own document. Both are
    built as a dense boolean mask: this core is the single-device reference and CPU path, not the
    fast one.
    """

    def __init__(self, window: int | None = None):
        super().__init__()
        self.window = AttnSpec(causal=True, window=window).window  # raises naming window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        B, N = q.shape[:2]
        if mask is not None and not isinstance(mask, DocumentMask):
            raise TypeError(
                f"mask: LocalCausalAttention takes a train.model.DocumentMask, got {type(mask).__name__} "
                "(a ring mask needs the ring attention core that train.parallel.parallelize installs)"
            )
        if mask is not None and mask.doc_ids.shape != (B, N):
            raise ValueError(f"mask.doc_ids: expected shape {(B, N)}, got {tuple(mask.doc_ids.shape)}")
        # SDPA wants (B, H, N, D); enable_gqa shares each k/v head across its query group.
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if mask is None and self.window is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True).transpose(1, 2)
        i = torch.arange(N, device=q.device)
        offset = i[:, None] - i[None, :]  # (N, N) query minus key position
        allowed = offset >= 0
        if self.window is not None:
            allowed = allowed & (offset <= self.window[0])  # the pair (w - 1, 0)
        if mask is not None:
            doc = mask.doc_ids.to(q.device)
            allowed = allowed & (doc[:, :, None] == doc[:, None, :])  # (B, N, N)
            allowed = allowed[:, None]  # (B, 1, N, N): one mask for every head
        # Every row sees at least its own diagonal, so no row is all masked (no NaN).
        return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, enable_gqa=True).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.core: nn.Module = LocalCausalAttention(cfg.attn_spec.window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, N, _ = x.shape
        q = self.wq(x).view(B, N, self.n_heads, self.head_dim)  # (B, N, H, D)
        k = self.wk(x).view(B, N, self.n_kv_heads, self.head_dim)  # (B, N, Hkv, D)
        v = self.wv(x).view(B, N, self.n_kv_heads, self.head_dim)  # (B, N, Hkv, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Without a mask the core is called as before, so a core that takes no mask still works.
        o = self.core(q, k, v) if mask is None else self.core(q, k, v, mask=mask)  # (B, N, H, D)
        return self.wo(o.reshape(B, N, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.ffn_dim or 64 * math.ceil(8 * cfg.dim / 3 / 64)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("wo.weight", "w2.weight")):
                # GPT-2's scaled init: each block adds two residual branches, so the stream's
                # variance stays O(1) at depth if each branch is scaled by 1/sqrt(2·n_layers).
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None, mask=None) -> torch.Tensor:
        """Logits `(B, N, vocab)` for tokens `idx (B, N)` at global positions `pos (N,)` (default 0..N-1).

        `mask`: None (causal, or the core's own window), or an attention mask the blocks' cores
        understand, passed to each of them unchanged (module docstring).
        """
        if pos is None:
            pos = torch.arange(idx.shape[1], device=idx.device)
        cos, sin = rope_angles(pos, self.cfg.dim // self.cfg.n_heads, self.cfg.rope_theta)
        x = self.tok_emb(idx)  # (B, N, dim)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self.lm_head(self.norm(x))  # (B, N, vocab)

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight is counted once
        if exclude_embedding:
            n -= self.tok_emb.weight.numel()
        return n
