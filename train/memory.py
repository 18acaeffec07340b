"""Memory per rank: measured from the live tensors, and predicted by the model of docs/memory.md.

    live_bytes(model, optimizer)   # {"params", "grads", "optimizer"}: this rank's bytes (local shards)
    predict(model_cfg, seq_len=32768, batch_size=1, dp=1, cp=1, fsdp=True, activation_checkpointing=True)

`predict` counts, per rank (dict of bytes): weights, gradients and AdamW states (exactly, from the
model's parameter shapes and FSDP2's row-wise shards), FSDP's gathered blocks or autocast's weight
copies, the activations the backward keeps (per token per layer, derived below from what each op
saves), the logits and the ring's buffers; `peak` is their sum. docs/memory.md derives each term
and why the peak holds the larger of the gradients and the activations, not both.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ringflash.train.config import ModelConfig

_BYTES = {"bfloat16": 2, "float32": 4}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def live_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer states, from the live tensors.

    A DTensor (FSDP2) counts its local shard only; a tied weight counts once (`model.parameters()`
    yields it once); a gradient not yet made (None) counts 0. DDP's gradient buckets (a second copy
    of the gradients while `gradient_as_bucket_view` is off, its default) are not parameters'
    `.grad` and not counted here; `predict` counts them.
    """
    params = list(model.parameters())
    optim = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()]
    return {
        "params": _nbytes(params),
        "grads": _nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": _nbytes(v for v in optim if isinstance(v, torch.Tensor)),
    }


def memory_line(measured: dict[str, int], shards: int | None) -> str:
    """The log's line of `live_bytes`: what the rank holds, and over how many ranks FSDP2 shards it
    (`shards`; None: DDP, replicated)."""
    how = "DDP, replicated on every rank" if shards is None else f"FSDP2 over {shards} rank{'s' * (shards > 1)}"
    parts = ", ".join(f"{k} {_human(v)}" for k, v in measured.items())
    return f"memory per rank: {parts} (total {_human(sum(measured.values()))}), {how}"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    raise AssertionError


def _shard_rows(n: int, shards: int, rank: int) -> int:
    """Rows of dim 0 that `rank` holds: FSDP2 shards like `torch.chunk` (ceil(n / shards) each, the last ones fewer)."""
    size = math.ceil(n / shards)
    return max(0, min(size, n - rank * size))


def _shard_numel(shape: torch.Size, shards: int, rank: int) -> int:
    if not shape:
        return 1 if rank == 0 else 0
    return _shard_rows(shape[0], shards, rank) * math.prod(shape[1:])


def activation_bytes_per_token(cfg: ModelConfig, dtype: str) -> dict[str, float]:
    """What the backward keeps per token: one block's, and the final norm, head and loss's.

    `dtype` is the compute dtype (autocast's or FSDP's param_dtype), b bytes; the residual stream
    and the norms' float32 math are 4 bytes whatever it is. Per block (d = dim, h = ffn width, kv =
    n_kv_heads·head_dim, H = n_heads):
      2 RMSNorms:        residual input 4d, float32 normalised 4d, rounded output b·d      each
      q/k/v projections: their (shared) input                                                 b·d
      RoPE:              float32 q and k                                                      4(d + kv)
      attention:         q, k, v after RoPE, o, lse (float32, per head)                       b(2d + 2kv) + 4H
      SwiGLU:            input b·d, w1 and w3 outputs, silu(w1 x), their product              b(d + 4h)
    The head: the final norm (as above), the logits (b·V) and the float32 log-probs (4V).
    """
    b = _BYTES[dtype]
    d, H = cfg.dim, cfg.n_heads
    kv = cfg.n_kv_heads * (d // H)
    h = cfg.ffn_dim or 64 * math.ceil(8 * d / 3 / 64)
    norm = 4 * d + 4 * d + b * d
    block = 2 * norm + b * d + 4 * (d + kv) + b * (2 * d + 2 * kv) + 4 * H + b * (d + 4 * h)
    head = norm + b * cfg.vocab_size + 4 * cfg.vocab_size
    return {"block": float(block), "head": float(head), "residual": 4.0 * d}


def predict(
    model_cfg: ModelConfig,
    seq_len: int,
    batch_size: int = 1,
    dp: int = 1,
    cp: int = 1,
    fsdp: bool = True,
    activation_checkpointing: bool = False,
    dtype: str = "bfloat16",
    rank: int = 0,
    recompute_attention: bool = True,
) -> dict[str, int]:
    """Predicted bytes on one rank (`rank` of dp·cp; rank 0 holds the largest shards) for our model.

    `seq_len` is the whole context (each rank holds seq_len / cp tokens of `batch_size` sequences);
    `dtype` the compute dtype (train.dtype's, FSDP's param_dtype: bfloat16 on GPUs). Returns
    weights, gradients, optimizer, working_weights (FSDP's gathered blocks and root, or autocast's
    bf16 weight copies plus DDP's gradient buckets), activations, ring and peak (the sum).
    `recompute_attention=False` (with activation checkpointing): every layer also keeps its
    attention's outputs (`kept_attention_bytes_per_token`).
    """
    if dtype not in _BYTES:
        raise ValueError(f"dtype must be one of {', '.join(_BYTES)}, got {dtype!r}")
    shapes, block, matmul = _shapes(_fields(model_cfg))
    b, shards = _BYTES[dtype], dp * cp if fsdp else 1
    params = [torch.Size(s) for s in shapes]  # float32 masters; a tied weight once
    numel = sum(p.numel() for p in params)
    local = sum(_shard_numel(p, shards, rank) for p in params)
    root = numel - block * model_cfg.n_layers

    out = {"weights": 4 * local, "gradients": 4 * local}
    # AdamW: exp_avg and exp_avg_sq like the shard, and a float32 `step` per parameter tensor.
    out["optimizer"] = 8 * local + 4 * len(params)
    if fsdp:
        # The root's parameters stay gathered from forward to backward; a block's only while it runs,
        # with the next one prefetched (two blocks' parameters), and in the backward its gradients
        # unsharded in b bytes and again float32 for the reduce-scatter.
        out["working_weights"] = b * root + 2 * b * block + (b + 4) * block
    else:
        # Autocast keeps a bf16 copy of every matmul weight for the backward; DDP's gradient buckets
        # are a second float32 copy of the gradients.
        out["working_weights"] = (b * matmul if b < 4 else 0) + 4 * numel
    tokens = batch_size * seq_len // cp
    per = activation_bytes_per_token(model_cfg, dtype)
    if activation_checkpointing:
        # Each block keeps its input; the backward recomputes one block at a time.
        layers = per["residual"] * model_cfg.n_layers + per["block"]
        if not recompute_attention:
            layers += kept_attention_bytes_per_token(model_cfg, dtype, cp) * model_cfg.n_layers
    else:
        layers = per["block"] * model_cfg.n_layers
    # The backward of the top block (or the head) holds the gradients of its activations too.
    out["activations"] = int(tokens * (layers + per["head"] + max(per["block"], per["head"])))
    out["ring"] = int(tokens * ring_bytes_per_token(model_cfg, dtype, cp))
    # The activations peak at the start of the backward, before most gradients exist; the gradients
    # are all there only at its end, once the activations are freed (docs/memory.md sets the
    # prediction beside measured peaks). So the peak holds the larger of the two, not their sum.
    out["peak"] = (out["weights"] + out["optimizer"] + out["working_weights"] + out["ring"]
                   + max(out["activations"], out["gradients"]))  # fmt: skip
    return out


def _fields(model_cfg) -> tuple:
    """The small model's config fields, hashable for `_shapes`' cache (an HF model's inline keys are
    not the small model's shape)."""
    return tuple((k, v) for k, v in dataclasses.asdict(model_cfg).items() if not isinstance(v, (dict, list)))


@functools.lru_cache(maxsize=32)
def _shapes(fields: tuple) -> tuple[tuple[tuple[int, ...], ...], int, int]:
    """Our model's parameter shapes (built on the meta device: no memory), one block's parameter
    count and the matmul weights' count."""
    from ringflash.train.model import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig(**dict(fields)))
    shapes = tuple(tuple(p.shape) for p in model.parameters())
    block = sum(p.numel() for p in model.blocks[0].parameters())
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    return shapes, block, matmul


def kept_attention_bytes_per_token(cfg: ModelConfig, dtype: str, cp: int) -> float:
    """What one layer's attention keeps per local token through activation checkpointing when it is
    not recomputed (`train.recompute_attention = false`): its output, its float32 LSE and, on a
    ring (cp > 1), the packed K/V that came home for the backward."""
    b, hd = _BYTES[dtype], cfg.dim // cfg.n_heads
    kv_home = 2 * cfg.n_kv_heads * hd * b if cp > 1 else 0
    return cfg.n_heads * hd * b + 4 * cfg.n_heads + kv_home


def ring_bytes_per_token(cfg: ModelConfig, dtype: str, cp: int) -> float:
    """The ring backward's buffers per local token, the largest of one attention call (ringflash/ring.py):
    two K/V receive buffers, two float32 dK/dV accumulators, float32 dQ, and the rounded dQ and
    dK/dV. None at cp = 1 (one local kernel call)."""
    if cp == 1:
        return 0.0
    b, kv, d = _BYTES[dtype], cfg.n_kv_heads * (cfg.dim // cfg.n_heads), cfg.dim
    kv_block = 2 * kv * b  # packed (K, V) per token
    receive = min(2, cp - 1) * kv_block
    accumulators = 2 * (2 * kv * 4)
    return receive + accumulators + 4 * d + b * d + kv_block


# Llama-like shapes (head_dim 128, 8 K/V heads, untied embeddings) for the fits table.
SIZES = {
    "1B": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=8192),
    "3B": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim=8192),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "14B": dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_dim=13824),
    "32B": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_dim=27648),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}


def fits_table(gpus: int, gpu_gib: float, contexts: list[int], vocab_size: int, headroom: float = 0.9) -> str:
    """Markdown: predicted peak GiB per GPU of each SIZES model at each context, with cp = gpus
    (one sequence over every GPU), FSDP2 and activation checkpointing; ✓ where it stays under
    `headroom` of `gpu_gib` (the rest: the allocator's fragmentation, NCCL, the CUDA context)."""
    head = f"| model (vocab {vocab_size}) | params | " + " | ".join(f"{L // 1024}k" for L in contexts) + " |"
    lines = [head, "|" + "---|" * (len(contexts) + 2)]
    for name, shape in SIZES.items():
        cfg = ModelConfig(vocab_size=vocab_size, tie_embeddings=False, **shape)
        n = sum(math.prod(s) for s in _shapes(_fields(cfg))[0])
        cells = []
        for L in contexts:
            peak = predict(cfg, L, dp=1, cp=gpus, fsdp=True, activation_checkpointing=True)["peak"] / 2**30
            cells.append(f"{peak:,.0f} {'✓' if peak <= headroom * gpu_gib else '✗'}")
        lines.append(f"| {name} | {n / 1e9:.1f}B | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    # python -m ringflash.train.memory [GPUS] [GIB]: the fits table of docs/memory.md
    import sys

    gpus, gib = int(sys.argv[1]) if len(sys.argv) > 1 else 8, float(sys.argv[2]) if len(sys.argv) > 2 else 139.0
    for vocab in (256, 128256):
        print(fits_table(gpus, gib, [32768, 131072, 524288, 1048576], vocab), end="\n\n")
