"""FSDP2 over the flattened dp × cp mesh: DDP's losses and gradients, shards that shrink with the
ranks, checkpoints that resume bit-exactly and on another world size, and the memory model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ringflash.train.checkpoint import CheckpointError
from ringflash.train.memory import activation_bytes_per_token, live_bytes, predict
from ringflash.train.parallel import transformer_blocks
from tests.dist_utils import run_ranks
from tests.tiny_config import tiny_config

STEPS = 3


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _fsdp_vs_ddp(rank, world, overrides):
    """STEPS steps of the same batches through DDP and FSDP2: losses, clipped gradients and norms
    equal (float32); each rank's live bytes returned for the parent to compare across ranks."""
    from ringflash.train.data import DataLoader, build_source
    from ringflash.train.model import Transformer
    from ringflash.train.parallel import clip_grad_norm, distributed, parallelize
    from ringflash.train.trainer import build_optimizer, forward_backward

    cfgs = {kind: tiny_config(None, *overrides, f"--parallel.fsdp={kind == 'fsdp'}") for kind in ("ddp", "fsdp")}
    cfg = cfgs["ddp"]
    with distributed(cfg.parallel, "cpu") as pc:
        runs = {}
        for kind, c in cfgs.items():
            torch.manual_seed(0)
            raw = Transformer(c.model)
            model = parallelize(raw, pc, c)
            runs[kind] = (raw, model, build_optimizer(raw, c))
        source = build_source(cfg.data, cfg.model.vocab_size)
        loader = DataLoader(source, cfg.data.batch_size, cfg.train.grad_accum, pc.dp_rank, pc.dims.dp)
        measured = {}
        for step in range(STEPS):
            micros = loader.next()
            seen = {}
            for kind, (raw, model, optimizer) in runs.items():
                loss = forward_backward(model, micros, pc, cfg.parallel.layout, torch.autocast("cpu", enabled=False))
                norm = clip_grad_norm(raw.parameters(), cfg.train.grad_clip)
                seen[kind] = (loss, norm, {n: _full(p.grad) for n, p in raw.named_parameters()})
                optimizer.step()
                if step == STEPS - 1:
                    measured[kind] = live_bytes(raw, optimizer)
                optimizer.zero_grad(set_to_none=True)
            (ddp_loss, ddp_norm, ddp_grads), (loss, norm, grads) = seen["ddp"], seen["fsdp"]
            torch.testing.assert_close(loss, ddp_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(norm, ddp_norm, rtol=1e-5, atol=1e-6)  # the global norm, not a shard's
            assert norm.dim() == 0 and not isinstance(norm, DTensor)
            for name, g in ddp_grads.items():
                torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for (name, a), b in zip(runs["ddp"][0].named_parameters(), runs["fsdp"][0].parameters(), strict=True):
            torch.testing.assert_close(_full(b), a, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        # The memory model's weights, gradients and AdamW bytes are this rank's, exactly.
        m = cfgs["fsdp"]
        want = predict(m.model, m.data.seq_len, dp=pc.dims.dp, cp=pc.dims.cp, fsdp=True, dtype="float32", rank=rank)
        assert (measured["fsdp"]["params"], measured["fsdp"]["grads"]) == (want["weights"], want["gradients"])
        assert measured["fsdp"]["optimizer"] == want["optimizer"]
        return measured


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ["--parallel.cp=2", "--data.passkey_loss=answer", "--train.grad_accum=2"],  # dp 2 × cp 2
        ["--parallel.cp=4", "--data.passkey_loss=all", "--train.activation_checkpointing=true"],  # dp 1 × cp 4
    ],
    ids=["dp2-cp2-accum", "dp1-cp4-checkpointed"],
)
def test_fsdp_equals_ddp_and_shards_memory(overrides):
    measured = run_ranks(_fsdp_vs_ddp, 4, args=(overrides,), timeout_s=60)
    # Measured from the live tensors: DDP holds everything on every rank; FSDP2's 4 ranks hold
    # disjoint row shards that add up to it, each at most a quarter plus one row per tensor.
    ddp = measured[0]["ddp"]
    assert all(m["ddp"] == ddp for m in measured)
    for key in ("params", "grads"):
        assert sum(m["fsdp"][key] for m in measured) == ddp[key]
    per_rank = [m["fsdp"]["params"] + m["fsdp"]["optimizer"] for m in measured]
    # AdamW's `step` (4 bytes a tensor) is replicated, not sharded.
    assert max(per_rank) <= (ddp["params"] + ddp["optimizer"]) / 4 * 1.15
    assert min(per_rank) >= (ddp["params"] + ddp["optimizer"]) / 4 * 0.85


@pytest.mark.slow
def test_fsdp_composes_with_compile_and_checkpointing():
    # The loop's partial compile (norms, SwiGLU) inside checkpoint-wrapped, sharded blocks: inductor
    # compiles C++ on the CPU, seconds per graph, so one rank (FSDP's hooks run all the same).
    overrides = ["--data.passkey_loss=all", "--train.compile=true", "--train.activation_checkpointing=true"]
    run_ranks(_fsdp_vs_ddp, 1, args=(overrides,), timeout_s=240)


def test_transformer_blocks_of_ours_and_hugging_face_models():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    class HFLike(nn.Module):  # LlamaForCausalLM's shape: model.model.layers, lm_head beside it
        def __init__(self):
            super().__init__()
            self.model, self.lm_head = Inner(), nn.Linear(2, 2)

    from ringflash.train.model import Transformer

    ours = Transformer(tiny_config(None).model)
    assert transformer_blocks(ours) is ours.blocks
    hf = HFLike()
    assert transformer_blocks(hf) is hf.model.layers
    with pytest.raises(TypeError, match=r"cannot find the transformer blocks of Linear: expected a ModuleList"):
        transformer_blocks(nn.Linear(2, 2))


# ----------------------------------------------------------------------------- checkpoints

K = 2  # steps before the interruption


def ckpt_cfg(run_dir: Path, cp: int, accum: int, *overrides: str):
    """FSDP2; the same global batch (dp · grad_accum · batch_size) at every world size."""
    return tiny_config(
        run_dir, "--data.passkey_loss=all", "--data.eval_samples=0", "--parallel.fsdp=true",
        f"--parallel.cp={cp}", f"--train.grad_accum={accum}", f"--train.steps={2 * K}", "--train.warmup_steps=1",
        *overrides,
    )  # fmt: skip


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _full(p).detach().clone() for n, p in model.named_parameters()}


def _resume_same_world(rank, world, tmp: Path):
    from ringflash.train.trainer import train

    whole = train(ckpt_cfg(tmp / "whole", 2, 1, "--checkpoint.enabled=false"))
    first = train(ckpt_cfg(tmp / "split", 2, 1, f"--train.stop_at={K}"))
    torch.manual_seed(1234 + rank)  # a new process would start from another RNG state
    second = train(ckpt_cfg(tmp / "split", 2, 1, "--checkpoint.resume=latest"))
    assert {**first.losses, **second.losses} == whole.losses  # bit-exact floats
    a, b = _full_params(whole.model), _full_params(second.model)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fsdp_resume_is_bit_exact(tmp_path):
    run_ranks(_resume_same_world, 2, args=(tmp_path,), timeout_s=60)


def _first_half(rank, world, tmp: Path, cp: int, accum: int, uninterrupted: bool):
    from ringflash.train.trainer import train

    whole = train(ckpt_cfg(tmp / "whole", cp, accum, "--checkpoint.enabled=false")).losses if uninterrupted else {}
    first = train(ckpt_cfg(tmp / "split", cp, accum, f"--train.stop_at={K}")).losses
    return whole, first


def _second_half(rank, world, tmp: Path, cp: int, accum: int):
    from ringflash.train.trainer import train

    # What cannot be resharded is still refused, by name, before anything is loaded.
    with pytest.raises(CheckpointError, match=r"holds another model: .*model.dim = 32 there, 64 here"):
        train(ckpt_cfg(tmp / "split", cp, accum, "--checkpoint.resume=latest", "--model.dim=64"))
    return train(ckpt_cfg(tmp / "split", cp, accum, "--checkpoint.resume=latest")).losses


@pytest.mark.slow
def test_fsdp_resume_on_another_world_size(tmp_path):
    # Checkpointed on 4 ranks (dp 2 × cp 2), continued on 2 (dp 1 × cp 2, grad_accum 2: the same
    # global batch, so the same samples every step), and the reverse. DCP reshards the parameters
    # and AdamW states; the data continue from the global sample index. Only the order of the
    # sums over ranks differs from the uninterrupted run, so its losses agree to float32 rounding.
    four, two = tmp_path / "four", tmp_path / "two"
    whole, first4 = run_ranks(_first_half, 4, args=(four, 2, 1, True), timeout_s=60)[0]
    second2 = run_ranks(_second_half, 2, args=(four, 2, 2), timeout_s=60)[0]
    _, first2 = run_ranks(_first_half, 2, args=(two, 2, 2, False), timeout_s=60)[0]
    second4 = run_ranks(_second_half, 4, args=(two, 2, 1), timeout_s=60)[0]
    assert sorted(whole) == list(range(1, 2 * K + 1))
    for name, losses in [("4 -> 2", {**first4, **second2}), ("2 -> 4", {**first2, **second4})]:
        assert sorted(losses) == sorted(whole), name
        for step, loss in whole.items():
            assert losses[step] == pytest.approx(loss, rel=1e-5), (name, step)


# ----------------------------------------------------------------------------- the memory model


def test_predicted_activations_match_what_autograd_saves():
    """The activation bytes per token of the memory model against the tensors autograd saves in a
    float32 forward of our model (one process, the local attention core), within 25 %."""
    from ringflash.train.model import Transformer

    cfg = tiny_config(None, "--model.dim=64", "--model.n_heads=2", "--model.n_layers=3").model
    torch.manual_seed(0)
    model = Transformer(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    B, N = 2, 256
    idx = torch.randint(0, cfg.vocab_size, (B, N))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())
    del loss
    measured = sum(saved.values()) + logits.numel() * 4  # what the backward keeps, and the logits
    per = activation_bytes_per_token(cfg, "float32")
    predicted = B * N * (cfg.n_layers * per["block"] + per["head"])
    assert measured == pytest.approx(predicted, rel=0.25), (measured, predicted)


def test_predicted_memory_falls_with_shards_and_checkpointing():
    cfg = tiny_config(None, "--model.dim=256", "--model.n_layers=4", "--model.n_heads=4").model
    one = predict(cfg, 4096, fsdp=True)
    eight = predict(cfg, 4096, dp=2, cp=4, fsdp=True)
    for key in ("weights", "gradients"):
        assert eight[key] == pytest.approx(one[key] / 8, rel=0.02)
    assert eight["activations"] == pytest.approx(one["activations"] / 4, rel=0.01)  # cp splits the tokens
    assert eight["ring"] > 0 == one["ring"]
    ac = predict(cfg, 4096, fsdp=True, activation_checkpointing=True)
    assert ac["activations"] < one["activations"] / 2
    ddp = predict(cfg, 4096, dp=8, fsdp=False)
    assert ddp["weights"] == one["weights"] and ddp["peak"] > eight["peak"]
