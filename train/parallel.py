"""All distributed set-up: degrees, the ("dp", "cp") mesh, the parallelize step, batch sharding.
What `parallel.cp_heads` / `cp_scheme` = auto become is `cp_layout.py`'s choice.

Rank layout: rank = dp_rank · cp + cp_rank, so the ranks of one ring are neighbours (one node,
NVLink) and data parallelism spans the outer dimension.

    with distributed(cfg.parallel, cfg.train.device) as pc:   # torn down in `finally`
        model = parallelize(Transformer(cfg.model).to(pc.device), pc, cfg)   # DDP or FSDP2
        mask = attention_mask(doc_ids, inputs.shape[1], pc, cfg.parallel.layout, cfg.model.attn_spec.window)
        x, y, pos = shard_batch(inputs, labels, pc, cfg.parallel.layout)
        logits = model(x, pos, mask=mask)
        with no_sync(model, not last_micro_step): ...            # either wrapper's gradient sync
        grad_norm = clip_grad_norm(model.parameters(), max_norm)  # over every shard
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import os
import warnings
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import ringflash
from ringflash import kernels
from ringflash.train.checkpoint_files import agreed
from ringflash.train.config import AUTO, Config, ConfigError, ParallelConfig, check_degrees, kernel_backend, to_dict
from ringflash.train.cp_layout import choose_cp_layout, node_of_rank_0
from ringflash.transport.groups import register_grid


@dataclass
class ParallelDims:
    """Parallel degrees checked against the world size: dp · cp == world."""

    dp: int
    cp: int
    world_size: int
    cp_heads: int = 1  # head-parallel ranks inside cp (ringflash/hybrid.py); the ring has cp / cp_heads
    cp_scheme: str = "ring"  # how attention crosses the cp ranks (ringflash.layout.SCHEMES)
    chosen: str = ""  # what "auto" chose for cp_heads and cp_scheme, and why ("": the config set them)

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, chosen: str = "") -> ParallelDims:
        """The degrees of `cfg`, its cp_heads and cp_scheme given (`choose_cp_layout` resolves "auto")."""
        check_degrees(cfg, world_size)
        return cls(dp=world_size // cfg.cp, cp=cfg.cp, world_size=world_size, cp_heads=cfg.cp_heads,
                   cp_scheme=cfg.cp_scheme, chosen=chosen)  # fmt: skip

    def build_mesh(self, device_type: str, ring_options: dist.ProcessGroupNCCL.Options | None = None) -> DeviceMesh:
        """The ("dp", "cp") mesh; `ring_options` (NCCL) for the cp groups when they are not the whole world.

        (When cp is the whole world the mesh reuses the default group, which has them already.)
        """
        override = {}
        ring_dim = "cp" if self.cp_heads == 1 else "cp_ring"
        if ring_options is not None and 1 < self.cp < self.world_size:
            if "backend_override" in inspect.signature(init_device_mesh).parameters:
                override = dict(backend_override={ring_dim: ring_options})
            else:  # torch < 2.8
                warnings.warn(
                    "this torch cannot give the ring's cp groups their own NCCL options: they get default-priority "
                    "streams and transfers overlap compute less (set TORCH_NCCL_HIGH_PRIORITY=1)",
                    stacklevel=2,
                )
        if self.cp_heads > 1:
            # ("dp", "cp_ring", "cp_heads"): the head all-to-all on the innermost dimension, consecutive
            # ranks (one node, NVLink), the ring across them; "cp" is the two flattened (cp rank =
            # ring rank · cp_heads + head rank, ringflash.grid_coords), for the mask's and the batch's
            # sharding and for gradient reduction.
            shape, names = (self.dp, self.cp // self.cp_heads, self.cp_heads), ("dp", "cp_ring", "cp_heads")
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=names, **override)
            mesh["cp_ring", "cp_heads"]._flatten("cp")
            return mesh
        return init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"), **override)


@dataclass
class ParallelContext:
    """What the rest of training needs to know about this process's place in the job."""

    dims: ParallelDims
    mesh: DeviceMesh
    device: torch.device
    rank: int
    dp_rank: int
    cp_rank: int

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp"].get_group()

    @property
    def cp_mesh(self) -> DeviceMesh:
        """All cp ranks as one dimension (the ring and head dimensions flattened when cp_heads > 1)."""
        if self.dims.cp_heads == 1:
            return self.mesh["cp"]
        return self.mesh["cp_ring", "cp_heads"]._flatten("cp")  # made in build_mesh; returned again

    @property
    def cp_group(self) -> dist.ProcessGroup:
        return self.cp_mesh.get_group()

    @property
    def ring_group(self) -> dist.ProcessGroup:
        """The group the ring runs over: cp, or the ranks holding the same heads when cp_heads > 1."""
        return self.cp_group if self.dims.cp_heads == 1 else self.mesh["cp_ring"].get_group()

    @property
    def head_group(self) -> dist.ProcessGroup | None:
        """The head all-to-all's group (None: cp_heads = 1, the ring alone)."""
        return None if self.dims.cp_heads == 1 else self.mesh["cp_heads"].get_group()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_cp_mesh(self) -> DeviceMesh:
        """The 1-D mesh of every rank, dp and cp flattened: what gradients are reduced over.

        (`_flatten` is DeviceMesh's own, private in name only: torchtitan builds its FSDP meshes
        with it; flattening again returns the mesh made the first time.)
        """
        if self.dims.cp_heads > 1:
            return self.mesh["dp", "cp_ring", "cp_heads"]._flatten("dp_cp")
        return self.mesh["dp", "cp"]._flatten("dp_cp")


def resolve_device(device: str) -> torch.device:
    """`train.device` for this process: on CUDA, the GPU of its local rank (one GPU per process)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device: cuda requested but no CUDA device is available")
        local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
        # By torchrun's count of this node's processes, so that every rank (rank 0, which prints
        # the error, too) refuses alike, not only the ones left without a GPU.
        per_node = max(int(os.environ.get("LOCAL_WORLD_SIZE", 0)), local_rank + 1)
        if per_node > gpus:
            raise ConfigError(
                f"train.device: {per_node} processes on this node need a GPU each, and it shows {gpus}: "
                f"start at most {gpus} (torchrun --nproc_per_node), or train on the CPU (--train.device=cpu)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """Under torchrun, the agent's store seen through a prefix unique to this restart attempt.

    torchrun's workers share the agent's TCPStore, which outlives a restart; the default env://
    init reuses the same keys in every attempt, so after `--max-restarts` kicks in a rank can
    read the previous attempt's peer addresses and fail to connect (gloo: "Connection refused",
    then a 5-minute connect timeout; pytorch/pytorch#135712). None outside torchrun's agent store.
    Every agent counts its own restarts, which agree as long as all nodes restart together (a
    failure restarts every node); a node added later by elastic scale-up would not agree.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )
    return dist.PrefixStore(f"ringflash/{run_id}/attempt_{attempt}", store)


@contextmanager
def distributed(cfg: ParallelConfig, device: str = "auto", timeout_s: float | None = None, run: Config | None = None):
    """Join (or start) the process group, build the mesh, and tear down what we started.

    Under torchrun the env:// rendezvous is used; a plain `python launch/train.py` becomes a
    world of one, so one code path serves both. An already-initialised group (a test harness)
    is used as it is and left alone on exit.

    The group's timeout (`timeout_s`, default `cfg.timeout_s`) bounds every collective and ring
    transfer: a rank that died, hangs or skipped a call makes the others raise after at most
    that long (gloo: the blocked call raises; NCCL: the watchdog aborts the process), and
    torchrun then restarts or stops the job instead of leaving it hung.

    `run`, the whole configuration, is what `parallel.cp_heads` or `cp_scheme` = auto are chosen
    for (`choose_cp_layout`); the mesh and `pc.dims` get the values chosen.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = cfg.dist_backend if cfg.dist_backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl" and dev.type != "cuda":
        raise ConfigError("parallel.dist_backend: nccl needs train.device = cuda")
    if kernel_backend(cfg)[0] == "cudnn" and dev.type != "cuda":
        raise ConfigError("parallel.kernel_backend = cudnn needs train.device = cuda")
    if cfg.transport == "copy-engine" and backend != "nccl":
        raise ConfigError(f"parallel.transport: copy-engine needs GPUs and NCCL; this run uses {backend}")
    started = not dist.is_initialized()
    # High-priority NCCL streams, so that ring transfers overlap the attention kernels.
    ring_options = ringflash.nccl_options() if backend == "nccl" else None
    try:
        if started:
            timeout = datetime.timedelta(seconds=cfg.timeout_s if timeout_s is None else timeout_s)
            opts = dict(backend=backend, timeout=timeout, pg_options=ring_options)
            store = _attempt_store(timeout)
            if store is not None:
                rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
                dist.init_process_group(store=store, rank=rank, world_size=world, **opts)
            elif "RANK" in os.environ:
                dist.init_process_group(**opts)
            else:
                dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **opts)
        chosen = ""
        if AUTO in (cfg.cp_heads, cfg.cp_scheme):
            if run is None:
                raise ConfigError("parallel.cp_heads or cp_scheme = auto: distributed(run=) needs the run's config")
            cp_heads, cp_scheme, chosen = choose_cp_layout(run, *node_of_rank_0(dev))
            cfg = dataclasses.replace(cfg, cp_heads=cp_heads, cp_scheme=cp_scheme)
        dims = ParallelDims.from_config(cfg, dist.get_world_size(), chosen)
        mesh = dims.build_mesh(dev.type, ring_options)
        pc = ParallelContext(dims, mesh, dev, dist.get_rank(), mesh["dp"].get_local_rank(), 0)
        pc.cp_rank = pc.cp_mesh.get_local_rank()
        if pc.head_group is not None:  # a call over the ring or head group checks the whole cp group
            register_grid(pc.cp_group, pc.ring_group, pc.head_group)
        yield pc
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


def check_same_config(cfg: Config) -> None:
    """Raise ConfigError on every rank unless every rank of the job runs the same configuration.

    The ring's per-call check compares what reaches attention (shapes, masks), not the settings:
    ranks launched with different ones (a stale TOML on one node, a per-rank override) would
    otherwise fail at the first differing shape, or train apart without an error. One small
    all_gather at start-up instead names every differing key and each rank's value.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {f"{section}.{key}": value for section, fields in to_dict(cfg).items() for key, value in fields.items()}
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    differ = [key for key in mine if len({repr(theirs.get(key)) for theirs in every}) > 1]
    if differ:
        detail = "; ".join(
            f"{key} is " + ", ".join(f"{theirs.get(key)!r} on rank {r}" for r, theirs in enumerate(every))
            for key in differ
        )
        raise agreed(ConfigError(
            f"the ranks were launched with different configurations: {detail}. "
            "Give every rank the same config file and overrides."
        ))  # fmt: skip


def parallelize(model: nn.Module, pc: ParallelContext, cfg: Config) -> nn.Module:
    """Ring attention over the cp group, then compile, activation checkpointing and DDP or FSDP2.

    The order matters: checkpointing wraps blocks that already hold the ring (and compiled
    parts), and DDP (or FSDP2, `parallel.fsdp`) wraps everything last so that it sees the final
    parameters. FSDP2 shards `model` in place and returns it; DDP returns a wrapper. The ranks must
    run the same configuration (the trainer checks it first of all, `check_same_config`).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    backend = _kernel_backend(model, cfg)
    transport = _ring_transport(cfg, pc)
    for i, block in enumerate(model.blocks):
        # One code path for every cp: with a world-1 group the ring is a single local kernel call.
        # The cross-rank check stays on: shapes agree by construction (check_same_config), but
        # each batch's document mask is the data pipeline's, and the check (a host round trip,
        # no GPU sync) catches cp ranks handed different ones.
        # The window lives in the core as well as in each batch's mask (which must agree with it):
        # a call without a mask (a user's own evaluation) still attends through the window.
        block.attn.core = ringflash.RingFlashAttention(
            group=pc.ring_group,
            layout=cfg.parallel.layout,
            causal=True,
            window_size=cfg.model.attn_spec.window_size,
            transport=transport,
            backend=backend,
            head_group=pc.head_group,
            scheme=pc.dims.cp_scheme,
        )
        if cfg.train.compile:
            # Only the parts without communication: norms and SwiGLU are memory-bound chains of
            # elementwise ops that fuse well; the ring and its autograd.Function stay eager.
            block.attn_norm = torch.compile(block.attn_norm)
            block.ffn_norm = torch.compile(block.ffn_norm)
            block.ffn = torch.compile(block.ffn)
        if cfg.train.activation_checkpointing:
            # Non-reentrant checkpointing replays the ring (and its communication) in backward;
            # every rank replays the same blocks in the same order, so the collectives still match.
            model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False, **checkpoint_options(cfg))
    return _replicate_or_shard(model, pc, cfg)


def _replicate_or_shard(model: nn.Module, pc: ParallelContext, cfg: Config) -> nn.Module:
    """FSDP2 over dp × cp (`parallel.fsdp`), sharded in place, or DDP over the *whole* world, not
    just dp: cp ranks hold different tokens of the same sequences, so their gradients are partial
    sums that must be added too. DDP averages over the world size; `train.trainer` scales the
    loss by it so the result is the global mean."""
    if cfg.parallel.fsdp:
        return shard_model(model, pc.dp_cp_mesh, fsdp_policy(cfg, pc.device))
    device_ids = [pc.device.index] if pc.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, process_group=dist.group.WORLD)


def _ring_transport(cfg: Config, pc: ParallelContext) -> str | None:
    """`parallel.transport` for the ring; None for the all-gather, which moves K/V by the group's
    collectives and refuses a transport (`validate` refuses copy-engine with cp_scheme = allgather)."""
    return cfg.parallel.transport if pc.dims.cp_scheme == "ring" else None


def _kernel_backend(model: nn.Module, cfg: Config) -> str:
    """The kernel backend's name, resolved once for every layer: the ring is handed it rather than
    left to read the environment."""
    return kernels.get_backend(kernel_backend(cfg.parallel)[0], next(model.parameters()).device).name


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks: `model.blocks` (ours), `model.model.layers`
    (Hugging Face decoder models: Llama, Qwen, Mistral, ...) or `model.hf.model.layers` (such a
    model in the training loop's wrapper, train/hf_model.py)."""
    for path in ("blocks", "model.layers", "hf.model.layers"):
        with contextlib.suppress(AttributeError):
            blocks = model.get_submodule(path)
            if isinstance(blocks, nn.ModuleList):
                return blocks
    raise TypeError(
        f"parallel.fsdp: cannot find the transformer blocks of {type(model).__name__}: "
        "expected a ModuleList at model.blocks or model.model.layers"
    )


def fsdp_policy(cfg: Config, device: torch.device) -> MixedPrecisionPolicy:
    """`parallel.fsdp_param_dtype` and `fsdp_reduce_dtype` as FSDP2's policy (auto: train.dtype's)."""
    param = cfg.parallel.fsdp_param_dtype
    if param == "auto":
        param = cfg.train.dtype if cfg.train.dtype != "auto" else ("bfloat16" if device.type == "cuda" else "float32")
    reduce = cfg.parallel.fsdp_reduce_dtype
    return MixedPrecisionPolicy(param_dtype=getattr(torch, param), reduce_dtype=getattr(torch, reduce))


def shard_model(model: nn.Module, mesh: DeviceMesh, policy: MixedPrecisionPolicy) -> nn.Module:
    """FSDP2 in place: each transformer block its own unit, the rest (embedding, final norm, head) the root's.

    A block's parameters are all-gathered just before its forward and freed after it (again in the
    backward), so a rank holds one block unsharded at a time (two with prefetch), not the model.
    The root keeps its parameters gathered from forward to backward (FSDP2's default for the root,
    which the backward needs first): with a tied embedding that is the vocabulary matrix, once.
    Gradients are reduce-scattered over `mesh` and averaged over its size, as DDP averages over
    the world: the trainer's loss scaling gives the global mean either way. Call it after the
    blocks are swapped, compiled and checkpoint-wrapped, so each unit is the final block.
    """
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextmanager
def no_sync(model: nn.Module, skip: bool = True):
    """Accumulate gradients locally, without reducing them over the ranks, while `skip` (all but the
    last micro-step): DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`."""
    if not skip:
        yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        with model.no_sync():
            yield


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` the norm of all gradients together; return that norm (a plain 0-dim tensor).

    Under FSDP each rank holds shards (DTensors): the norm of a DTensor is a partial one, and
    `full_tensor()` sums the squares over the shards, so every rank clips by the global norm.
    """
    params = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)  # DDP: every rank holds every gradient
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0).full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def checkpoint_options(cfg: Config) -> dict:
    """`torch.utils.checkpoint`'s keywords for the run: with `train.recompute_attention = false`,
    keep attention's outputs (`ringflash.ops.keep_attention_outputs`) and recompute the rest."""
    return {} if cfg.train.recompute_attention else {"context_fn": ringflash.ops.keep_attention_outputs}


def parallelize_hf(model: nn.Module, pc: ParallelContext, cfg: Config) -> nn.Module:
    """`parallelize` for a transformers model (`model.kind = hf`, a `train.hf_model.HFCausalLM`):
    its layers' attention becomes ringflash.hf's over the cp group, by `parallel.cp_scheme`; then
    compile, activation checkpointing (HF's own, non-reentrant) and DDP over the whole world or FSDP2,
    as for the small model."""
    import ringflash.hf

    backend = _kernel_backend(model, cfg)
    model.context = ringflash.hf.RingContext(pc.cp_group, cfg.parallel.layout, backend, _ring_transport(cfg, pc),
                                             scheme=pc.dims.cp_scheme)  # fmt: skip
    model.hf.set_attn_implementation(ringflash.hf.ATTN_IMPLEMENTATION)
    try:  # a model whose attention would not route through the ring trains on its shard alone
        ringflash.hf.check_model(model.hf.config)
    except ValueError as e:
        raise ConfigError(f"model.hf: {e}") from None
    if cfg.train.compile:  # the norms and MLPs of every decoder layer; attention stays eager, as above
        for layer in model.hf.base_model.layers:
            for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
                if hasattr(layer, name):
                    setattr(layer, name, torch.compile(getattr(layer, name)))
    if cfg.train.activation_checkpointing:
        model.hf.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False, **checkpoint_options(cfg)})
    return _replicate_or_shard(model, pc, cfg)


def shard_batch(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    pc: ParallelContext,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This cp rank's share of full `(B, L)` inputs and labels, and their global positions.

    Returns `(B, L/cp)` inputs and labels on `pc.device` and positions `(L/cp,)`: the same slices
    of all three, in the layout the ring expects. Document ids are not sharded: the ring's mask is
    built from the global ones (`attention_mask`).
    """
    cp, u = pc.dims.cp, pc.dims.cp_heads
    ringflash.layout.check_splittable(inputs.shape[1], cp, layout)
    ring_rank, head_rank = ringflash.grid_coords(pc.cp_rank, u)  # u = 1: the ring's rank, head rank 0
    grid = dict(layout=layout, head_rank=head_rank, head_world=u)
    x = ringflash.shard(inputs, 1, ring_rank, cp // u, **grid)
    y = ringflash.shard(labels, 1, ring_rank, cp // u, **grid)
    pos = ringflash.global_positions(x.shape[1], ring_rank, cp // u, device=pc.device, **grid)
    return x.to(pc.device, non_blocking=True), y.to(pc.device, non_blocking=True), pos


def attention_mask(
    doc_ids: torch.Tensor | None,
    seq_len: int,
    pc: ParallelContext,
    layout: str,
    window: tuple[int, int] | None = None,
):
    """The ring's mask for one micro-batch (the all-gather's under `parallel.cp_scheme = allgather`),
    or None when there is nothing to mask beyond causality.

    `doc_ids (B, seq_len)` are the *global* (unsharded) document ids of the batch, as every cp rank
    holds them before `shard_batch`; None means one document per sequence. `window` is the
    model's `(left, right)` (`ModelConfig.attn_spec`, None: none). Built once per micro-batch and
    handed to every layer through the model (`Transformer.forward(..., mask=)`), so no layer
    rebuilds it.
    """
    if doc_ids is None and window is None:
        return None  # plain causal: no mask, no overhead
    build = ringflash.gather_mask if pc.dims.cp_scheme == "allgather" else ringflash.ring_mask
    return build(
        doc_ids,
        seqlen=seq_len,
        group=pc.ring_group,  # the ring's mask: with cp_heads > 1 the ring runs over ring shards
        layout=layout,
        causal=True,
        window=window,
        device=pc.device,
    )
