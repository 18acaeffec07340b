"""The run configuration's sections: one dataclass per TOML section, each field with its default,
its documentation (`metadata["help"]`) and, for strings, its allowed values; and what a section
resolves on its own (the end-of-document token, the kernel backend).

`ringflash.train.config` reads them from TOML and the command line, and re-exports every name here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from ringflash.kernels import BACKENDS, AttnSpec

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
        4, "Passkey and recall depth buckets (each must hold a passkey's key and query: 121 tokens by default); "
        "with cp > 1 a multiple of 2·cp (zigzag) or cp (contiguous), so that "
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
        "Attention kernels: auto (hopper on H100/H200, triton on other GPUs or under "
        "torch.use_deterministic_algorithms, the PyTorch reference on CPU), triton, reference, cudnn "
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
    recompute_attention: bool = opt(
        True,
        "With activation_checkpointing: recompute attention with the rest of each block, its ring "
        "transfers included (true), or keep attention's outputs from the forward (false: no second "
        "attention forward, for its output, LSE and the K/V that came home: about (2·H·D + 4·H_kv·D) "
        "bytes a token a layer in bf16).",
    )
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
    profile_step: int = opt(
        0,
        "Run this step (1-based, as the log numbers it) under torch.profiler and write where its time "
        "went (device time by kernel category and by phase, exposed collectives, idle) to "
        "<run dir>/profile_step<N>.json; 0: off.",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)



def resolve_eod_token(d: DataConfig) -> int:
    """The end-of-document token of `d`, with -1 (auto) resolved by `d.kind` (see DataConfig.eod_token)."""
    if d.eod_token != -1:
        return d.eod_token
    return 50256 if d.kind == "bin" else 0


def warmup_data(d: DataConfig) -> DataConfig:
    """The data of `d`'s sequence-length warm-up: `warmup_seq_len` tokens a sequence, and one depth
    bucket (buckets are an evaluation matter, and the warm-up is not evaluated)."""
    return dataclasses.replace(d, seq_len=d.warmup_seq_len, eval_buckets=1)


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
