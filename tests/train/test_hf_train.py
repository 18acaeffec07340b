"""`[model] kind = "hf"`: a transformers model in the training loop.

A step through the ring at cp = 2 equals the same HF model with sdpa on whole sequences (loss and
every gradient), with per-layer sliding windows too; the TOML/CLI config of the HF architecture;
the torchrun entry point trains, checkpoints, and the export loads back into transformers.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="model.kind = hf needs transformers (pip install '.[hf]')")

from ringflash.train.config import ConfigError, load_config  # noqa: E402
from ringflash.train.data import IGNORE, DataLoader, build_source  # noqa: E402
from tests.dist_utils import REPO, RankFailure, run_ranks, torchrun  # noqa: E402
from tests.tiny_config import assert_matches_reference, tiny_config  # noqa: E402

LLAMA = ["--model.kind=hf", "--model.hf.model_type=llama", "--model.hf.vocab_size=256", "--model.hf.hidden_size=32",
         "--model.hf.intermediate_size=64", "--model.hf.num_hidden_layers=2", "--model.hf.num_attention_heads=4",
         "--model.hf.num_key_value_heads=2"]  # fmt: skip
# Qwen2 with layer 1 sliding (window 40 < the 256-token sequence) and layer 0 full.
QWEN2 = [*LLAMA, "--model.hf.model_type=qwen2", "--model.hf.use_sliding_window=true",
         "--model.hf.sliding_window=40", "--model.hf.max_window_layers=1"]  # fmt: skip


def tiny_hf(*overrides: str):
    return tiny_config(None, "--train.steps=4", "--train.warmup_steps=1", "--checkpoint.enabled=false", *overrides)


def _cp_vs_sdpa(rank, world, cfg):
    from ringflash.train.hf_model import build_model
    from ringflash.train.parallel import distributed, parallelize_hf
    from ringflash.train.trainer import forward_backward

    with distributed(cfg.parallel, "cpu", run=cfg) as pc:
        torch.manual_seed(0)
        model = build_model(cfg)
        reference = copy.deepcopy(model)  # HF's own (sdpa) attention on whole sequences: the oracle
        ddp = parallelize_hf(model, pc, cfg)
        assert model.context.scheme == pc.dims.cp_scheme  # every layer's masks and attention follow it
        if cfg.parallel.cp_scheme == "auto":  # the planner's choice for the HF config's shape
            assert pc.dims.cp_scheme == "allgather" and "(4/1 heads of 8, HF config)" in pc.dims.chosen
        micros = DataLoader(build_source(cfg.data, cfg.model.vocab_size), cfg.data.batch_size, 1, 0, 1).next()
        loss = forward_backward(ddp, micros, pc, cfg.parallel.layout, contextlib.nullcontext(), mask_fn=model.masks)
        n_tokens = sum(int((y != IGNORE).sum()) for _, y in micros)
        logits = [reference(x) for x, _ in micros]
        ref_loss = sum(
            F.cross_entropy(lg.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum")
            for lg, (_, y) in zip(logits, micros)
        )
        (ref_loss / n_tokens).backward()
        assert_matches_reference(loss, ref_loss / n_tokens, model, reference)
        return float(loss)


@pytest.mark.parametrize(
    "overrides",
    [
        [*LLAMA, "--parallel.cp=2", "--data.passkey_loss=all"],
        [*QWEN2, "--parallel.cp=2", "--data.passkey_loss=all", "--parallel.layout=contiguous"],
        [*QWEN2, "--parallel.cp=2", "--data.passkey_loss=all", "--parallel.cp_scheme=allgather"],
        # One K/V head: the planner takes the all-gather (its K/V are small).
        [*LLAMA, "--model.hf.num_key_value_heads=1", "--parallel.cp=2", "--parallel.cp_scheme=auto"],
    ],
    ids=["llama-zigzag", "qwen2-windows-contiguous", "qwen2-windows-allgather", "llama-mqa-auto"],
)
def test_hf_step_matches_sdpa(overrides):
    cfg = tiny_hf(*overrides)
    losses = run_ranks(_cp_vs_sdpa, 2, args=(cfg,), timeout_s=90)
    assert len(set(losses)) == 1


def test_hf_config_from_toml_and_cli(tmp_path):
    from ringflash.train.hf_model import hf_config

    toml = tmp_path / "c.toml"
    toml.write_text('[model]\nkind = "hf"\n[model.hf]\nmodel_type = "llama"\nhidden_size = 48\nnum_attention_heads = 4')
    cfg = load_config(toml, ["--model.hf.num_hidden_layers=3", "--model.hf.rope_theta=1e4"])
    assert cfg.model.hf == {"model_type": "llama", "hidden_size": 48, "num_attention_heads": 4,
                            "num_hidden_layers": 3, "rope_theta": 1e4}  # fmt: skip
    c = hf_config(cfg.model)
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("llama", 48, 3)
    # a config.json path, with [model.hf] keys over its own
    c.to_json_file(tmp_path / "config.json")
    c2 = load_config(None, ["--model.kind=hf", f"--model.hf_config={tmp_path}", "--model.hf.hidden_size=64"])
    c2 = hf_config(c2.model)
    assert (c2.hidden_size, c2.num_hidden_layers) == (64, 3)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["--model.hf.model_type=llama"], "apply to model.kind = hf only"),
        (["--model.kind=hf"], "set model.hf_config, model.hf_pretrained or \\[model.hf\\] model_type"),
        ([*LLAMA, "--model.window=16"], "model.window: with model.kind = hf the windows are the HF config's"),
        (["--model.kind=hf", "--model.hf=3"], "model.hf: expected a table"),
    ],
)
def test_hf_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)


def test_hf_pretrained_config_errors_name_the_keys(tmp_path):
    """A model directory whose config.json is not JSON, or a [model.hf] key of the wrong type over
    it: one ConfigError naming model.hf_pretrained, no transformers traceback."""
    from ringflash.train.hf_model import hf_config

    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64')
    run = ["--model.kind=hf", f"--model.hf_pretrained={tmp_path}"]
    with pytest.raises(ConfigError, match=r"^model.hf_pretrained = .* \(with model.hf's keys\): .*not a valid JSON"):
        hf_config(load_config(None, run).model)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ConfigError, match=r"^model.hf_pretrained = .* \(with model.hf's keys\): .*hidden_size"):
        hf_config(load_config(None, [*run, "--model.hf.hidden_size=wide"]).model)
    assert hf_config(load_config(None, [*run, "--model.hf.num_hidden_layers=2"]).model).num_hidden_layers == 2


def test_hf_missing_files_and_vocab(tmp_path):
    from ringflash.train.hf_model import build_hf_model

    with pytest.raises(ConfigError, match=r"model.hf_config: .* not found"):
        build_hf_model(load_config(None, ["--model.kind=hf", f"--model.hf_config={tmp_path}/nope.json"]))
    with pytest.raises(ConfigError, match=r"vocab_size \(128\) must hold the data's vocabulary, model.vocab_size"):
        build_hf_model(load_config(None, [*LLAMA, "--model.hf.vocab_size=128"]))


@pytest.mark.slow
def test_torchrun_trains_and_exports(tmp_path):
    """configs/hf_llama_tiny_cpu.toml, shortened: trains on 2 ranks, and its checkpoint exports to a
    directory transformers loads (parameters equal to the checkpoint's)."""
    out = torchrun(REPO / "launch" / "train.py", "--config", str(REPO / "configs" / "hf_llama_tiny_cpu.toml"),
                   f"--logging.dir={tmp_path}", "--train.steps=3", "--data.eval_samples=1", cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "done: step 3" in out.stdout
    [ckpt] = tmp_path.glob("*/checkpoints/step_00000003")  # <logging.dir>/<run id>/checkpoints
    export = subprocess_run([str(REPO / "launch" / "export_hf.py"), "--checkpoint", str(ckpt), "--out",
                             str(tmp_path / "hf")])  # fmt: skip
    assert export.returncode == 0, export.stderr[-3000:]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    from ringflash.train.hf_model import export_pretrained

    assert model.config.model_type == "llama" and model.config.use_cache
    with pytest.raises(ConfigError, match="not a complete checkpoint"):
        export_pretrained(tmp_path, tmp_path / "x")
    with torch.no_grad():
        logits = model(torch.arange(16)[None]).logits
    assert torch.isfinite(logits).all()


def subprocess_run(args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def _parallelize(rank, world, cfg):
    from ringflash.train.hf_model import build_model
    from ringflash.train.parallel import distributed, parallelize_hf

    with distributed(cfg.parallel, "cpu") as pc:
        parallelize_hf(build_model(cfg), pc, cfg)


def test_training_loop_refuses_a_model_the_ring_cannot_serve():
    # Bloom's attention (ALiBi) does not go through transformers' AttentionInterface: in the loop
    # it would attend within each rank's shard only. Set-up refuses it, naming the model type.
    bloom = ["--model.kind=hf", "--model.hf.model_type=bloom", "--model.hf.vocab_size=256", "--model.hf.hidden_size=32",
             "--model.hf.n_layer=2", "--model.hf.n_head=4"]  # fmt: skip
    with pytest.raises(RankFailure, match=r"model.hf: .*bloom"):
        run_ranks(_parallelize, 2, args=(tiny_hf(*bloom, "--parallel.cp=2"),), timeout_s=60)


@pytest.mark.parametrize(
    ("overrides", "window"),
    [(LLAMA, None), ([*LLAMA, "--model.hf.model_type=mistral", "--model.hf.sliding_window=40"], 40), (QWEN2, None)],
    ids=["full", "sliding-everywhere", "mixed-counts-as-full"],
)
def test_hf_flops_config_carries_the_window_as_a_spec(overrides, window):
    from ringflash.train.hf_model import build_hf_model
    from ringflash.train.metrics import attended_keys, flops_per_token

    shape = build_hf_model(load_config(None, overrides)).flops_config
    assert shape.attn_spec.window == (None if window is None else (window - 1, 0))  # None when off, never 0
    assert (shape.n_layers, shape.dim) == (2, 32)
    assert flops_per_token(shape, 0, 256) == pytest.approx(12 * 2 * 32 * attended_keys(256, window))


def test_a_field_of_the_wrong_type_is_a_config_error():
    # transformers 5 checks config fields itself, raising huggingface_hub's own error (no TypeError);
    # TOML has no null, so "null" arrives as a string.
    from ringflash.train.config import ConfigError, load_config
    from ringflash.train.hf_model import hf_config

    pytest.importorskip("transformers", reason="model.kind = hf needs transformers (pip install '.[hf]')")
    null = "--model.hf.final_logit_softcapping=null"
    cfg = load_config(None, ["--model.kind=hf", "--model.hf.model_type=gemma2", null])
    with pytest.raises(ConfigError, match=r"^model.hf: .*'final_logit_softcapping'"):
        hf_config(cfg.model)
