"""Config loading: defaults < TOML file < CLI, and errors that name the offending key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from ringflash.train.config import Config, ConfigError, ParallelConfig, describe, load_config, parse_overrides
from tests.dist_utils import REPO

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_defaults_are_valid():
    cfg = load_config()
    assert cfg == Config()


def test_choices_are_the_librarys():
    # train/config_schema.py spells them out so that loading a config imports no torch; they must stay
    # what the ring accepts.
    from ringflash.layout import LAYOUTS, SCHEMES
    from ringflash.transport import TRANSPORTS

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(ParallelConfig)}
    assert set(choices["layout"]) == set(LAYOUTS)
    assert set(choices["cp_scheme"]) == set(SCHEMES) | {"auto"}
    assert set(choices["transport"]) == set(TRANSPORTS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.data.seq_len % (2 * cfg.parallel.cp) == 0


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.toml", "gpu1.toml", "gpu2_long.toml"} <= names


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "[train]\nlr = 0.5\nsteps = 70\n[data]\nseq_len = 1024\n")
    cfg = load_config(path, ["--train.lr=0.25", "--model.dim", "64"])
    assert cfg.train.lr == 0.25  # CLI beats file
    assert cfg.train.steps == 70  # file beats default
    assert cfg.model.dim == 64  # CLI beats default; "--key value" form
    assert cfg.train.warmup_steps == Config().train.warmup_steps  # default kept


def test_toml_int_accepted_for_float(tmp_path):
    assert load_config(write(tmp_path, "[train]\nlr = 1\n")).train.lr == 1.0


def test_cli_bool_parsing():
    assert load_config(None, ["--train.compile=true"]).train.compile is True
    assert load_config(None, ["--train.compile=0"]).train.compile is False
    assert load_config(None, ["--train.compile=1"]).train.compile is True
    assert load_config(None, ["--train.compile=FALSE"]).train.compile is False
    with pytest.raises(ConfigError, match=r"train.compile: expected bool"):
        load_config(None, ["--train.compile=yes please"])


@pytest.mark.parametrize(
    "text, match",
    [
        ("[train]\nlearning_rate = 0.1\n", "train.learning_rate: unknown key"),
        ("[trainer]\nlr = 0.1\n", "trainer.lr: unknown section"),
        ("[train]\nsteps = 'ten'\n", "train.steps: expected int, got str"),
        ("[train]\nsteps = 1.5\n", "train.steps: expected int, got float"),
        ("[train]\ncompile = 1\n", "train.compile: expected bool, got int"),
        ("[model]\ndim = true\n", "model.dim: expected int, got bool"),
        ("[data]\nkind = 'images'\n", "data.kind: must be one of passkey, text, bin"),
        ("lr = 0.1\n", "lr: expected a \\[section\\] table"),
        ("[train\n", "invalid TOML"),
    ],
)
def test_bad_file_names_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "args, match",
    [
        (["--train.nope=1"], "train.nope: unknown key"),
        (["--train.steps=ten"], "train.steps: expected int, got 'ten'"),
        (["--steps=10"], "of the form --section.key=value"),
        (["train.steps=10"], "expected an override"),
        (["--train.steps"], "missing value"),
    ],
)
def test_bad_cli_names_the_key(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, args)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"config file not found"):
        load_config("/nonexistent/config.toml")


@pytest.mark.parametrize(
    "args, match",
    [
        (["--parallel.cp=2", "--data.seq_len=514"], r"seq_len \(514\) must be divisible by 4 \(2·cp"),
        (["--parallel.cp=3", "--parallel.layout=contiguous", "--data.seq_len=512"], "divisible by 3"),
        (["--model.dim=100", "--model.n_heads=3"], "model.dim"),
        (["--model.n_heads=4", "--model.n_kv_heads=3"], "n_kv_heads"),
        (["--data.kind=text"], "data.path: required"),
        (["--train.steps=0"], "train.steps: must be >= 1"),
        (["--train.steps=10", "--train.stop_at=11"], "train.stop_at"),
        (["--train.steps=10", "--logging.profile_step=11"],
         r"logging.profile_step \(11\) must be in \[0, train.steps = 10\]"),
        (["--parallel.cp=2", "--data.warmup_seq_len=130", "--data.warmup_seq_steps=1"], r"warmup_seq_len \(130\)"),
        (["--data.warmup_seq_len=1024", "--data.warmup_seq_steps=1"], "shorter than data.seq_len"),
        (["--data.warmup_seq_len=128"], r"data.warmup_seq_steps \(0\) must be in \[1, train.steps"),
        (["--data.pack_documents=true"], "data.pack_documents: needs data.kind = text or bin"),
        (
            ["--data.kind=bin", "--data.path=x", "--data.pack_documents=true"],
            r"data.eod_token \(50256, auto for bin\) must be a token id in \[0, model.vocab_size = 256\)",
        ),
        (["--data.kind=text", "--data.path=x", "--data.pack_documents=true", "--data.eod_token=256"], "eod_token"),
        (["--data.eod_token=-2"], r"data.eod_token: must be -1 \(auto\)"),
        (["--model.window=-1"], r"model.window: must be >= 0"),
        (["--parallel.transport=copy-engine", "--parallel.dist_backend=gloo"], "parallel.transport: copy-engine needs"),
        (["--parallel.kernel_backend=cudnn", "--model.window=64"],
         "parallel.kernel_backend = cudnn: backend='cudnn' runs causal or full attention only"),
        (["--parallel.kernel_backend=cudnn", "--train.device=cpu"],
         "parallel.kernel_backend = cudnn needs train.device = cuda"),
        (["--parallel.kernel_backend=cudnn", "--data.kind=text", "--data.path=x", "--data.pack_documents=true"],
         "parallel.kernel_backend = cudnn: backend='cudnn' runs causal or full attention only"),
        (["--parallel.kernel_backend=cudnn", "--train.device=cuda", "--train.dtype=float32"],
         r"takes float16 or bfloat16 inputs, got torch.float32"),
        (["--parallel.kernel_backend=cudnn", "--train.device=cuda", "--model.dim=240", "--model.n_heads=4"],
         r"q.shape\[3\] \(head_dim\) a multiple of 8, got 60"),
        (["--checkpoint.keep=0"], r"checkpoint.keep: must be >= 1, got 0"),
        (["--model.dim=96", "--model.n_heads=32"], r"model.dim \(96\) must be n_heads \(32\) times an even head_dim"),
        (["--train.warmup_steps=-1"], r"train.warmup_steps: must be >= 0, got -1"),
        (["--parallel.timeout_s=0"], r"parallel.timeout_s: must be > 0, got 0.0"),
        (["--model.kind=hf", "--model.hf.model_type=llama", "--parallel.cp=2", "--parallel.cp_heads=2"],
         r"parallel.cp_heads > 1 needs model.kind = small"),
        (["--parallel.cp_scheme=tree"], r"parallel.cp_scheme"),
        (["--parallel.cp=2", "--parallel.layout=stripe"], r"parallel.layout = stripe spreads every evaluation"),
    ],
)
def test_inconsistent_values(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, args)


@pytest.mark.parametrize(
    "args, match",
    [
        # configs/hf_llama_tiny_cpu.toml had 2 buckets with cp = 2: bucket 0 spanned ranks 0 and 1.
        (["--parallel.cp=2", "--data.eval_buckets=2"], r"data.eval_buckets \(2\) must be a multiple of 4 \(2·cp"),
        (["--parallel.cp=2", "--data.eval_buckets=6", "--data.seq_len=1536"], r"data.eval_buckets \(6\) must"),
        (
            ["--parallel.cp=4", "--parallel.layout=contiguous", "--data.eval_buckets=2", "--data.seq_len=1024"],
            r"data.eval_buckets \(2\) must be a multiple of 4 \(cp for the contiguous layout",
        ),
        (["--data.kind=recall", "--parallel.cp=2", "--data.eval_buckets=2", "--data.seq_len=128"], "data.eval_buckets"),
    ],
)
def test_eval_buckets_must_fit_the_shards(args, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, args)


def test_transformers_models_take_the_allgather():
    cfg = load_config(None, ["--model.kind=hf", "--model.hf.model_type=llama", "--parallel.cp_scheme=allgather"])
    assert (cfg.model.kind, cfg.parallel.cp_scheme) == ("hf", "allgather")


def test_eval_buckets_rule_only_where_buckets_are_evaluated():
    # One rank holds every bucket; no evaluation, no buckets; text has none.
    assert load_config(None, ["--data.eval_buckets=3"]).data.eval_buckets == 3
    load_config(None, ["--parallel.cp=2", "--data.eval_buckets=2", "--data.eval_samples=0"])
    load_config(None, ["--parallel.cp=2", "--data.eval_buckets=2", "--data.kind=text", "--data.path=x"])
    load_config(None, ["--parallel.cp=2", "--data.eval_buckets=8", "--data.seq_len=1024"])
    load_config(None, ["--parallel.cp=2", "--parallel.layout=contiguous", "--data.eval_buckets=2"])


def test_kernel_backend_auto_checks_what_the_environment_chooses(monkeypatch):
    # kernel_backend = auto defers to RINGFLASH_KERNEL_BACKEND, read once when the config is checked:
    # a cuDNN choice made there is checked as if the config had made it, and the error says where it
    # came from; the model is handed the resolved name (kernel_backend).
    from ringflash.train.config import kernel_backend

    monkeypatch.setenv("RINGFLASH_KERNEL_BACKEND", "cudnn")
    with pytest.raises(ConfigError, match=r"^RINGFLASH_KERNEL_BACKEND \(parallel.kernel_backend = auto\) = cudnn: "):
        load_config(None, ["--model.window=64", "--train.device=cuda"])
    cfg = load_config(None, ["--parallel.kernel_backend=triton", "--model.window=64"])  # the config's own choice wins
    assert kernel_backend(cfg.parallel)[0] == "triton"
    monkeypatch.setenv("RINGFLASH_KERNEL_BACKEND", "flash")
    with pytest.raises(ConfigError, match=r"RINGFLASH_KERNEL_BACKEND must be one of"):
        load_config(None, [])


@pytest.mark.parametrize(
    "arg, match",
    [
        # Each would otherwise fail later, inside torch or the loop, with a traceback (or not at all).
        ("--train.lr=-1", r"train.lr: must be > 0, got -1.0"),
        ("--train.lr=0", r"train.lr: must be > 0, got 0.0"),
        ("--train.lr=nan", r"train.lr: must be finite and > 0, got nan"),
        ("--train.lr=inf", r"train.lr: must be finite and > 0, got inf"),
        ("--train.beta1=-0.1", r"train.beta1: must be in \[0, 1\), got -0.1"),
        ("--train.beta2=1", r"train.beta2: must be in \[0, 1\), got 1.0"),
        ("--train.min_lr_ratio=1.5", r"train.min_lr_ratio: must be in \[0, 1\], got 1.5"),
        ("--train.min_lr_ratio=-0.1", r"train.min_lr_ratio: must be in \[0, 1\], got -0.1"),
        ("--train.weight_decay=-0.1", r"train.weight_decay: must be >= 0, got -0.1"),
        ("--train.grad_clip=-1", r"train.grad_clip: must be >= 0, got -1.0"),
        ("--train.grad_clip=nan", r"train.grad_clip: must be finite and >= 0, got nan"),
        ("--train.eval_every=-1", r"train.eval_every: must be >= 0, got -1"),
        ("--train.max_minutes=-1", r"train.max_minutes: must be >= 0, got -1.0"),
        ("--checkpoint.interval=-1", r"checkpoint.interval: must be >= 0, got -1"),
        ("--data.eval_samples=-1", r"data.eval_samples: must be >= 0, got -1"),
        ("--data.passkey_digits=0", r"data.passkey_digits: must be >= 1, got 0"),
        ("--data.passkey_gap=-1", r"data.passkey_gap: must be >= 0, got -1"),
        ("--data.passkey_repeats=-1", r"data.passkey_repeats: must be >= 0, got -1"),
        ("--data.warmup_seq_steps=-1", r"data.warmup_seq_steps: must be >= 0, got -1"),
        ("--model.ffn_dim=-1", r"model.ffn_dim: must be >= 0, got -1"),
        ("--model.rope_theta=0", r"model.rope_theta: must be > 0, got 0.0"),
        ("--model.norm_eps=-1e-5", r"model.norm_eps: must be > 0, got -1e-05"),
        ("--model.init_std=0", r"model.init_std: must be > 0, got 0.0"),
        ("--parallel.timeout_s=inf", r"parallel.timeout_s: must be finite and > 0, got inf"),
        ("--logging.peak_tflops=-1", r"logging.peak_tflops: must be >= 0, got -1.0"),
        ("--logging.profile_step=-1", r"logging.profile_step: must be >= 0, got -1"),
    ],
)
def test_out_of_range_values_name_the_field_and_range(arg, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [arg])


def test_nan_from_toml_is_refused(tmp_path):
    # TOML spells it too, and NaN passes any `value < 0` test.
    with pytest.raises(ConfigError, match=r"train.grad_clip: must be finite and >= 0, got nan"):
        load_config(write(tmp_path, "[train]\ngrad_clip = nan\n"))


def test_range_ends_and_offs_are_valid():
    # 0 keeps meaning off / only at the end; the closed ends of the ranges are valid settings.
    cfg = load_config(
        None,
        [
            "--train.min_lr_ratio=0", "--train.beta1=0", "--train.weight_decay=0", "--train.grad_clip=0",
            "--checkpoint.interval=0", "--data.eval_samples=0", "--data.passkey_gap=0", "--data.passkey_repeats=0",
        ],
    )  # fmt: skip
    assert (cfg.train.grad_clip, cfg.checkpoint.interval, cfg.data.eval_samples) == (0.0, 0, 0)
    assert load_config(None, ["--train.min_lr_ratio=1", "--train.lr=1e-30"]).train.min_lr_ratio == 1.0
    # The passkey fields are checked only where the passkey task reads them.
    assert load_config(None, ["--data.kind=text", "--data.path=x", "--data.passkey_digits=0"]).data.kind == "text"


def test_configs_name_their_device():
    # "auto" would quietly train the ~100M-parameter models on the CPU of a machine without a GPU,
    # and run the README's 2-process CPU command on a machine's GPUs (two of them, or fail on one).
    devices = {p.name: load_config(p).train.device for p in CONFIGS}
    on_gpu = lambda p: p.name.startswith("gpu") or p.stem.endswith("_gpu")  # gpu1.toml, hf_llama_1b_gpu.toml
    assert devices == {p.name: "cuda" if on_gpu(p) else "cpu" for p in CONFIGS}


def test_more_processes_than_gpus_is_refused_by_name(monkeypatch):
    # A second process on a one-GPU machine would fail inside torch.cuda.set_device, and only
    # rank 0 prints errors.
    from ringflash.train.parallel import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    match = r"train.device: 2 processes on this node need a GPU each, and it shows 1: start at most 1"
    with pytest.raises(ConfigError, match=match):
        resolve_device("auto")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # under torchrun rank 0 refuses too (it prints the error)
    with pytest.raises(ConfigError, match=match):
        resolve_device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_limits_are_inclusive():
    # The largest values the bounds allow are valid settings, not off-by-one errors.
    cfg = load_config(
        None,
        ["--train.steps=10", "--train.stop_at=10", "--data.warmup_seq_len=128", "--data.warmup_seq_steps=10"],
    )
    assert (cfg.train.stop_at, cfg.data.warmup_seq_steps) == (10, 10)


def test_cp_must_divide_world_size():
    from ringflash.train.parallel import ParallelDims

    assert ParallelDims.from_config(ParallelConfig(cp=2), 4) == ParallelDims(dp=2, cp=2, world_size=4)
    with pytest.raises(ConfigError, match=r"parallel.cp \(3\) must divide the world size \(2\)"):
        ParallelDims.from_config(ParallelConfig(cp=3), 2)


def test_cp_heads_and_scheme_take_auto(tmp_path):
    cfg = load_config(write(tmp_path, '[parallel]\ncp = 2\ncp_heads = "auto"\ncp_scheme = "auto"\n'))
    assert (cfg.parallel.cp_heads, cfg.parallel.cp_scheme) == ("auto", "auto")
    assert load_config(write(tmp_path, "[parallel]\ncp = 2\ncp_heads = 2\n")).parallel.cp_heads == 2
    assert load_config(None, ["--parallel.cp=2", "--parallel.cp_heads=2"]).parallel.cp_heads == 2  # an int, not "2"
    assert "--parallel.cp_heads=1  (int | str)" in describe()


@pytest.mark.parametrize(
    "source, match",
    [
        (["--parallel.cp_heads=best"], r"^parallel.cp_heads: must be an int or auto, got 'best'$"),
        (["--parallel.cp_heads=Auto"], r"^parallel.cp_heads: must be an int or auto, got 'Auto'$"),
        ("[parallel]\ncp_heads = 2.5\n", r"^parallel.cp_heads: expected int or str, got float 2.5$"),
        ("[parallel]\ncp_heads = true\n", r"^parallel.cp_heads: expected int or str, got bool True$"),
        (["--parallel.cp_heads=0"], r"^parallel.cp_heads: must be >= 1, got 0$"),
        (["--parallel.cp=4", "--parallel.cp_heads=3"], r"parallel.cp_heads \(3\) must divide parallel.cp \(4\)"),
        (["--parallel.cp_scheme=best"], r"^parallel.cp_scheme: must be one of ring, allgather, auto, got 'best'$"),
    ],
)
def test_bad_cp_heads_names_the_key_and_what_it_takes(tmp_path, source, match):
    with pytest.raises(ConfigError, match=match):
        load_config(*((write(tmp_path, source), []) if isinstance(source, str) else (None, source)))


def llama3_8b(cp: int, *overrides: str) -> Config:
    """Llama-3-8B's attention (32 heads, 8 K/V heads, head dim 128, 32 layers), one sequence of 8k
    tokens per GPU, bf16."""
    shape = ["--model.dim=4096", "--model.n_heads=32", "--model.n_kv_heads=8", "--model.n_layers=32"]
    run = ["--data.seq_len", str(8192 * cp), "--data.batch_size=1", "--data.eval_samples=0", "--train.dtype=bfloat16"]
    return load_config(None, [*shape, *run, f"--parallel.cp={cp}", *overrides])


def test_auto_chooses_head_parallel_for_llama3_8b_at_8k_per_gpu_on_4_h100s():
    # kernel_backend = auto: on H100s the Gluon kernels run, and the planner predicts at their rates
    from ringflash.train.parallel import choose_cp_layout

    u, scheme, line = choose_cp_layout(llama3_8b(4, "--parallel.cp_heads=auto"), 8, "NVIDIA H100 80GB HBM3")
    assert (u, scheme) == (4, "ring")
    assert line.startswith("parallel.cp_heads = auto: 4 (ringflash.plan for 4 GPUs, hopper kernels: head-parallel u=4 "
                           "is the fastest")
    u, scheme, line = choose_cp_layout(llama3_8b(4, "--parallel.cp_heads=auto", "--parallel.cp_scheme=auto"), 8, "H200")
    assert (u, scheme) == (4, "ring")
    assert line.startswith("parallel.cp_heads = auto: 4, parallel.cp_scheme = auto: ring (ringflash.plan for 4 GPUs")


def test_auto_predicts_at_the_run_kernel_backends_rates():
    # MHA at 8k tokens per GPU on 4 H100s with the Gluon kernels, whose ring steps add the arriving
    # dK/dV sums after their one backward kernel: the ring measured 9.44 ms over NCCL, head
    # parallelism ~8.3 (docs/performance.md); the planner predicts both at the hopper kernels' rates,
    # not the Triton kernels' (their ring: ~10 ms predicted and measured).
    from ringflash.plan import Model, choose_layout, cluster_of
    from ringflash.train.parallel import choose_cp_layout

    mha = ["--model.dim=2048", "--model.n_heads=16", "--model.n_kv_heads=16"]
    cfg = llama3_8b(4, *mha, "--parallel.cp_heads=auto", "--parallel.kernel_backend=hopper")
    u, scheme, line = choose_cp_layout(cfg, 8, "NVIDIA H100 80GB HBM3")
    assert (u, scheme) == (4, "ring") and "ringflash.plan for 4 GPUs, hopper kernels: head-parallel u=4" in line
    ring, _ = choose_layout(Model(16, 16, 128), 4 * 8192, cluster_of(4, 8), backend="hopper", u=1)
    triton, _ = choose_layout(Model(16, 16, 128), 4 * 8192, cluster_of(4, 8), backend="triton", u=1)
    assert 8.0 < ring.time_s * 1e3 < 9.5 < triton.time_s * 1e3  # the model is 10% below the measured 9.44


@pytest.mark.parametrize(
    "overrides, gpus_per_node, chosen, says",
    [
        # 12 heads, 3 K/V heads: neither u = 2 nor u = 4 splits or replicates them.
        (["--model.dim=1536", "--model.n_heads=12", "--model.n_kv_heads=3"], 8, (1, "ring"),
         "for 4 GPUs, hopper kernels: ring is"),
        (["--parallel.cp_heads=2", "--parallel.cp_scheme=auto"], 8, (2, "ring"), "parallel.cp_scheme = auto: ring ("),
        (["--parallel.cp_scheme=allgather"], 8, (4, "allgather"), "for 4 GPUs, hopper kernels: head-parallel u=4"),
        # Two GPUs a node: all-to-alls over the 4 ranks would cross InfiniBand; with u = 2 they stay
        # inside a node and only the ring of two crosses it.
        (["--parallel.cp_scheme=auto"], 2, (2, "ring"),
         "for 4 GPUs on 2 nodes, hopper kernels: ring, u=2 × r=2 is the fastest"),
        (["--model.window=4096"], 8, (4, "ring"), "(model.window not modelled)"),
        (["--model.kind=hf", "--model.hf.model_type=llama"], 8, (1, "ring"),
         "(model.kind = hf: no head grid, the scheme cp_scheme gives)"),
    ],
    ids=["heads-do-not-split", "scheme-only", "given-scheme-kept", "two-nodes", "window", "hf"],
)
def test_auto_resolves_to_what_the_config_allows(overrides, gpus_per_node, chosen, says):
    from ringflash.train.parallel import choose_cp_layout

    cfg = llama3_8b(4, "--parallel.cp_heads=auto", *overrides)
    u, scheme, line = choose_cp_layout(cfg, gpus_per_node, "NVIDIA H100 80GB HBM3")
    assert (u, scheme) == chosen and says in line, line


@pytest.mark.parametrize(
    "hf, scheme, says",
    [
        # Qwen2-0.5B's attention: 14 heads, 2 K/V heads of 64. The gathered K/V are small.
        (["model_type=qwen2", "hidden_size=896", "num_attention_heads=14", "num_key_value_heads=2",
          "num_hidden_layers=24"], "allgather", "(14/2 heads of 64, HF config): allgather is the fastest"),
        # Llama-3-8B's: 32 heads, 8 K/V heads of 128 (as for the native model above).
        (["model_type=llama", "hidden_size=4096", "num_attention_heads=32", "num_key_value_heads=8",
          "num_hidden_layers=32"], "ring", "(32/8 heads of 128, HF config): ring is the fastest"),
        (["model_type=mistral", "hidden_size=4096", "num_attention_heads=32", "num_key_value_heads=8",
          "num_hidden_layers=32", "sliding_window=4096"], "ring", "(the HF config's sliding windows not modelled)"),
    ],
    ids=["qwen2-0.5b", "llama-3-8b", "mistral-window"],
)
def test_auto_scheme_of_a_transformers_model_is_planned_for_its_hf_config(hf, scheme, says):
    pytest.importorskip("transformers", reason="needs the hf extra: pip install 'ringflash[hf]'")
    from ringflash.train.parallel import choose_cp_layout

    cfg = llama3_8b(4, "--model.kind=hf", *(f"--model.hf.{kv}" for kv in hf), "--parallel.cp_scheme=auto")
    u, chosen, line = choose_cp_layout(cfg, 8, "NVIDIA H100 80GB HBM3")
    assert (u, chosen) == (1, scheme) and says in line, line
    assert line.startswith(f"parallel.cp_scheme = auto: {scheme} (ringflash.plan for 4 GPUs, hopper kernels ("), line


def test_auto_is_the_planners_choice_of_a_valid_u_on_any_device():
    from ringflash.train.parallel import choose_cp_layout

    for heads, kv_heads in ((32, 8), (12, 3), (8, 1), (6, 6), (4, 2)):
        for cp in (1, 2, 4, 8):
            shape = [f"--model.dim={128 * heads}", f"--model.n_heads={heads}", f"--model.n_kv_heads={kv_heads}"]
            u, scheme, line = choose_cp_layout(llama3_8b(cp, *shape, "--parallel.cp_heads=auto"), 8, "cpu")
            # The explicit value passes the config's own checks (kv_heads_per_rank among them).
            load_config(None, [*shape, f"--data.seq_len={8192 * cp}", f"--parallel.cp={cp}", f"--parallel.cp_heads={u}",
                               f"--parallel.cp_scheme={scheme}", "--data.eval_samples=0"])  # fmt: skip
            assert "as H100/H200s (this run: cpu)" in line or cp == 1, line
    assert choose_cp_layout(llama3_8b(4), 8, "cpu") == (1, "ring", "")  # nothing auto: the config's own


@pytest.mark.parametrize(("dp", "cp", "override"), [(2, 2, True), (1, 4, False), (4, 1, False)])
def test_ring_groups_get_the_ring_options(monkeypatch, dp, cp, override):
    # NCCL options (high-priority streams) reach the cp groups when they are sub-groups; when cp
    # is the whole world the mesh reuses the default group, created with them already.
    import ringflash.train.parallel as parallel

    seen = {}

    def init_device_mesh(device_type, mesh_shape, *, mesh_dim_names=None, backend_override=None):
        seen.update(shape=mesh_shape, names=mesh_dim_names, override=backend_override)

    monkeypatch.setattr(parallel, "init_device_mesh", init_device_mesh)
    options = object()
    parallel.ParallelDims(dp=dp, cp=cp, world_size=dp * cp).build_mesh("cuda", ring_options=options)
    assert seen == dict(shape=(dp, cp), names=("dp", "cp"), override={"cp": options} if override else None)


def test_ring_groups_without_backend_override_warn(monkeypatch):
    # torch < 2.8 cannot pass options to a mesh's groups: the mesh is built anyway, with a warning.
    import ringflash.train.parallel as parallel

    monkeypatch.setattr(parallel, "init_device_mesh", lambda device_type, mesh_shape, *, mesh_dim_names=None: "mesh")
    with pytest.warns(UserWarning, match="TORCH_NCCL_HIGH_PRIORITY=1"):
        mesh = parallel.ParallelDims(dp=2, cp=2, world_size=4).build_mesh("cuda", ring_options=object())
    assert mesh == "mesh"


def test_every_field_is_documented():
    text = describe()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no help"
            assert f"--{section.name}.{f.name}=" in text


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b=1", "--c.d", "x=y"]) == [("a.b", "1"), ("c.d", "x=y")]


@pytest.mark.parametrize(
    "cfg, match",
    [(ParallelConfig(dist_backend="nccl"), "parallel.dist_backend: nccl needs train.device = cuda"),
     (ParallelConfig(transport="copy-engine"), "parallel.transport: copy-engine needs GPUs and NCCL; .* gloo"),
     (ParallelConfig(kernel_backend="cudnn"), "parallel.kernel_backend = cudnn needs train.device = cuda")],
)
def test_cpu_run_refuses_gpu_only_settings(cfg, match):
    # Checked before any process group is made: nothing to tear down, nothing hangs.
    from ringflash.train.parallel import distributed

    with pytest.raises(ConfigError, match=match), distributed(cfg, device="cpu"):
        pass


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data.eval_buckets=8"], r"^data.seq_len \(512\) too short for passkey with 8 buckets: each bucket \(64 "),
        (["--data.seq_len=4096", "--data.warmup_seq_len=64", "--data.warmup_seq_steps=1"],
         r"^data.warmup_seq_len \(64\): data.seq_len \(64\) too short for passkey with 1 buckets"),
    ],
)
def test_a_passkey_too_long_for_its_sequences_is_refused_when_the_config_loads(args, match):
    # Before, every rank found it while building its data, each printing it; the default config was one.
    with pytest.raises(ConfigError, match=match):
        load_config(None, args)


@pytest.mark.parametrize("backend", ["triton", "hopper"])
def test_triton_kernels_on_the_cpu_need_the_interpreter(backend, monkeypatch):
    # Refused when the config loads (one line from rank 0), not by every rank at its first kernel call.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    args = [f"--parallel.kernel_backend={backend}", "--train.device=cpu"]
    with pytest.raises(ConfigError, match=rf"^parallel.kernel_backend = {backend} on the CPU \(train.device = cpu\) "
                                          "needs the Triton interpreter: set TRITON_INTERPRET=1, or use reference$"):
        load_config(None, args)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert load_config(None, args).parallel.kernel_backend == backend
