"""`validate`: a configuration's values against each other and against the job, in the order of
cause, so that the first error is the mistake and not one that follows from it. Every failure is a
`ConfigError` naming the key and what was expected. `load_config` runs it; re-exported by
`ringflash.train.config`.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ringflash.kernels import backend_named, interpreting, mask_kind
from ringflash.train.config_schema import (
    AUTO,
    STDLIB,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    kernel_backend,
    resolve_eod_token,
    warmup_data,
)
from ringflash.train.passkey_format import check_passkey_fits


def _check_range(key: str, value: float, interval: str) -> None:
    """Raise ConfigError naming `key` unless `value` lies in `interval`, written "[0, 1)", "(0, inf)", ...

    NaN and infinities never pass: NaN compares False with everything, so a plain `value < 0` test
    lets it through, to fail much later inside torch (an lr of nan, say) with a traceback.
    """
    lo, hi = (float(bound) for bound in interval[1:-1].split(","))
    above = lo < value if interval[0] == "(" else lo <= value
    below = value < hi if interval[-1] == ")" else value <= hi
    finite = isinstance(value, int) or math.isfinite(value)  # (isfinite overflows on a huge int)
    if not (finite and above and below):
        lo_text = interval[1:].split(",")[0]
        expected = f"{'>' if interval[0] == '(' else '>='} {lo_text}" if hi == math.inf else f"in {interval}"
        raise ConfigError(f"{key}: must be {'' if finite else 'finite and '}{expected}, got {value}")


def validate(cfg: Config, world_size: int | None = None) -> None:
    """The checks in the order of cause, so that the first error is the mistake and not one that
    follows from it: each numeric field's range; the parallel degrees against `world_size` (the
    job's, where the caller knows it: launch/train.py passes torchrun's; else ParallelDims checks
    it at start-up) and the transport; the model's shape and how the degrees cut it; the lengths
    cut over cp; the kernels; the data; the run's own bookkeeping."""
    _check_ranges(cfg)
    check_degrees(cfg.parallel, world_size)
    _check_transport(cfg.parallel)
    _check_model(cfg.model, cfg.parallel)
    _check_lengths(cfg)
    _check_kernels(cfg)
    _check_data(cfg.data, cfg.model)
    _check_run(cfg)


def _check_ranges(cfg: Config) -> None:
    m, d, p, t, c = cfg.model, cfg.data, cfg.parallel, cfg.train, cfg.checkpoint
    # Where 0 means off, auto or "only at the end" (see each field's help), the range starts at 0.
    ranges = {
        "model.vocab_size": (m.vocab_size, "[1, inf)"),
        "model.dim": (m.dim, "[1, inf)"),
        "model.n_layers": (m.n_layers, "[1, inf)"),
        "model.n_heads": (m.n_heads, "[1, inf)"),
        "model.n_kv_heads": (m.n_kv_heads, "[1, inf)"),
        "model.ffn_dim": (m.ffn_dim, "[0, inf)"),
        "model.rope_theta": (m.rope_theta, "(0, inf)"),
        "model.norm_eps": (m.norm_eps, "(0, inf)"),
        "model.init_std": (m.init_std, "(0, inf)"),
        "model.window": (m.window, "[0, inf)"),
        "data.seq_len": (d.seq_len, "[1, inf)"),
        "data.batch_size": (d.batch_size, "[1, inf)"),
        "data.warmup_seq_steps": (d.warmup_seq_steps, "[0, inf)"),
        "data.eval_buckets": (d.eval_buckets, "[1, inf)"),
        "data.eval_samples": (d.eval_samples, "[0, inf)"),
        "parallel.cp": (p.cp, "[1, inf)"),
        "parallel.timeout_s": (p.timeout_s, "(0, inf)"),
        "train.steps": (t.steps, "[1, inf)"),
        "train.grad_accum": (t.grad_accum, "[1, inf)"),
        "train.lr": (t.lr, "(0, inf)"),
        "train.min_lr_ratio": (t.min_lr_ratio, "[0, 1]"),
        "train.warmup_steps": (t.warmup_steps, "[0, inf)"),
        "train.weight_decay": (t.weight_decay, "[0, inf)"),
        "train.beta1": (t.beta1, "[0, 1)"),  # AdamW's own bounds, checked here to fail before the run
        "train.beta2": (t.beta2, "[0, 1)"),
        "train.grad_clip": (t.grad_clip, "[0, inf)"),
        "train.eval_every": (t.eval_every, "[0, inf)"),
        "train.max_minutes": (t.max_minutes, "[0, inf)"),
        "checkpoint.interval": (c.interval, "[0, inf)"),
        "checkpoint.keep": (c.keep, "[1, inf)"),
        "logging.log_every": (cfg.logging.log_every, "[1, inf)"),
        "logging.peak_tflops": (cfg.logging.peak_tflops, "[0, inf)"),
        "logging.profile_step": (cfg.logging.profile_step, "[0, inf)"),
    }
    if p.cp_heads != AUTO:
        ranges["parallel.cp_heads"] = (p.cp_heads, "[1, inf)")
    if d.kind == "passkey":  # unused by text and bin
        ranges |= {
            "data.passkey_digits": (d.passkey_digits, "[1, inf)"),
            "data.passkey_gap": (d.passkey_gap, "[0, inf)"),
            "data.passkey_repeats": (d.passkey_repeats, "[0, inf)"),
        }
    for key, (value, interval) in ranges.items():
        _check_range(key, value, interval)


def check_degrees(p: ParallelConfig, world_size: int | None) -> None:
    """parallel.cp against the world size (None: not known yet), cp_heads against cp: what every
    length cut over cp follows from. ParallelDims checks them again with the group's own size."""
    if world_size is not None and (p.cp < 1 or world_size % p.cp):
        raise ConfigError(
            f"parallel.cp ({p.cp}) must divide the world size ({world_size}); "
            f"launch a multiple of cp processes (torchrun --nproc_per_node)"
        )
    if p.cp_heads != AUTO and (p.cp_heads < 1 or p.cp % p.cp_heads):
        raise ConfigError(f"parallel.cp_heads ({p.cp_heads}) must divide parallel.cp ({p.cp})")


def _check_transport(p: ParallelConfig) -> None:
    if p.transport == "copy-engine" and p.cp_scheme == "allgather":
        raise ConfigError(
            "parallel.transport = copy-engine moves the ring's blocks; parallel.cp_scheme = allgather gathers K/V "
            "with the group's collectives and cannot use it: set transport = nccl, or cp_scheme = ring or auto"
        )
    if p.transport == "copy-engine" and p.dist_backend == "gloo":
        raise ConfigError("parallel.transport: copy-engine needs GPUs and NCCL, not parallel.dist_backend = gloo")


def _check_model(m: ModelConfig, p: ParallelConfig) -> None:
    """The model's shape, then how parallel.cp_heads cuts its heads."""
    if m.dim % m.n_heads or (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim ({m.dim}) must be n_heads ({m.n_heads}) times an even head_dim")
    if m.kind == "small" and (m.hf_config or m.hf_pretrained or m.hf):
        raise ConfigError("model.hf_config, model.hf_pretrained and [model.hf] apply to model.kind = hf only")
    if m.kind == "hf":
        if m.hf_config and m.hf_pretrained:
            raise ConfigError("model.hf_config and model.hf_pretrained: give one (the directory has its config)")
        if not (m.hf_config or m.hf_pretrained or "model_type" in m.hf):
            raise ConfigError("model.kind = hf: set model.hf_config, model.hf_pretrained or [model.hf] model_type")
        if m.window:
            raise ConfigError("model.window: with model.kind = hf the windows are the HF config's (sliding_window)")
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads ({m.n_kv_heads}) must divide model.n_heads ({m.n_heads})")
    if p.cp_heads == AUTO or p.cp_heads == 1:
        return
    if m.kind == "hf":
        # Their attention runs the ring over all of cp (ringflash.hf): a head grid would shard the
        # tokens one way and attend to them another.
        raise ConfigError(
            "parallel.cp_heads > 1 needs model.kind = small (transformers models run the ring or the all-gather "
            "over all of cp)"
        )
    from ringflash.hybrid import kv_heads_per_rank

    try:
        kv_heads_per_rank(m.n_heads, m.n_kv_heads, p.cp_heads)
    except ValueError as e:
        raise ConfigError(
            f"parallel.cp_heads ({p.cp_heads}) does not fit model.n_heads ({m.n_heads}) and model.n_kv_heads "
            f"({m.n_kv_heads}): {e}"
        ) from None


def _check_lengths(cfg: Config) -> None:
    """data.seq_len and what else is cut over the cp ranks: whole chunks of the layout."""
    d, p, t = cfg.data, cfg.parallel, cfg.train
    chunks = 2 * p.cp if p.layout == "zigzag" else p.cp
    which = f"{'2·cp' if p.layout == 'zigzag' else 'cp'} for the {p.layout} layout, cp={p.cp}"
    if d.seq_len % chunks:
        raise ConfigError(f"data.seq_len ({d.seq_len}) must be divisible by {chunks} ({which})")
    evaluates = d.kind in ("passkey", "recall") and d.eval_samples and p.cp > 1
    if evaluates and p.layout == "stripe":
        raise ConfigError(
            "parallel.layout = stripe spreads every evaluation depth bucket over all cp ranks: set "
            "data.eval_samples = 0 (no evaluation) or use the zigzag or contiguous layout"
        )
    if evaluates and d.eval_buckets % chunks:
        # A bucket across a chunk boundary has keys on two ranks: its "held by rank" label would be wrong.
        raise ConfigError(
            f"data.eval_buckets ({d.eval_buckets}) must be a multiple of {chunks} ({which}), so that each "
            f"depth bucket lies in one rank's shard; or set data.eval_samples = 0 (no evaluation)"
        )
    if d.warmup_seq_len:
        if not 0 < d.warmup_seq_len < d.seq_len or d.warmup_seq_len % chunks:
            raise ConfigError(
                f"data.warmup_seq_len ({d.warmup_seq_len}) must be 0 (off) or shorter than data.seq_len "
                f"({d.seq_len}) and divisible by {chunks}, like seq_len"
            )
        if not 0 < d.warmup_seq_steps <= t.steps:
            raise ConfigError(
                f"data.warmup_seq_steps ({d.warmup_seq_steps}) must be in [1, train.steps = {t.steps}] "
                "when data.warmup_seq_len is set"
            )
    if d.kind == "passkey":  # every rank would find it while building its data: say it once, here
        check_passkey_fits(d)
        if d.warmup_seq_len:
            try:
                check_passkey_fits(warmup_data(d))
            except ConfigError as e:
                raise ConfigError(f"data.warmup_seq_len ({d.warmup_seq_len}): {e}") from None


def _check_kernels(cfg: Config) -> None:
    """The kernels' own limits, from their backend (kernels/backends.py), before any tensor exists."""
    m, d, p, t = cfg.model, cfg.data, cfg.parallel, cfg.train
    name, source = kernel_backend(p)
    backend = backend_named(name)
    if backend is None:
        return
    kind = mask_kind(causal=True, window=m.attn_spec.window, intervals=d.pack_documents)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(t.dtype)
    # An HF model's head dim is known only once its config is read: the kernels check it then.
    why = backend.supports(kind, dtype, None if m.kind == "hf" else m.dim // m.n_heads)
    if why is not None:
        raise ConfigError(f"{source} = {name}: {why} (model.window, data.pack_documents, train.dtype, "
                          "model.dim / model.n_heads)")  # fmt: skip
    # train.device = auto stays unjudged: a config for GPUs is loaded on CPU machines too (the planner).
    if name == "cudnn" and t.device == "cpu":
        raise ConfigError(f"{source} = cudnn needs train.device = cuda")
    if name in ("triton", "hopper") and t.device == "cpu" and not interpreting():
        raise ConfigError(f"{source} = {name} on the CPU (train.device = {t.device}) needs the Triton interpreter: "
                          "set TRITON_INTERPRET=1, or use reference")  # fmt: skip


def _check_data(d: DataConfig, m: ModelConfig) -> None:
    if d.eod_token < -1:
        raise ConfigError(f"data.eod_token: must be -1 (auto) or a token id >= 0, got {d.eod_token}")
    if d.pack_documents:
        if d.kind not in ("text", "bin"):
            raise ConfigError(
                f"data.pack_documents: needs data.kind = text or bin (a {d.kind} sequence is one document)"
            )
        eod = resolve_eod_token(d)
        if not 0 <= eod < m.vocab_size:
            raise ConfigError(
                f"data.eod_token ({eod}{', auto for ' + d.kind if d.eod_token == -1 else ''}) must be a token "
                f"id in [0, model.vocab_size = {m.vocab_size})"
            )
    if d.kind in ("text", "bin") and not d.path:
        raise ConfigError(f"data.path: required for data.kind = {d.kind!r}")
    _check_range("data.heldout", d.heldout, "[0, 1)")
    if d.heldout and d.kind not in ("text", "bin"):
        raise ConfigError(f"data.heldout: needs data.kind = text or bin (a {d.kind} task has its own evaluation)")
    if d.path == STDLIB and d.kind != "text":
        raise ConfigError(f"data.path = {STDLIB}: needs data.kind = text, got {d.kind!r}")


def _check_run(cfg: Config) -> None:
    t = cfg.train
    if not 0 <= t.stop_at <= t.steps:
        raise ConfigError(f"train.stop_at ({t.stop_at}) must be in [0, train.steps = {t.steps}]")
    if cfg.logging.profile_step > t.steps:  # a step that never runs would leave no profile and no word why
        raise ConfigError(
            f"logging.profile_step ({cfg.logging.profile_step}) must be in [0, train.steps = {t.steps}]"
        )
    run_id = cfg.logging.run_id
    if run_id and (Path(run_id).name != run_id or run_id.startswith(".")):
        raise ConfigError(f"logging.run_id: 'auto', '' or a directory name (no '/', no leading '.'), got {run_id!r}")

