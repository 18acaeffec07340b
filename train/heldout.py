"""Held-out loss of a text or token corpus (`data.heldout`), in bits per byte (bits per token for bin).

Byte-level text has one token per byte, so the mean cross-entropy in nats over the scored tokens,
divided by ln 2, is bits per byte: the unit compression results are given in, comparable across
tokenizers. An appended end-of-document token counts as one byte (it ends the file, like a final
newline). The sequences are fixed (`TokenWindows.spread`), packed with their document mask and
sharded over cp exactly as in training, so the number moves only with the model.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ringflash.train.config import Config
from ringflash.train.data import IGNORE, TokenWindows, build_heldout
from ringflash.train.parallel import ParallelContext, attention_mask, shard_batch


def bits_per_byte(loss_sum_nats: float, n_tokens: int) -> float:
    """Mean bits per scored token from a summed cross-entropy in nats; per byte when tokens are bytes."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens: must be > 0, got {n_tokens}")
    return loss_sum_nats / n_tokens / math.log(2)


@torch.no_grad()
def heldout_bits(
    model: nn.Module,
    windows: TokenWindows,
    starts: list[int],
    pc: ParallelContext,
    layout: str,
    batch_size: int,
    autocast: contextlib.AbstractContextManager,
    window: int | None = None,
    mask_fn=None,
) -> float:
    """Bits per token over the held-out sequences starting at `starts` (the same float on every rank).

    dp ranks split `starts` (its length a multiple of dp, so every rank runs the same number of
    forwards: FSDP's all-gathers need them all); the cp ranks of a dp group share theirs.
    `window` and `mask_fn` as in `trainer.forward_backward`.
    """
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=pc.device)  # (nats, scored tokens)
    mine = starts[pc.dp_rank :: pc.dims.dp]
    for i in range(0, len(mine), batch_size):
        inputs, labels, *doc_ids = (torch.stack(c) for c in zip(*(windows.window(s) for s in mine[i : i + batch_size])))
        doc = doc_ids[0] if doc_ids else None
        L = inputs.shape[1]
        mask = mask_fn(doc, L) if mask_fn is not None else attention_mask(doc, L, pc, layout, window)
        x, y, pos = shard_batch(inputs, labels, pc, layout)
        with autocast:
            logits = model(x, pos, mask=mask)  # (B, L/cp, vocab)
        total[0] += F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE, reduction="sum")
        total[1] += (y != IGNORE).sum()
    dist.all_reduce(total)  # each scored token lives on exactly one rank
    model.train(was_training)
    return bits_per_byte(float(total[0]), int(total[1]))


class HeldOut:
    """The trainer's held-out evaluation, called at step 0, every `train.eval_every` steps and at
    the end: logs and returns bits per byte (per token for bin)."""

    def __init__(self, cfg: Config, pc: ParallelContext, model: nn.Module, windows: TokenWindows, autocast, mask_fn,
                 log):  # fmt: skip
        self.cfg, self.pc, self.model, self.windows = cfg, pc, model, windows
        self.autocast, self.mask_fn, self.log = autocast, mask_fn, log
        dp = pc.dims.dp
        self.starts = windows.spread(-(-cfg.data.eval_samples // dp) * dp)  # a multiple of dp
        self.unit = "bpb" if cfg.data.kind == "text" else "bits/token"

    @classmethod
    def build(
        cls, cfg: Config, pc: ParallelContext, model: nn.Module, source, autocast, mask_fn, log
    ) -> HeldOut | None:
        """None without `data.heldout` or `data.eval_samples`; else the evaluator, after logging
        what training (`source`, a `TokenWindows`) and the held-out part read."""
        windows = build_heldout(cfg.data, cfg.model.vocab_size) if cfg.data.eval_samples else None
        if windows is None:
            return None
        train, held = source.corpus, windows.corpus
        log.print(
            f"data: training on {train.files} files, {train.bytes:,} bytes ({train.what}); "
            f"held out {held.files} files, {held.bytes:,} bytes ({held.what})"
        )
        return cls(cfg, pc, model, windows, autocast, mask_fn, log)

    def __call__(self, step: int) -> float:
        c = self.cfg
        bits = heldout_bits(self.model, self.windows, self.starts, self.pc, c.parallel.layout, c.data.batch_size,
                            self.autocast, c.model.attn_spec.window, self.mask_fn)  # fmt: skip
        self.log.scalars(step, {"heldout/bpb" if self.unit == "bpb" else "heldout/bits_per_token": bits})
        self.log.print(f"step {step:6d} | held-out {bits:.4f} {self.unit} ({len(self.starts)} sequences)")
        return bits
