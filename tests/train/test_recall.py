"""The recall task (a needle in random letters): its layout and labels, its depth buckets and the
cp ranks that hold them, and that evaluation never shows the model a sequence it trained on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ringflash.train.config import ConfigError, DataConfig, load_config
from ringflash.train.data import IGNORE, RecallTask, build_sources
from ringflash.train.evaluate import accuracy_by_owner, bucket_owners, query_owner, report
from tests.dist_utils import REPO


def recall(**kw) -> RecallTask:
    return RecallTask(DataConfig(**{"kind": "recall", "seq_len": 128, "eval_buckets": 4, **kw}))


def text(t: torch.Tensor) -> str:
    return bytes(t.to(torch.uint8).tolist()).decode()


def test_recall_sample_layout_and_labels():
    task = recall()
    x, y = task(3)
    assert x.shape == y.shape == (128,) and x.dtype == torch.int64
    seq = text(torch.cat([x, y[-1:]]))
    value = seq[-2:]
    assert value.isdigit() and seq.endswith("@" + value)
    # The marker and digits occur only in the needle and the query: the answer has one source.
    assert seq.count("@") == 2 and sum(c.isdigit() for c in seq) == 4
    assert seq.replace("@" + value, "").isalpha()
    assert (y[:-2] == IGNORE).all() and text(y[-2:]) == value  # the loss on the answer only


def test_recall_buckets_and_ranks():
    task = recall(seq_len=256, eval_buckets=8)
    for b in range(8):
        for s in task.eval_set(b, 6):
            seq = text(s.tokens)
            assert s.bucket == b and 32 * b <= s.key_pos - 1 and s.key_pos + 1 < 32 * (b + 1)  # the whole needle
            assert seq[s.key_pos - 1 : s.key_pos + 2] == seq[-3:] and seq.count("@") == 2
        positions = task.key_range(b)
        assert {p * 8 // 256 for p in positions} == {b} and positions[-1] + 1 < 256 - 2  # before the query marker
    # Zigzag over cp = 2 cuts 4 chunks: rank 0 holds chunks 0 and 3 (the query), rank 1 chunks 1 and 2.
    assert bucket_owners(task, 2, "zigzag") == [0, 0, 1, 1, 1, 1, 0, 0]
    assert query_owner(task, 2, "zigzag") == 0
    assert bucket_owners(task, 2, "contiguous") == [0] * 4 + [1] * 4 and query_owner(task, 2, "contiguous") == 1
    assert accuracy_by_owner([1.0, 0.5, 0.25, 0.75], [0, 1, 1, 0]) == {0: 0.875, 1: 0.375}
    lines = report("recall", [1.0, 0.5, 0.25, 0.75], recall(), 2, "zigzag", 8)
    assert lines[0] == "recall accuracy on 8 unseen sequences per depth bucket; the query, at the end, is on rank 0:"
    assert "held by rank 1 (another rank): 0.50" in lines[2]
    assert lines[-1] == "  by the rank holding the key: rank 0 0.88, rank 1 0.38 | lowest bucket 0.25"


def test_bucket_owners_on_a_head_grid():
    # cp = 4 as 2 ring ranks × 2 head ranks (parallel.cp_heads = 2), zigzag over 4 chunks of 64:
    # ring rank 0 holds chunks 0 and 3, cut into head pieces 0 | 3 (cp ranks 0, 1); ring rank 1
    # holds chunks 1 and 2, pieces 1 | 2 (cp ranks 2, 3). The query, at the end, is on cp rank 1.
    task = recall(seq_len=256, eval_buckets=8)
    assert bucket_owners(task, 4, "zigzag", head_world=2) == [0, 0, 2, 2, 3, 3, 1, 1]
    assert query_owner(task, 4, "zigzag", head_world=2) == 1
    assert bucket_owners(task, 4, "zigzag") == [0, 1, 2, 3, 3, 2, 1, 0]  # the ring over all 4


def test_bucket_across_two_ranks_has_no_owner_label():
    # 2 buckets over zigzag's 4 chunks: bucket 0 (tokens 1-62) is chunk 0 (rank 0) and chunk 1 (rank 1).
    # The old label named the rank of the bucket's middle token for all of it.
    task = recall(eval_buckets=2)
    with pytest.raises(ValueError, match=r"bucket 0's keys \(tokens 1-62\) are on ranks \[0, 1\]"):
        bucket_owners(task, 2, "zigzag")
    assert bucket_owners(task, 2, "contiguous") == [0, 1]
    assert bucket_owners(task, 1, "zigzag") == [0, 0]


def test_recall_eval_is_fixed_and_never_trained_on():
    cfg = load_config(REPO / "configs" / "tiny_cpu.toml")
    task, warmup = build_sources(cfg.data, cfg.model.vocab_size)
    assert isinstance(task, RecallTask)
    samples = cfg.data.eval_samples
    evals = [s.tokens for b in range(task.buckets) for s in task.eval_set(b, samples)]
    again, _ = build_sources(cfg.data, cfg.model.vocab_size)  # a fresh source, as a new process builds it
    rebuilt = [s.tokens for b in range(again.buckets) for s in again.eval_set(b, samples)]
    assert all(torch.equal(a, b) for a, b in zip(evals, rebuilt, strict=True))
    # Every training sequence the run draws (steps × batch; the warm-up's, if any): none is an
    # evaluation sequence, nor holds an evaluation haystack's first 32 bytes.
    n = cfg.train.steps * cfg.data.batch_size
    trained = [text(task(i)[0]) for i in range(n)] + ([text(warmup(i)[0]) for i in range(n)] if warmup else [])
    assert len(set(trained)) == len(trained)  # training sequences are themselves all different
    heads = {t[:32] for t in trained}
    assert not {text(t[:32]) for t in evals} & heads
    # Fresh values: spread over (nearly) every 2-digit value, not a few a model could memorise.
    assert len({text(t[-2:]) for t in evals}) > 0.8 * min(100, len(evals))


def test_recall_seed_changes_every_stream():
    a, b = recall(), recall(seed=99)
    assert not torch.equal(a(0)[0], b(0)[0]) and not torch.equal(a.eval_set(0, 1)[0].tokens, b.eval_set(0, 1)[0].tokens)


def test_recall_too_short():
    with pytest.raises(ConfigError, match=r"data.seq_len \(16\) too short for recall with 4 buckets"):
        recall(seq_len=16, eval_buckets=4)
    assert dataclasses.replace(DataConfig(), kind="recall").kind == "recall"
