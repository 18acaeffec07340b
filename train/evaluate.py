"""Passkey retrieval accuracy by depth of the key, with every sequence sharded like in training.

A sequence counts as retrieved when the argmax at every answer position is the right digit
(under teacher forcing, which equals greedy decoding exactly when all digits are right). The
answer sits at the end of the sequence, on one cp rank, while the key sits at any depth, on any
rank: a bucket whose keys live on another rank than the answer measures the ring's reach.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ringflash.train.data import IGNORE, PasskeyTask
from ringflash.train.parallel import ParallelContext, attention_mask, shard_batch


def bucket_owners(task: PasskeyTask, cp: int, layout: str) -> list[int]:
    """The cp rank that holds the first key digit of each depth bucket's evaluation samples."""
    import ringflash

    n_local = task.L // cp
    owner = torch.empty(task.L, dtype=torch.long)
    for r in range(cp):
        owner[ringflash.global_positions(n_local, r, cp, layout=layout)] = r
    return [int(owner[task.key_range(b)[len(task.key_range(b)) // 2]]) for b in range(task.buckets)]


@torch.no_grad()
def evaluate_passkey(
    model: nn.Module,
    task: PasskeyTask,
    pc: ParallelContext,
    layout: str,
    samples_per_bucket: int,
    batch_size: int,
    autocast: contextlib.AbstractContextManager,
    window: int = 0,
) -> list[float]:
    """Retrieval accuracy per depth bucket (the same list on every rank). `window`: the model's
    sliding window (`model.window`, 0: none), applied as in training."""
    was_training = model.training
    model.eval()
    mask = attention_mask(None, task.L, pc, layout, window)  # None without a window; one for every batch
    correct = torch.zeros(task.buckets, dtype=torch.long, device=pc.device)
    for b in range(task.buckets):
        # dp ranks split the bucket's fixed samples; the cp ranks of one dp group share them.
        mine = task.eval_set(b, samples_per_bucket)[pc.dp_rank :: pc.dims.dp]
        for i in range(0, len(mine), batch_size):
            tokens = torch.stack([s.tokens for s in mine[i : i + batch_size]])  # (B, L + 1)
            labels = tokens[:, 1:].clone()
            labels[:, : -task.digits] = IGNORE  # score the answer only, whatever the training loss
            x, y, pos = shard_batch(tokens[:, :-1], labels, pc, layout)
            with autocast:
                logits = model(x, pos, mask=mask)  # (B, L/cp, vocab)
            hits = ((logits.argmax(-1) == y) & (y != IGNORE)).sum(1)  # (B,) digits right on this rank
            dist.all_reduce(hits, group=pc.cp_group)  # the answer may straddle shards
            correct[b] += (hits == task.digits).sum()
    dist.all_reduce(correct, group=pc.dp_group)
    model.train(was_training)
    return (correct.float() / samples_per_bucket).tolist()
