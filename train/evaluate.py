"""Retrieval accuracy (passkey, recall) by depth of the key, with every sequence sharded like in training.

A sequence counts as retrieved when the argmax at every answer position is the right token
(under teacher forcing, which equals greedy decoding exactly when all of them are right). The
answer sits at the end of the sequence, on one cp rank, while the key sits at any depth, on any
rank: a bucket whose keys live on another rank than the answer measures the ring's reach.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from ringflash.train.data import IGNORE, PasskeyTask, RecallTask
from ringflash.train.parallel import ParallelContext, attention_mask, shard_batch


def _position_owners(L: int, cp: int, layout: str, head_world: int = 1) -> torch.Tensor:
    """`(L,)` the cp rank that holds each position of a sequence of `L` tokens (on a grid of
    `head_world` head ranks, `parallel.cp_heads`: each ring shard cut into consecutive pieces)."""
    import ringflash

    owner = torch.empty(L, dtype=torch.long)
    for r in range(cp):
        ring_rank, head_rank = ringflash.grid_coords(r, head_world)
        owner[ringflash.global_positions(L // cp, ring_rank, cp // head_world, layout=layout, head_rank=head_rank,
                                         head_world=head_world)] = r  # fmt: skip
    return owner


def bucket_owners(task: PasskeyTask | RecallTask, cp: int, layout: str, head_world: int = 1) -> list[int]:
    """The cp rank that holds the keys of each depth bucket's evaluation samples; a bucket whose
    keys lie on two ranks has no such rank (data.eval_buckets must be a multiple of 2·cp or cp)."""
    owner = _position_owners(task.L, cp, layout, head_world)
    owners = []
    for b in range(task.buckets):
        keys = task.key_range(b)
        ranks = sorted(set(owner[keys.start : keys.stop].tolist()))
        if len(ranks) > 1:
            raise ValueError(
                f"data.eval_buckets = {task.buckets}: bucket {b}'s keys (tokens {keys[0]}-{keys[-1]}) are on "
                f"ranks {ranks} ({layout}, cp = {cp}); use a multiple of {2 * cp if layout == 'zigzag' else cp}"
            )
        owners.append(ranks[0])
    return owners


def query_owner(task: PasskeyTask | RecallTask, cp: int, layout: str, head_world: int = 1) -> int:
    """The cp rank that predicts the answer: it holds the sequence's last input position."""
    return int(_position_owners(task.L, cp, layout, head_world)[task.L - 1])


def accuracy_by_owner(acc: list[float], owners: list[int]) -> dict[int, float]:
    """Mean accuracy over the buckets whose keys each rank holds (buckets have equal samples)."""
    return {r: sum(a for a, o in zip(acc, owners) if o == r) / owners.count(r) for r in sorted(set(owners))}


def report(
    name: str, acc: list[float], task: PasskeyTask | RecallTask, cp: int, layout: str, samples: int,
    head_world: int = 1,
) -> list[str]:
    """The closing table: accuracy per depth bucket, where its keys are, which rank holds them."""
    owners, query = bucket_owners(task, cp, layout, head_world), query_owner(task, cp, layout, head_world)
    lines = [
        f"{name} accuracy on {samples} unseen sequences per depth bucket; the query, at the end, is on rank {query}:"
    ]
    for b, (a, r) in enumerate(zip(acc, owners)):
        lo, hi = task.key_range(b)[0], task.key_range(b)[-1]
        where = "the query's rank" if r == query else "another rank"
        lines.append(f"  bucket {b}: key at tokens {lo:>5d}-{hi:<5d} held by rank {r} ({where}): {a:.2f}")
    by_rank = accuracy_by_owner(acc, owners)
    lines.append(
        "  by the rank holding the key: "
        + ", ".join(f"rank {r} {a:.2f}" for r, a in by_rank.items())
        + f" | lowest bucket {min(acc):.2f}"
    )
    return lines


@torch.no_grad()
def evaluate_passkey(
    model: nn.Module,
    task: PasskeyTask | RecallTask,
    pc: ParallelContext,
    layout: str,
    samples_per_bucket: int,
    batch_size: int,
    autocast: contextlib.AbstractContextManager,
    window: tuple[int, int] | None = None,
) -> list[float]:
    """Retrieval accuracy per depth bucket (the same list on every rank) of a passkey or recall task.
    `window`: the model's sliding window (`ModelConfig.attn_spec`, None: none), applied as in training."""
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
            labels[:, : -task.answer_len] = IGNORE  # score the answer only, whatever the training loss
            x, y, pos = shard_batch(tokens[:, :-1], labels, pc, layout)
            with autocast:
                logits = model(x, pos, mask=mask)  # (B, L/cp, vocab)
            hits = ((logits.argmax(-1) == y) & (y != IGNORE)).sum(1)  # (B,) digits right on this rank
            dist.all_reduce(hits, group=pc.cp_group)  # the answer may straddle shards
            correct[b] += (hits == task.answer_len).sum()
    dist.all_reduce(correct, group=pc.dp_group)
    model.train(was_training)
    return (correct.float() / samples_per_bucket).tolist()
