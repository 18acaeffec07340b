"""Packed documents and sliding windows in the loop: cp = 2 equals cp = 1, documents stay apart.

The oracle is the model's own single-device core (`LocalCausalAttention` with a dense mask built
from the global document ids and `model.window`), run on whole sequences.
"""

from __future__ import annotations

import contextlib
import copy
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ringflash.train.data import IGNORE, DataLoader, build_source
from tests.dist_utils import run_ranks
from tests.tiny_config import assert_matches_reference, tiny_config


def write_docs(path: Path, n_docs: int = 200, seed: int = 0) -> Path:
    """Documents of 1..120 lowercase bytes, each ended by NUL (the text default eod_token)."""
    rng = random.Random(seed)
    docs = ["".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 120))) for _ in range(n_docs)]
    path.write_bytes(b"\0".join(d.encode() for d in docs) + b"\0")
    return path


def tiny(*overrides: str):
    return tiny_config(
        None,
        "--train.steps=4",
        "--train.warmup_steps=1",
        "--checkpoint.enabled=false",
        *overrides,
    )


def _cp_vs_single(rank, world, cfg):
    """One step's loss and gradients through cp ranks equal one process with the dense local mask."""
    import ringflash
    from ringflash.train.model import DocumentMask, Transformer
    from ringflash.train.parallel import distributed, parallelize
    from ringflash.train.trainer import forward_backward

    built, name = [], "gather_mask" if cfg.parallel.cp_scheme == "allgather" else "ring_mask"
    make = getattr(ringflash, name)
    setattr(ringflash, name, lambda *a, **kw: built.append(kw) or make(*a, **kw))
    with distributed(cfg.parallel, "cpu") as pc:
        torch.manual_seed(0)
        model = Transformer(cfg.model)
        reference = copy.deepcopy(model)  # LocalCausalAttention(model.window): the cp = 1 oracle
        ddp = parallelize(model, pc, cfg)
        source = build_source(cfg.data, cfg.model.vocab_size)
        micros = DataLoader(source, cfg.data.batch_size, cfg.train.grad_accum, 0, 1).next()
        loss = forward_backward(
            ddp, micros, pc, cfg.parallel.layout, contextlib.nullcontext(), cfg.model.attn_spec.window
        )
        assert len(built) == len(micros)  # one mask per micro-batch, shared by every layer
        window = (cfg.model.window - 1, 0) if cfg.model.window else None  # the pair: w keys counting the diagonal
        assert all(kw["window"] == window and kw["group"] is pc.cp_group for kw in built)

        n_tokens = sum(int((m[1] != IGNORE).sum()) for m in micros)
        ref_sum = 0
        for x, y, *doc in micros:
            logits = reference(x, mask=DocumentMask(doc[0]) if doc else None)
            ref_sum = ref_sum + F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
        ref_loss = ref_sum / n_tokens
        ref_loss.backward()
        assert_matches_reference(loss, ref_loss, model, reference)
        return float(loss)


@pytest.mark.parametrize(
    "overrides",
    [
        ["--data.pack_documents=true"],
        ["--model.window=40", "--parallel.layout=contiguous"],
        ["--data.pack_documents=true", "--model.window=40", "--train.grad_accum=2"],
        ["--data.pack_documents=true", "--model.window=40", "--parallel.cp_scheme=allgather"],
        ["--data.pack_documents=true", "--parallel.layout=stripe"],
    ],
    ids=["docs-zigzag", "window-contiguous", "docs-window-zigzag-accum", "docs-window-allgather", "docs-stripe"],
)
def test_cp2_matches_cp1(tmp_path, overrides):
    path = write_docs(tmp_path / "docs.txt")
    cfg = tiny("--parallel.cp=2", "--data.kind=text", f"--data.path={path}", *overrides)
    if cfg.data.pack_documents:
        # The batch really has documents that straddle the zigzag chunks (64 tokens each) and so
        # the cp shards, and several documents per sequence.
        _, _, doc = DataLoader(build_source(cfg.data, 256), cfg.data.batch_size, 1, 0, 1).batch(0, 0)
        chunk = cfg.data.seq_len // 4
        assert any(bool((doc[:, c - 1] == doc[:, c]).any()) for c in (chunk, 2 * chunk, 3 * chunk))
        assert int(doc[:, -1].min()) >= 2, doc[:, -1]
    results = run_ranks(_cp_vs_single, 2, args=(cfg,))
    assert results[0] == results[1]


def _isolation(rank, world, cfg, seqs):
    """Logits of the last document under cp = 2, for sequences that differ only before it."""
    from ringflash.train.model import Transformer
    from ringflash.train.parallel import attention_mask, distributed, parallelize, shard_batch

    with distributed(cfg.parallel, "cpu") as pc, torch.no_grad():
        torch.manual_seed(0)
        raw = Transformer(cfg.model)
        parallelize(raw, pc, cfg)
        out = []
        for tokens, doc_ids in seqs:
            mask = attention_mask(doc_ids, tokens.shape[1], pc, cfg.parallel.layout)
            x, keep, pos = shard_batch(tokens, (doc_ids == doc_ids[:, -1:]).long(), pc, cfg.parallel.layout)
            out.append(raw(x, pos, mask=mask)[keep.bool()])  # the last document's rows on this rank
        torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-5)  # the earlier document is unseen
        without = raw(*shard_batch(seqs[0][0], seqs[0][1], pc, cfg.parallel.layout)[::2])
        return float((out[0] - without[keep.bool()]).abs().max())  # but seen without the mask


def test_documents_do_not_see_each_other_across_ranks():
    # One document of 150 tokens, then one of 106 that straddles both ranks' zigzag shards;
    # swapping the first document's content must not move the second's logits by a bit.
    cfg = tiny("--parallel.cp=2")
    g = torch.Generator().manual_seed(0)
    second = torch.randint(0, 256, (1, 106), generator=g)
    doc_ids = torch.cat([torch.zeros(1, 150), torch.ones(1, 106)], 1).long()
    seqs = [(torch.cat([torch.randint(0, 256, (1, 150), generator=g), second], 1), doc_ids) for _ in range(2)]
    changed = run_ranks(_isolation, 2, args=(cfg, seqs))
    assert min(changed) > 1e-4  # the check has teeth: without the mask the first document leaks in


def _train_in_ranks(rank, world, cfg):
    from ringflash.train.trainer import train

    result = train(cfg)
    return result.losses, result.passkey


def test_trainer_packed_text_and_windowed_passkey(tmp_path):
    path = write_docs(tmp_path / "docs.txt")
    docs = tiny(
        "--parallel.cp=2",
        "--train.steps=2",
        "--data.kind=text",
        f"--data.path={path}",
        "--data.pack_documents=true",
        "--model.window=64",
    )
    losses, _ = run_ranks(_train_in_ranks, 2, args=(docs,))[0]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses.values())
    # The passkey evaluation runs through the same windowed attention as training.
    passkey = tiny(
        "--parallel.cp=2",
        "--train.steps=1",
        "--model.window=32",
        "--data.seq_len=512",
        "--data.eval_buckets=4",
        "--data.eval_samples=2",
    )
    _, acc = run_ranks(_train_in_ranks, 2, args=(passkey,))[0]
    assert len(acc) == 4


def test_no_mask_without_documents_or_window():
    from ringflash.train.parallel import attention_mask

    # Plain causal training builds nothing (pc is not even looked at).
    assert attention_mask(None, 256, None, "zigzag", None) is None


def _pairs_brute(doc_ids: torch.Tensor, window: int | None) -> float:
    """(query, key) pairs of causal attention within each document (and window), counted on the
    dense mask, with FlashAttention's n²/2 for a document no window cuts (its diagonal counts half)."""
    total = 0.0
    for row in doc_ids.reshape(-1, doc_ids.shape[-1]):
        for n in torch.unique_consecutive(row, return_counts=True)[1].tolist():
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            seen = j <= i
            if window is not None and window < n:
                total += float((seen & (i - j < window)).sum())  # exact
            else:
                total += n * n / 2
    return total


@pytest.mark.parametrize("window", [None, 1, 7, 40, 1000])
def test_model_flops_count_only_the_masked_attention(window):
    from ringflash.train.config import ModelConfig
    from ringflash.train.metrics import attended_keys, flops_per_token

    L = 96
    doc = torch.stack([torch.repeat_interleave(torch.arange(5), torch.tensor([1, 17, 40, 3, 35])),
                       torch.repeat_interleave(torch.arange(2), torch.tensor([50, 46]))])  # fmt: skip
    assert attended_keys(L, window, doc) == pytest.approx(_pairs_brute(doc, window) / doc.numel())
    one_doc = torch.zeros(1, L, dtype=torch.long)
    assert attended_keys(L, window, one_doc) == pytest.approx(attended_keys(L, window))  # None: one document
    if window is None:
        assert attended_keys(L) == L / 2  # FlashAttention's causal convention
    # The attention term of the model FLOPs scales with these keys; documents only ever remove work.
    cfg = ModelConfig(dim=64, n_layers=3, n_heads=2, n_kv_heads=1, vocab_size=256, window=window or 0)  # TOML's 0
    attn = flops_per_token(cfg, 0, L, doc)
    assert attn == pytest.approx(12 * 3 * 64 * attended_keys(L, window, doc))
    assert flops_per_token(cfg, 1000, L, doc) == pytest.approx(attn + 6000)
    assert attn < flops_per_token(cfg, 0, L)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_attended_keys_refuse_a_window_that_is_not_one(window):
    from ringflash.train.metrics import attended_keys

    # No window is None; a 0 that counted as "off" would report full causal work for a one-key window.
    with pytest.raises(ValueError, match=rf"window must be a positive int .* or None, got {window!r}"):
        attended_keys(96, window)
