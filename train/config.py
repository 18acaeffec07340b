"""Run configuration: a tree of dataclasses read from TOML and overridable on the command line.

    [model]            ModelConfig       the transformer's shape
    [data]             DataConfig        which task or corpus, sequence length, batch
    [parallel]         ParallelConfig    context-parallel degree and ring layout
    [train]            TrainConfig       optimizer, schedule, precision, step counts
    [checkpoint]       CheckpointConfig  where and how often to save, what to resume
    [logging]          LoggingConfig     run directory, TensorBoard, progress bar

Precedence is CLI > file > defaults: `load_config("configs/x.toml", ["--train.lr=1e-3"])`.
Every field carries its documentation in `metadata["help"]` (printed by `launch/train.py --help`);
unknown sections or keys and values of the wrong type raise `ConfigError` naming the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ringflash.kernels import BACKENDS, AttnSpec, backend_named, mask_kind

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib


AUTO = "auto"  # parallel.cp_heads and cp_scheme: chosen at start-up by the planner (train/parallel.py)
STDLIB = "@stdlib"  # data.path naming the running interpreter's standard library (train/data.py)


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent."""


def opt(default, help: str, choices: tuple[str, ...] | None = None):
    """A config field: its default, its documentation and (for strings) the allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class ModelConfig:
    vocab_size: int = opt(256, "Vocabulary size; 256 for byte-level text and passkey, >= 50257 for GPT-2 .bin.")
    dim: int = opt(128, "Width of the residual stream.")
    n_layers: int = opt(4, "Number of transformer blocks.")
    n_heads: int = opt(4, "Query heads; head_dim = dim / n_heads.")
    n_kv_heads: int = opt(2, "Key/value heads (GQA); must divide n_heads.")
    ffn_dim: int = opt(0, "SwiGLU hidden width; 0 means 8/3·dim rounded up to a multiple of 64.")
    rope_theta: float = opt(10000.0, "RoPE base; raise it (e.g. 5e5) for very long contexts.")
    norm_eps: float = opt(1e-5, "RMSNorm epsilon.")
    tie_embeddings: bool = opt(True, "Share the token embedding with the output projection.")
    init_std: float = opt(0.02, "Std of the normal init; residual projections get std/sqrt(2·n_layers).")
    kind: str = opt(
        "small",
        "small: this repository's transformer (the fields above); hf: a transformers causal LM (pip install "
        "'ringflash[hf]') from hf_config, [model.hf] keys or hf_pretrained, never downloaded (train/hf_model.py).",
        ("small", "hf"),
    )
    hf_config: str = opt("", "kind = hf: a local config.json (or a directory holding one); random init.")
    hf_pretrained: str = opt("", "kind = hf: a local directory for from_pretrained (config and weights).")
    hf: dict = field(
        default_factory=dict,
        metadata={
            "help": "kind = hf: [model.hf] config keys (model_type, hidden_size, ...), over hf_config's or "
            "hf_pretrained's; on the command line --model.hf.KEY=VALUE (a TOML value).",
            "choices": None,
        },
    )
    window: int = opt(
        0,
        "Sliding-window attention: 0 means full causal attention; w > 0 lets each token see itself and "
        "the w − 1 tokens before it (flash_attn's window_size = (w − 1, 0)). Under cp the ring skips the "
        "key blocks outside every query's window, so the attention cost falls with w.",
    )

    @property
    def attn_spec(self) -> AttnSpec:
        """The model's attention as the kernels' spec: causal, within `window` (TOML has no None: 0 is
        off, None in the library's form)."""
        return AttnSpec(causal=True, window=self.window or None)


@dataclass
class DataConfig:
    kind: str = opt(
        "passkey",
        "passkey (synthetic, no download), text (bytes of a file or directory), bin (nanoGPT uint16 token "
        "files) or recall (synthetic: a marker and a 2-digit value hidden in random letters, asked for at the end; "
        "the first run's task, learned in minutes on a CPU).",
        ("passkey", "text", "bin", "recall"),
    )
    path: str = opt(
        "",
        "text: a file (its bytes: also a uint8 token file) or a directory of files (see files), or @stdlib: "
        "the running Python's standard library (sysconfig's stdlib directory, its site-packages left out), "
        "present on every machine; bin: a .bin file or a directory holding train.bin (and val.bin, "
        "the held-out part when heldout > 0). Unused for passkey and recall.",
    )
    files: str = opt(
        "**/*",
        "text with a directory path: a glob of the files to read, relative to it (e.g. **/*.py, *.txt); "
        "with pack_documents each file is one document; files are read in the order of their sorted relative paths.",
    )
    heldout: float = opt(
        0.0,
        "text and bin: the fraction of the data held out of training and scored every train.eval_every "
        "steps, in bits per byte for text (bits per token for bin), on eval_samples fixed sequences "
        "(0: none). A directory holds out whole files, chosen by a hash of each relative path (the same "
        "files on every machine); a single file its last tokens; a bin directory its val.bin.",
    )
    pack_documents: bool = opt(
        False,
        "text and bin only: the token stream is a sequence of documents, each ended by eod_token, and "
        "attention never crosses a document boundary (each sequence is a window of the stream, so it "
        "packs several documents; the first may start mid-document). The label of every EOD token (the "
        "next document's first token, unpredictable) takes no loss; the EOD token itself, as the label "
        "of a document's last token, does: the model learns where documents end.",
    )
    eod_token: int = opt(
        -1,
        "End-of-document token for pack_documents. -1 (auto): 50256 for bin (GPT-2's <|endoftext|>, which "
        "nanoGPT's prepare.py scripts append after every document) and 0 for text (the NUL byte, absent "
        "from text files). For text, a directory gives one document per file: an EOD token is appended to "
        "every file that does not already end with one, and any EOD byte inside a file ends a document "
        "too. A token >= 256 (with model.vocab_size above it) cannot occur in text at all.",
    )
    seq_len: int = opt(512, "Tokens per sequence, the whole context before it is sharded over cp.")
    batch_size: int = opt(4, "Sequences per data-parallel rank per micro-step.")
    seed: int = opt(1234, "Seed of the sampler; batch i is a pure function of (seed, i).")
    passkey_digits: int = opt(5, "Length of the random decimal pass key.")
    passkey_loss: str = opt(
        "answer",
        "answer: loss on the final pass key digits only; digits: also on the key's repetition inside its "
        "sentence (the same retrieval at short range, a denser signal); all: on every token.",
        ("answer", "digits", "all"),
    )
    passkey_gap: int = opt(
        16,
        "The key's repetition follows it after 0..gap filler bytes (random), so "
        "copying it takes the key's content rather than a fixed offset.",
    )
    passkey_repeats: int = opt(
        1,
        "Repetitions of the key, each after its own gap; with passkey_loss = "
        "digits, each is one more retrieval to learn from per sequence.",
    )
    warmup_seq_len: int = opt(
        0,
        "Sequence-length warm-up (0: off): the first warmup_seq_steps steps train on sequences of this many "
        "tokens, batch_size of them. Many cheap short-context steps learn a skill (e.g. passkey retrieval) "
        "that the steps at the full seq_len then stretch to long range.",
    )
    warmup_seq_steps: int = opt(0, "Steps of the sequence-length warm-up (see warmup_seq_len).")
    eval_buckets: int = opt(
        8, "Passkey and recall depth buckets; with cp > 1 a multiple of 2·cp (zigzag) or cp (contiguous), so that "
        "every bucket lies in one rank's shard."
    )
    eval_samples: int = opt(
        16,
        "Passkey and recall evaluation sequences per depth bucket; text and bin with heldout: held-out sequences "
        "scored, spread evenly over the held-out data (0: no evaluation).",
    )


@dataclass
class ParallelConfig:
    cp: int = opt(1, "Context-parallel degree; data-parallel degree = world size / cp.")
    cp_heads: int | str = opt(
        1,
        "Head-parallel ranks inside cp (ringflash/hybrid.py): cp = cp_heads × ring ranks, the head all-to-all "
        "on consecutive ranks (one node), the ring across them. Must divide cp and model.n_heads, and divide "
        "or be divided by model.n_kv_heads; 1 is the plain ring (the only one for model.kind = hf). auto: the "
        "planner's choice at start-up for this model, data.seq_len and batch_size, cp, the GPUs per node, "
        "transport and layout (ringflash.plan.choose_layout, docs/planner.md), logged with its prediction.",
        ("auto",),
    )
    layout: str = opt(
        "zigzag",
        "How a sequence is cut over the cp ranks: zigzag balances causal work, contiguous is the plain split, "
        "stripe puts token t on cp rank t mod cp (balanced at every ring step).",
        ("zigzag", "contiguous", "stripe"),
    )
    cp_scheme: str = opt(
        "ring",
        "How attention reaches the other cp ranks' keys: ring passes K/V blocks around the ring, overlapped "
        "with compute; allgather gathers all K/V in head chunks (Llama 3's; cheap under GQA, any document "
        "mask balanced; with cp_heads > 1 the head all-to-all wraps it as it wraps the ring). auto: the "
        "planner's choice, for the cp_heads given or with cp_heads = auto.",
        ("ring", "allgather", "auto"),
    )
    dist_backend: str = opt(
        "auto", "Process-group backend; auto means nccl on CUDA, gloo on CPU.", ("auto", "nccl", "gloo")
    )
    timeout_s: float = opt(
        600.0,
        "Process-group timeout in seconds: a collective or ring transfer that waits longer (a rank "
        "died, hangs or skipped a call) raises on every rank instead of hanging the job.",
    )
    transport: str = opt(
        "nccl",
        "How the ring's K/V blocks travel between GPUs: nccl (send/recv kernels) or copy-engine (the "
        "GPUs' copy engines, ranks of one host, no SMs taken from attention; README). Overrides "
        "RINGFLASH_TRANSPORT.",
        ("nccl", "copy-engine"),
    )
    kernel_backend: str = opt(
        "auto",
        "Attention kernels: auto (Triton on CUDA, the PyTorch reference on CPU), triton, reference, cudnn "
        "(cuDNN's, through PyTorch: faster on Hopper; CUDA only, causal attention without model.window or "
        "data.pack_documents), or hopper (triton with Gluon kernels on H100/H200: a faster forward, and a "
        "faster backward whose dQ is summed atomically, so not bit-reproducible). auto defers to "
        "RINGFLASH_KERNEL_BACKEND if set.",
        BACKENDS,
    )
    fsdp: bool = opt(
        False,
        "Shard parameters, gradients and AdamW states over all dp × cp ranks (FSDP2, fully_shard per "
        "transformer block and at the root) instead of replicating them (DDP). Per rank: 16 bytes a "
        "parameter under DDP, 16 / (dp·cp) under FSDP, for an all-gather per block in the forward and "
        "again in the backward and a reduce-scatter per block (1.5× DDP's all-reduce traffic). Choose "
        "FSDP when the weights and optimizer states crowd out activations (from ~1B parameters on 80 GB, "
        "docs/memory.md); keep DDP for small models, where it is faster.",
    )
    fsdp_param_dtype: str = opt(
        "auto",
        "FSDP only: the dtype parameters are all-gathered and computed in (the sharded float32 masters "
        "stay float32); auto follows train.dtype (bfloat16 on CUDA, float32 on CPU).",
        ("auto", "bfloat16", "float32"),
    )
    fsdp_reduce_dtype: str = opt(
        "float32",
        "FSDP only: the dtype gradients are reduce-scattered in; float32 keeps the sum over ranks exact "
        "to float32, bfloat16 halves its traffic.",
        ("float32", "bfloat16"),
    )


@dataclass
class TrainConfig:
    steps: int = opt(200, "Optimizer steps of the whole run (the LR schedule spans them).")
    stop_at: int = opt(0, "Stop after this step (0: run to `steps`); a later --resume continues.")
    grad_accum: int = opt(1, "Micro-steps per optimizer step.")
    lr: float = opt(3e-3, "Peak learning rate.")
    min_lr_ratio: float = opt(0.1, "Cosine decay ends at lr · min_lr_ratio.")
    warmup_steps: int = opt(20, "Linear warm-up steps.")
    weight_decay: float = opt(0.1, "AdamW decoupled weight decay, on matrices only.")
    beta1: float = opt(0.9, "AdamW beta1.")
    beta2: float = opt(0.95, "AdamW beta2.")
    grad_clip: float = opt(1.0, "Clip the global gradient norm to this (0: no clipping).")
    device: str = opt("auto", "auto (cuda if available), cuda or cpu.", ("auto", "cuda", "cpu"))
    dtype: str = opt(
        "auto", "Autocast dtype; auto means bfloat16 on CUDA, float32 on CPU.", ("auto", "bfloat16", "float32")
    )
    activation_checkpointing: bool = opt(False, "Recompute each block in the backward pass.")
    compile: bool = opt(False, "torch.compile the norms and SwiGLU of each block; attention stays eager.")
    seed: int = opt(0, "Seed of the parameter init (identical on every rank).")
    strict_lr: bool = opt(
        False,
        "Refuse to start, on every rank, when the early learning rate exceeds the bound for the "
        "model's width and depth (EARLY_UPDATE_BOUND), instead of warning at every start.",
    )
    eval_every: int = opt(
        0, "Passkey, recall and held-out (data.heldout) evaluation every N steps and at the end (0: only at the end)."
    )
    max_minutes: float = opt(
        0.0,
        "Stop (evaluate, save) after this many minutes of training, a safety "
        "net for time-boxed jobs; the schedule still spans `steps` (0: no limit).",
    )


@dataclass
class CheckpointConfig:
    enabled: bool = opt(True, "Save checkpoints (at `interval` and at the end of the run).")
    dir: str = opt("", "Checkpoint directory; empty means the run directory's checkpoints/ (see logging.run_id).")
    interval: int = opt(0, "Save every N steps (0: only at the end of the run).")
    keep: int = opt(2, "Keep the last K complete checkpoints.")
    resume: str = opt(
        "",
        "Empty: a new run; 'latest' (--resume): the latest complete checkpoint, of the latest run of "
        "logging.dir holding one, else an error; a checkpoint or run directory path; 'auto': what a "
        "torchrun restart sets, the latest checkpoint of the run its first attempt started, fresh if none.",
    )
    trust_unverified: bool = opt(
        False,
        "Resume a checkpoint that has no manifest.json (written before manifests existed, or not by ringflash), "
        "whose files nothing verifies; it then loads without checksums, with a warning. Off: refused, naming "
        "the checkpoint.",
    )


@dataclass
class LoggingConfig:
    dir: str = opt("runs/default", "Where this configuration's runs go: <dir>/<run_id>/ (tb/, checkpoints/).")
    run_id: str = opt(
        "auto",
        "The run's sub-directory of dir: 'auto' a new one per launch, named by its start time "
        "(--resume: the latest run); a name; or '' for dir itself. A named directory holding "
        "checkpoints is refused without --resume.",
    )
    log_every: int = opt(10, "One summary line every N steps.")
    tensorboard: bool = opt(True, "Write TensorBoard scalars to the run directory's tb/.")
    progress_bar: bool = opt(True, "tqdm progress bar with ETA on rank 0, drawn only when stderr is a terminal.")
    peak_tflops: float = opt(
        0.0, "Peak dense bf16 TFLOP/s per device for MFU; 0 guesses from the GPU name (no MFU on CPU)."
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# ----------------------------------------------------------------------------- loading


def _fields(section) -> dict[str, tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(type(section))
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(section)}


def _coerce(key: str, value, typ: type, from_cli: bool):
    """`value` as `typ`, or ConfigError. CLI values arrive as strings and are parsed here."""
    if typ == int | str:  # a number or one of the field's keywords (parallel.cp_heads = 4 or "auto")
        if from_cli:
            return int(value) if value.lstrip("+-").isdigit() else value
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected int or str, got {type(value).__name__} {value!r}")
    if typ is dict:  # a table of config keys ([model.hf]); entries are set one by one from the CLI
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table ([{key}] in TOML, --{key}.KEY=VALUE on the command line)")
        return dict(value)
    if from_cli:
        try:
            if typ is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return typ(value)
        except ValueError:
            raise ConfigError(f"{key}: expected {typ.__name__}, got {value!r}") from None
    # TOML values already have types; bool is a subclass of int, so it is checked first.
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (typ is bool) or not isinstance(value, typ):
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: Config, key: str, value, from_cli: bool) -> None:
    parts = key.split(".")
    if len(parts) == 3 and isinstance(getattr(getattr(cfg, parts[0], None), parts[1], None), dict):
        # section.table.entry (--model.hf.hidden_size=64): the value is read as TOML, else kept as a string
        if from_cli:
            with contextlib.suppress(tomllib.TOMLDecodeError):
                value = tomllib.loads(f"v = {value}")["v"]
        getattr(getattr(cfg, parts[0]), parts[1])[parts[2]] = value
        return
    if len(parts) != 2:
        raise ConfigError(f"{key}: expected section.key (one of {', '.join(_sections())})")
    section_name, name = parts
    if section_name not in _sections():
        raise ConfigError(f"{key}: unknown section {section_name!r}; sections: {', '.join(_sections())}")
    section = getattr(cfg, section_name)
    fields = _fields(section)
    if name not in fields:
        raise ConfigError(f"{key}: unknown key; [{section_name}] has {', '.join(fields)}")
    f, typ = fields[name]
    value = _coerce(key, value, typ, from_cli)
    choices = f.metadata.get("choices")
    if choices and isinstance(value, str) and value not in choices:
        expected = f"an int or {' or '.join(choices)}" if typ == int | str else f"one of {', '.join(choices)}"
        raise ConfigError(f"{key}: must be {expected}, got {value!r}")
    setattr(section, name, value)


def _sections() -> list[str]:
    return [f.name for f in dataclasses.fields(Config)]


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """`["--train.lr=1e-3", "--data.kind", "text"]` -> `[("train.lr", "1e-3"), ("data.kind", "text")]`."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"{arg}: expected an override of the form --section.key=value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 1
        else:
            raise ConfigError(f"{arg}: missing value")
        pairs.append((key, value))
        i += 1
    return pairs


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, world_size: int | None = None
) -> Config:
    """Defaults, then the TOML file at `path`, then `--section.key=value` overrides; validated, against
    the job's `world_size` too if given."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        with open(path, "rb") as fh:
            try:
                table = tomllib.load(fh)
            except tomllib.TOMLDecodeError as e:
                raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section_name, section in table.items():
            if not isinstance(section, dict):
                raise ConfigError(f"{section_name}: expected a [section] table, got a bare key")
            for name, value in section.items():
                _set(cfg, f"{section_name}.{name}", value, from_cli=False)
    for key, value in parse_overrides(overrides or []):
        _set(cfg, key, value, from_cli=True)
    validate(cfg, world_size)
    return cfg


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
    if name == "cudnn" and t.device == "cpu":
        raise ConfigError(f"{source} = cudnn needs train.device = cuda")


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
    run_id = cfg.logging.run_id
    if run_id and (Path(run_id).name != run_id or run_id.startswith(".")):
        raise ConfigError(f"logging.run_id: 'auto', '' or a directory name (no '/', no leading '.'), got {run_id!r}")


# Adam moves every weight by about lr a step from the first steps on, so a linear layer of fan-in
# n shifts its output by about lr·n of its scale, and the shifts compound over the layers. The
# early update size lr(step 10)·(largest fan-in)·layers sat at 0.28-3.7 in the runs whose loss fell
# from the first steps and at 14 in the ~7B whose loss rose; EARLY_UPDATE_RUNS names their record.
EARLY_UPDATE_BOUND = 8.0
EARLY_UPDATE_RUNS = (
    "runs whose loss fell sat at 0.28-3.7, a ~7B whose loss rose 7 -> 40 at 14: benchmarks/training.jsonl, "
    '"The learning-rate bound\'s runs"'
)


def early_lr(t: TrainConfig) -> float:
    """The learning rate the schedule reaches by step 10: the peak, or 10/warmup_steps of it."""
    return t.lr * min(1.0, 10 / t.warmup_steps) if t.warmup_steps else t.lr


def early_update_warning(t: TrainConfig, max_fan_in: int, n_layers: int) -> str | None:
    """A warning when the learning rate of the first steps is too large for the model's width and
    depth (`EARLY_UPDATE_BOUND`), naming what to change and the runs the bound rests on; None when
    it is within what trains."""
    lr10 = early_lr(t)
    size = lr10 * max_fan_in * n_layers
    if size <= EARLY_UPDATE_BOUND:
        return None
    return (
        f"train.lr = {t.lr:g} with train.warmup_steps = {t.warmup_steps} reaches lr {lr10:.3g} by step 10: with "
        f"fan-ins up to {max_fan_in} over {n_layers} layers each step moves the model by about {size:.0f} "
        f"(lr·fan-in·layers), above the {EARLY_UPDATE_BOUND:g} the recorded runs allow ({EARLY_UPDATE_RUNS}), "
        f"and the loss may rise. Lower train.lr or lengthen train.warmup_steps (Llama 3's 8B recipe: lr 3e-4 "
        f"over 2000 warm-up steps)"
    )


def check_early_update(t: TrainConfig, max_fan_in: int, n_layers: int) -> str | None:
    """`early_update_warning`'s text for the run to print at its start, or, with `train.strict_lr`,
    a ConfigError naming that option instead."""
    warning = early_update_warning(t, max_fan_in, n_layers)
    if warning is not None and t.strict_lr:
        raise ConfigError(f"train.strict_lr = true refuses this run: {warning}")
    if warning is not None:
        return f"{warning}; --train.strict_lr=true makes this an error"
    return None


def resolve_eod_token(d: DataConfig) -> int:
    """The end-of-document token of `d`, with -1 (auto) resolved by `d.kind` (see DataConfig.eod_token)."""
    if d.eod_token != -1:
        return d.eod_token
    return 50256 if d.kind == "bin" else 0


def describe() -> str:
    """Every option with its default and documentation, for `--help`."""
    lines = []
    for section_name in _sections():
        lines.append(f"[{section_name}]")
        section = getattr(Config(), section_name)
        for name, (f, typ) in _fields(section).items():
            lines.append(
                f"  --{section_name}.{name}={getattr(section, name)!r}  ({getattr(typ, '__name__', typ)})  "
                f"{f.metadata['help']}"
            )
    return "\n".join(lines)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def kernel_backend(p: ParallelConfig) -> tuple[str, str]:
    """(the kernel backend's name, where it came from): `parallel.kernel_backend`, or with auto
    `RINGFLASH_KERNEL_BACKEND` if set. Read once, here; the model is handed the name."""
    if p.kernel_backend != "auto" or "RINGFLASH_KERNEL_BACKEND" not in os.environ:
        return p.kernel_backend, "parallel.kernel_backend"
    name = os.environ["RINGFLASH_KERNEL_BACKEND"]
    if name not in BACKENDS:
        raise ConfigError(f"RINGFLASH_KERNEL_BACKEND must be one of {BACKENDS}, got {name!r}")
    return name, "RINGFLASH_KERNEL_BACKEND (parallel.kernel_backend = auto)"
