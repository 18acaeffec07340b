"""A `transformers` causal LM in the training loop: `[model] kind = "hf"` (needs the `hf` extra).

The architecture comes from a local `config.json` (`model.hf_config`), from inline keys in the
TOML (`[model.hf]` with `model_type` and the config's fields), or with weights from a local
directory (`model.hf_pretrained`, `from_pretrained`); `[model.hf]` keys then override the file's.
Nothing is ever downloaded. `HFCausalLM` gives the model the interface of `train.model.Transformer`
(`forward(idx, pos, mask) -> logits`), so the trainer's loss, token counts, checkpoints and
evaluation serve both; `train.parallel.parallelize_hf` switches its attention to the ring.
`export_pretrained` (and `launch/export_hf.py`) turns a training checkpoint into a directory
that `AutoModelForCausalLM.from_pretrained` loads.

Labels: the trainer's data already pairs each token with the next one (labels shifted on the
whole sequence, before sharding), and the trainer computes the loss itself from the logits; HF's
own loss (which would shift again) is never called here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

from ringflash.kernels import AttnSpec
from ringflash.train.config import Config, ConfigError, ModelConfig


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.kind = hf needs transformers: pip install 'ringflash[hf]'") from None
    return transformers


def hf_config(m: ModelConfig):
    """The `transformers` config that `m` (kind = hf) describes; ConfigError naming the key."""
    transformers = _transformers()
    extra = dict(m.hf)
    if m.hf_pretrained:
        path = Path(m.hf_pretrained)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.hf_pretrained: {path} is not a local model directory (no config.json)")
        try:
            return transformers.AutoConfig.from_pretrained(path, **extra)
        except (OSError, ValueError, TypeError, *_field_errors()) as e:  # its config.json, or a key of model.hf
            raise ConfigError(f"model.hf_pretrained = {path} (with model.hf's keys): {e}") from None
    if m.hf_config:
        path = Path(m.hf_config)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ConfigError(f"model.hf_config: {path} not found (a local config.json, or a directory holding one)")
        extra = {**json.loads(path.read_text()), **extra}
    model_type = extra.pop("model_type", None)
    if model_type is None:
        raise ConfigError('model.hf: needs model_type (e.g. "llama") when neither hf_config nor hf_pretrained is set')
    try:
        return transformers.AutoConfig.for_model(model_type, **extra)
    except (ValueError, TypeError, *_field_errors()) as e:
        raise ConfigError(f"model.hf: {e}") from None


def _field_errors() -> tuple[type[Exception], ...]:
    """What a transformers config raises for a field of the wrong type besides TypeError: since
    transformers 5, huggingface_hub's strict dataclasses raise their own error (not a TypeError)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def head_dim(config) -> int:
    """A transformers config's attention head dim: its `head_dim` where it has one, else hidden size
    over heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class HFCausalLM(nn.Module):
    """`forward(idx (B, N), pos (N,) global positions, mask) -> logits (B, N, vocab)` over a
    transformers causal LM `hf`. `mask`: a `ringflash.hf.RingMasks` (documents, windows) or None
    (one document per row: built here, per sequence length, over `context`)."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.context = None  # a ringflash.hf.RingContext (group, layout, scheme) from parallelize_hf; None: one process
        self._plain: dict[int, object] = {}

    def masks(self, doc_ids: torch.Tensor | None, seq_len: int):
        """This batch's `RingMasks` for global `doc_ids (B, seq_len)` (None: one document per row)."""
        import ringflash.hf

        device = next(self.parameters()).device
        return ringflash.hf.ring_masks(doc_ids, seqlen=seq_len, context=self.context or ringflash.hf.RingContext(),
                                       config=self.hf.config, device=device)  # fmt: skip

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None, mask=None) -> torch.Tensor:
        import ringflash.hf

        B, n = idx.shape
        if mask is None and self.hf.config._attn_implementation == ringflash.hf.ATTN_IMPLEMENTATION:
            world = 1 if self.context is None else self.context.rank_world()[1]
            if n * world not in self._plain:
                self._plain[n * world] = self.masks(None, n * world)
            mask = self._plain[n * world]
        kwargs = {} if mask is None else {"ring_masks": mask}
        position_ids = None if pos is None else pos.expand(B, n)
        return self.hf(input_ids=idx, position_ids=position_ids, use_cache=False, **kwargs).logits

    def num_params(self, exclude_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding:
            n -= self.hf.get_input_embeddings().weight.numel()
        return n

    @property
    def flops_config(self) -> SimpleNamespace:
        """What `train.metrics.flops_per_token` reads: layers, attention width, and the attention as
        an `AttnSpec` (mixed full and sliding layers count as full)."""
        import ringflash.hf

        c = self.hf.config
        windows = {ringflash.hf.layer_window(c, i) for i in range(c.num_hidden_layers)}
        window = next(iter(windows)) if len(windows) == 1 else None
        spec = AttnSpec(causal=True, window=window)
        return SimpleNamespace(n_layers=c.num_hidden_layers, dim=c.num_attention_heads * head_dim(c), attn_spec=spec)


def build_hf_model(cfg: Config) -> HFCausalLM:
    """The model of `cfg.model` (kind = hf): random init from its config, or its local weights."""
    transformers = _transformers()
    m = cfg.model
    config = hf_config(m)
    if getattr(config, "vocab_size", 0) < m.vocab_size:
        raise ConfigError(
            f"model.hf: vocab_size ({config.vocab_size}) must hold the data's vocabulary, model.vocab_size = "
            f"{m.vocab_size}"
        )
    if m.hf_pretrained:
        model = transformers.AutoModelForCausalLM.from_pretrained(m.hf_pretrained, config=config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False  # training: no KV cache (with one, HF also ignores packed position_ids)
    return HFCausalLM(model)


def build_model(cfg: Config) -> nn.Module:
    """`[model] kind`: this repository's transformer (small) or a transformers model (hf)."""
    if cfg.model.kind == "hf":
        return build_hf_model(cfg)
    from ringflash.train.model import Transformer

    return Transformer(cfg.model)


def config_from_dict(saved: dict) -> Config:
    """The `Config` a checkpoint recorded (`to_dict`), field by field."""
    cfg = Config()
    for section, fields in saved.items():
        target = getattr(cfg, section)
        names = {f.name for f in dataclasses.fields(target)}
        for key, value in fields.items():
            if key in names:
                setattr(target, key, value)
    return cfg


def export_pretrained(checkpoint: str | Path, out: str | Path, warn=print, trust_unverified: bool = False) -> Path:
    """Write the `kind = hf` model of a training checkpoint with `save_pretrained` to `out`, for
    `AutoModelForCausalLM.from_pretrained(out)`. One process, no process group needed. The
    checkpoint's checksums are verified first; one without them is refused unless `trust_unverified`
    (`warn` then gets the note)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from ringflash.train.checkpoint_files import read_metadata, read_tensors, read_train_state, verify

    path = Path(checkpoint)
    if not (path / ".metadata").is_file():
        raise ConfigError(f"--checkpoint: {path} is not a complete checkpoint (no .metadata)")
    if (warning := verify(path, trust_unverified, "--trust-unverified")) is not None:
        warn(f"warning: {warning}")
    cfg = config_from_dict(read_train_state(path, read_metadata(path))["config"])
    if cfg.model.kind != "hf":
        raise ConfigError(f"--checkpoint: {path} holds a model.kind = {cfg.model.kind!r} model, not an hf one")
    model = build_hf_model(cfg)
    state = {"model": get_model_state_dict(model)}
    read_tensors(path, state)
    set_model_state_dict(model, state["model"])
    model.hf.config.use_cache = True  # off for training only: generation wants its KV cache
    model.hf.save_pretrained(out)
    return Path(out)
