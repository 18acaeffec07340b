"""ringflash.hf: transformers models through the ring equal the same models with HF's own attention.

Tiny random-init Llama, Qwen2/Qwen3 and Mistral configs in float32 on gloo ranks (cp = 2, 3;
zigzag and contiguous; the ring and the all-gather): the loss and every parameter's gradient,
summed over the cp ranks, equal `attn_implementation="sdpa"` on the whole sequence in one
process; packed documents (position_ids restarting at 0) equal the documents run one by one;
sliding windows (Mistral's, Qwen2's per-layer `layer_types`) equal HF's windowed sdpa, with
windows shorter than the sequence. Bad input fails on every rank with a clear message.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import re
import time

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="ringflash.hf needs transformers (pip install '.[hf]')")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ringflash  # noqa: E402
import ringflash.hf as rh  # noqa: E402
from tests.dist_utils import RankFailure, run_ranks  # noqa: E402

VOCAB, N = 128, 48  # 48 splits over 2·2 and 2·3 zigzag chunks


def tiny_config(kind: str, **extra):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rope_theta=500.0)  # fmt: skip
    if kind == "llama":
        return transformers.LlamaConfig(**common, **extra)
    if kind == "qwen2":  # layer 0 full, layer 1 sliding (max_window_layers = 1)
        return transformers.Qwen2Config(**{**common, "use_sliding_window": True, "sliding_window": 7,
                                           "max_window_layers": 1, **extra})  # fmt: skip
    if kind == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, **extra)
    if kind == "mistral":
        return transformers.MistralConfig(**{**common, "sliding_window": 9, **extra})
    if kind == "gemma2":
        return transformers.Gemma2Config(**common, head_dim=16, **extra)
    raise ValueError(kind)


def models(kind: str, **extra):
    """(ring model, sdpa reference) with equal weights, float32."""
    cfg = tiny_config(kind, **extra)
    torch.manual_seed(0)
    ring = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=rh.ATTN_IMPLEMENTATION)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ref.load_state_dict(ring.state_dict())
    return ring, ref


def make_batch(case: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if case == "packed":  # DataCollatorWithFlattening: one row, positions restart, -100 at each document start
        lengths = [13, 5, 22, 8]
        ids = torch.randint(0, VOCAB, (1, N), generator=g)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[pos == 0] = -100
        return {"input_ids": ids, "labels": labels, "position_ids": pos}
    ids = torch.randint(0, VOCAB, (2, N), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # some tokens take no loss
    batch = {"input_ids": ids, "labels": labels}
    if case == "padded":  # right padding, as a tokenizer's collator pads for training
        mask = torch.ones(2, N, dtype=torch.long)
        mask[1, 40:] = 0
        labels[1, 40:] = -100
        batch["attention_mask"] = mask
    return batch


def reference_loss(ref, batch: dict, case: str) -> torch.Tensor:
    """The single-process loss: the whole sequence, or for packed rows each document on its own."""
    if case != "packed":
        kw = {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}
        return ref(input_ids=batch["input_ids"], labels=batch["labels"], **kw).loss
    starts = [*(batch["position_ids"][0] == 0).nonzero().flatten().tolist(), N]
    total, count = 0.0, 0
    for a, b in itertools.pairwise(starts):
        logits = ref(input_ids=batch["input_ids"][:, a:b]).logits[0, :-1]
        target = batch["labels"][0, a + 1 : b]
        total = total + F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        count += int((target != -100).sum())
    return total / count


def _vs_sdpa(rank, world, kind, layout, case, scheme):
    torch.manual_seed(0)
    ring, ref = models(kind)
    batch = make_batch(case)
    shard = rh.shard_batch(batch, dist.group.WORLD, layout, scheme=scheme, config=ring.config)
    # The scheme's own masks: a layer that ran the ring on them would raise.
    want_mask = ringflash.GatherMask if scheme == "allgather" else ringflash.RingMask
    assert all(isinstance(m, want_mask) for m in shard["ring_masks"].masks.values())
    loss = ring(**shard).loss  # this rank's token losses / the global count
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    want = reference_loss(ref, batch, case)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ring.named_parameters(), ref.parameters(), strict=True):
        g = p.grad.clone()
        dist.all_reduce(g)  # cp ranks hold different tokens: their gradients add up
        torch.testing.assert_close(g, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    if case == "packed":  # HF's own packed handling agrees too, but only without a KV cache: with
        # one (use_cache defaults to True, even in training) it ignores the restarts silently.
        torch.testing.assert_close(ref(**batch, use_cache=False).loss, want, rtol=1e-5, atol=1e-6)
    return float(loss)


@pytest.mark.parametrize(
    ("kind", "world", "layout", "case", "scheme"),
    [
        ("llama", 2, "zigzag", "plain", "ring"),
        ("llama", 3, "contiguous", "plain", "ring"),
        ("llama", 3, "zigzag", "packed", "ring"),
        ("llama", 2, "contiguous", "packed", "ring"),
        ("llama", 2, "zigzag", "padded", "ring"),
        ("qwen2", 2, "zigzag", "plain", "ring"),  # per-layer windows: layer_types
        ("qwen2", 3, "contiguous", "packed", "ring"),
        ("qwen3", 3, "zigzag", "plain", "ring"),
        ("mistral", 3, "zigzag", "plain", "ring"),  # sliding_window on every layer
        ("mistral", 2, "contiguous", "packed", "ring"),
        ("llama", 2, "zigzag", "packed", "allgather"),
        ("llama", 2, "stripe", "padded", "allgather"),
        ("qwen2", 3, "zigzag", "packed", "allgather"),  # a full and a sliding layer over documents
        ("mistral", 2, "contiguous", "packed", "allgather"),
    ],
)
def test_matches_sdpa(kind, world, layout, case, scheme):
    losses = run_ranks(_vs_sdpa, world, (kind, layout, case, scheme), timeout_s=90)
    assert len(set(losses)) == 1  # every rank reports the global loss


def test_window_bites():
    """The windows of the tests above change the loss (else their equality would prove nothing)."""
    for kind, key in (("mistral", "sliding_window"), ("qwen2", "use_sliding_window")):
        _, windowed = models(kind)
        _, full = models(kind, **{key: None if key == "sliding_window" else False})
        batch = make_batch("plain")
        with torch.no_grad():
            assert abs(windowed(**batch).loss - full(**batch).loss) > 1e-4, kind


def test_layer_windows():
    assert rh.layer_window(tiny_config("qwen2"), 0) is None
    assert rh.layer_window(tiny_config("qwen2"), 1) == 7
    assert rh.layer_window(tiny_config("mistral"), 0) == 9
    assert rh.layer_window(tiny_config("llama"), 1) is None
    assert rh.model_windows(tiny_config("qwen2")) == {None, 7}


def test_doc_ids_from_positions():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    assert rh.doc_ids_from_positions(pos).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    pad = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])
    assert rh.doc_ids_from_positions(torch.arange(8)[None], pad).tolist() == [[0] * 6 + [1] * 2]


def test_name_is_not_flash():
    from transformers.utils.generic import is_flash_attention_requested

    assert "flash" not in rh.ATTN_IMPLEMENTATION
    assert not is_flash_attention_requested(requested_attention_implementation=rh.ATTN_IMPLEMENTATION)


def test_single_process_and_set_attn_implementation():
    """One process, no torch.distributed: the ring is one local call; the model switches both ways."""
    ring, ref = models("llama")
    batch = make_batch("plain")
    with torch.no_grad():
        want = ref(**batch).loss
        torch.testing.assert_close(ring(**rh.shard_batch(batch, config=ring.config)).loss, want)
        ring.set_attn_implementation("sdpa")
        ring.set_attn_implementation(rh.ATTN_IMPLEMENTATION)
        assert ring.config._attn_implementation == rh.ATTN_IMPLEMENTATION
        # A plain HF call (no shard_batch): HF shifts the labels itself; an all-ones mask is accepted.
        ones = torch.ones_like(batch["input_ids"])
        torch.testing.assert_close(ring(**batch, attention_mask=ones).loss, want)
        with pytest.raises(ValueError, match="attention_mask: ring attention does not take a padding mask"):
            ring(**make_batch("padded"))


def test_context_parallel_allgather_without_ring_masks():
    """A plain model call inside `context_parallel(scheme="allgather")` runs the all-gather with each
    layer's window (no masks from shard_batch); bad settings are named."""
    ring, ref = models("mistral")
    batch = make_batch("plain")
    with rh.context_parallel(scheme="allgather", heads_k_stride=2):
        loss = ring(**batch).loss
    torch.testing.assert_close(loss, ref(**batch).loss)
    seen, stack = set(), [loss.grad_fn]  # the autograd graph holds the all-gather's function, not the ring's
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(f for f, _ in fn.next_functions)
    nodes = {type(fn).__name__ for fn in seen}
    assert "_EagerAllGatherBackward" in nodes and "_EagerRingAttnBackward" not in nodes, nodes
    with pytest.raises(ValueError, match=r"scheme must be one of \('ring', 'allgather'\), got 'tree'"):
        rh.shard_batch(batch, scheme="tree")
    with pytest.raises(ValueError, match=r"heads_k_stride must be a positive int \(K/V heads per gather\), got 0"):
        rh.RingContext(scheme="allgather", heads_k_stride=0)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (dict(attention_dropout=0.1), r"config.attention_dropout = 0.1: ring attention has no attention dropout"),
    ],
)
def test_refuses_features_single_process(extra, match):
    ring, _ = models("llama", **extra)
    with pytest.raises(ValueError, match=match):
        ring(**make_batch("plain"))


def _bad(rank, world, what):
    if what == "softcap":  # the ranks' Gemma2 configs cap differently: the agreement check names it
        cfg = tiny_config("gemma2", final_logit_softcapping=None, attn_logit_softcapping=30.0 + 20 * rank)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=rh.ATTN_IMPLEMENTATION)
        model(**rh.shard_batch(make_batch("plain"), config=cfg))
    elif what == "length":
        batch = make_batch("plain")
        rh.shard_batch({k: v[:, :46] for k, v in batch.items()})
    elif what == "mismatch":  # a rank holds another batch length
        ring, _ = models("llama")
        batch = make_batch("plain")
        n = N if rank == 0 else N - 4
        ring(**rh.shard_batch({k: v[:, :n] for k, v in batch.items()}))
    elif what == "scheme":  # rank 1 alone asks for the all-gather: shard_batch's check names it
        rh.shard_batch(make_batch("plain"), scheme="allgather" if rank else "ring")
    elif what == "mismatch-docs":  # same shapes, other documents: shard_batch's digest catches it
        ring, _ = models("llama")
        batch = make_batch("packed")
        if rank == 1:
            batch["position_ids"] = torch.arange(N)[None]
        ring(**rh.shard_batch(batch, check_ranks=True))
    elif what == "mask-on-one-rank":  # a dense mask reaches attention on rank 0 only
        ring, _ = models("llama")
        shard = rh.shard_batch(make_batch("plain"))
        if rank == 0:
            shard["attention_mask"] = torch.ones(2, 1, N // 2, N // 2, dtype=torch.bool)
        ring(**shard)
    elif what == "varlen-kwargs-on-one-rank":  # flash-attention's packing reaches attention on rank 1 only
        ring, _ = models("llama")
        shard = rh.shard_batch(make_batch("plain"))
        if rank == 1:
            shard["cu_seq_lens_q"] = shard["cu_seq_lens_k"] = torch.tensor([0, 10, N // 2], dtype=torch.int32)
        ring(**shard)


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("softcap", r"softcap is 30.0 on rank 0, 50.0 on rank 1"),
        ("length", r"batch\['input_ids'\] has 46 tokens per row: layout='zigzag' over world=2 ranks"),
        ("mismatch", r"shard_batch inputs differ between the ranks of the group: input_ids shape is \(2, 48\) on "
                     r"rank 0, \(2, 44\) on rank 1"),
        ("scheme", r"shard_batch inputs differ between the ranks of the group: scheme is ring on rank 0, "
                   r"allgather on rank 1"),
        ("mismatch-docs", r"shard_batch inputs differ between the ranks of the group: batch\['position_ids'\] "
                          r"\(digest\) is [0-9a-f]{16} on rank 0, [0-9a-f]{16} on rank 1"),
        ("mask-on-one-rank", None),
        ("varlen-kwargs-on-one-rank", None),
    ],
)  # fmt: skip
def test_bad_input_fails_every_rank(what, match):
    with pytest.raises(RankFailure) as info:
        run_ranks(_bad, 2, (what,), timeout_s=30)
    errors = info.value.errors
    assert sorted(errors) == [0, 1], errors  # every rank raised, none hung
    for tb in errors.values():
        assert "did not finish" not in tb
        if match is not None:
            assert re.search(match, tb), tb
    if what == "mask-on-one-rank":
        assert "ring attention takes no dense mask" in errors[0]
        assert "rank(s) [0] of the group rejected their inputs" in errors[1]
    if what == "varlen-kwargs-on-one-rank":
        assert (
            "ValueError: cu_seq_lens_q, cu_seq_lens_k: ring attention does not read flash-attention's varlen "
            "arguments; give packed documents as position_ids restarting at 0 to ringflash.hf.shard_batch and call "
            "the model with its shard\n" in errors[1]
        ), errors[1]
        assert "rank(s) [1] of the group rejected their inputs" in errors[0]


def _answer(fn) -> tuple[str, str, float]:
    """`fn()`'s error (type, message) and how long it took to come, after waiting for every rank
    in a barrier of its own: a rank that raised stays alive, so a rank left waiting for it is
    answered or times out (RuntimeError), never released by a closed connection."""
    alive = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=90))
    start = time.monotonic()
    try:
        fn()
        got = ("no error", "")
    except Exception as e:  # a timeout (RuntimeError) must be reported, not raised
        got = (type(e).__name__, str(e))
    took = time.monotonic() - start
    dist.barrier(group=alive)
    return (*got, took)


def _unservable(rank, world, kind):
    if kind == "bloom":
        cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    else:
        cfg = transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=rh.ATTN_IMPLEMENTATION)
    return _answer(lambda: model(**rh.shard_batch(make_batch("plain"), config=model.config)).loss.backward())


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_models_the_ring_cannot_serve_are_refused(kind):
    # Bloom's ALiBi attention ignores attn_implementation and would attend within each shard only;
    # MPT's would crash mid-forward. Both are refused before the first forward, on every rank.
    for err, msg, _ in run_ranks(_unservable, 2, (kind,), timeout_s=30):
        assert err == "ValueError" and f"model type {kind!r}" in msg and "AttentionInterface" in msg, msg


def test_check_model_by_type_and_architectures():
    rh.check_model(tiny_config("llama"))  # a fresh config (no attn_implementation yet) of a served type
    with pytest.raises(ValueError, match=r"model type 'bloom' \(BloomModel\): its attention layers do not call"):
        rh.check_model(transformers.BloomConfig())
    with pytest.raises(ValueError, match=r"model type 'llama' \(FalconForCausalLM\)"):  # a checkpoint's classes
        rh.check_model(tiny_config("llama", architectures=["FalconForCausalLM"]))


def _skips_the_ring(rank, world, with_config):
    cfg = tiny_config("llama")
    torch.manual_seed(0)
    ring = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=rh.ATTN_IMPLEMENTATION)
    if rank == 1:  # the pitfall: a reference built from the same config object turns `ring` to sdpa too
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")

    def steps():  # two: a rank that skipped the ring meets the others in the next batch's check
        for _ in range(2):
            ring(**rh.shard_batch(make_batch("plain"), config=ring.config if with_config else None)).loss.backward()

    return _answer(steps)


@pytest.mark.parametrize("with_config", [True, False], ids=["config", "no-config"])
def test_a_rank_that_skips_the_ring_raises_everywhere(with_config):
    (e0, m0, t0), (e1, m1, t1) = run_ranks(_skips_the_ring, 2, (with_config,), timeout_s=30)
    assert e0 == e1 == "ValueError" and max(t0, t1) < 15, (e0, m0, e1, m1)
    if with_config:  # refused by shard_batch, before any forward
        assert "config._attn_implementation is 'sdpa', not 'ring_attention'" in m1 and "copy.deepcopy" in m1, m1
        assert "rank(s) [1] of the group rejected their inputs" in m0, m0
    else:  # rank 0 waits in layer 0's check, rank 1 arrives there from the next shard_batch
        for m in (m0, m1):
            assert "call is ring attention over 2 rank(s) on rank 0, shard_batch over 2 rank(s) on rank 1" in m, m


def _other_tokens(rank, world):
    batch = make_batch("plain")
    if rank == 1:  # same shapes, other token ids
        batch["input_ids"] = batch["input_ids"].roll(1, dims=1)
    return _answer(lambda: rh.shard_batch(batch))


def test_batches_with_other_tokens_are_refused():
    for err, msg, _ in run_ranks(_other_tokens, 2, timeout_s=30):
        assert err == "ValueError", msg
        assert re.search(r"shard_batch inputs differ between the ranks of the group: batch\['input_ids'\] \(digest\) "
                         r"is [0-9a-f]{16} on rank 0, [0-9a-f]{16} on rank 1", msg), msg  # fmt: skip


def _compiled(rank, world):
    import torch._dynamo

    torch.manual_seed(0)
    ring, _ = models("qwen2")  # a full and a sliding layer
    eager = copy.deepcopy(ring)
    batch = make_batch("packed")
    shard = rh.shard_batch(batch, config=ring.config)
    explain = torch._dynamo.explain(ring)(**shard)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(ring, backend="aot_eager", fullgraph=True)
    loss = compiled(**shard).loss
    loss.backward()
    want = eager(**shard).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    for p, q in zip(ring.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_compile_fullgraph():
    """The whole HF model with the ring traces in one graph (no break in attention), same numbers."""
    run_ranks(_compiled, 2, timeout_s=240)
