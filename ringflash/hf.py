"""Ring attention inside Hugging Face `transformers` models: an attention implementation and the
batch sharding that goes with it (needs the `hf` extra: `pip install 'ringflash[hf]'`).

    import ringflash.hf                                    # registers ATTN_IMPLEMENTATION
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=ringflash.hf.ATTN_IMPLEMENTATION)
    shard = ringflash.hf.shard_batch(batch, cp_group, layout="zigzag", config=model.config)
    loss = model(**shard).loss                             # this rank's share of the global mean
    loss.backward()                                        # then all-reduce the grads (SUM) over cp

The name is "ring_attention": `transformers` treats any implementation whose name contains
"flash" as a flash-attention kernel to load. HF's `(B, H, N, D)` views reach the kernels by a
transpose (no copy); each layer's scale, sliding window, softcap (Gemma 2) and sinks (gpt-oss's
`s_aux`) go to the ring; documents and padding come from `shard_batch`'s `RingMasks` (keyword
`ring_masks`), never from a dense mask; what the ring cannot honour (ALiBi, dropout in training,
a KV cache, varlen kwargs, a non-trivial `attention_mask`) is refused by name. `shard_batch`
shifts the labels on the global sequence, so the cp ranks' summed losses and gradients are the
single-device ones exactly. The reference: docs/api.md, "Hugging Face `transformers` models".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("ringflash.hf needs transformers: pip install 'ringflash[hf]'") from e

from ringflash import agree
from ringflash.allgather import GatherMask, gather_mask
from ringflash.api import CallOptions, _run
from ringflash.inputs import FlashArgs
from ringflash.kernels import AttnSpec
from ringflash.layout import check_layout, check_splittable, shard
from ringflash.masks import RingMask, ring_mask

__all__ = [
    "ATTN_IMPLEMENTATION",
    "RingContext",
    "RingMasks",
    "check_model",
    "context_parallel",
    "current_context",
    "doc_ids_from_positions",
    "layer_window",
    "ring_attention_forward",
    "ring_masks",
    "shard_batch",
]

ATTN_IMPLEMENTATION = "ring_attention"
IGNORE_INDEX = -100  # transformers' label for "no loss here"
_BATCH_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")
_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")  # FlashAttentionKwargs


@dataclass(frozen=True)
class RingContext:
    """Where ring attention runs: the context-parallel `group` (None: the default group, or this
    process alone), the `layout` the sequence was sharded with, optionally the kernel `backend`
    and `transport` (None: ringflash's defaults; the ring's only), and the `scheme`, `"ring"` or
    `"allgather"` (with `heads_k_stride` K/V heads per gather, 1 for the ring); see
    `ringflash.ring_flash_attn_func`."""

    group: dist.ProcessGroup | None = None
    layout: str = "zigzag"
    backend: str | None = None
    transport: str | None = None
    scheme: str = "ring"
    heads_k_stride: int = 1

    def __post_init__(self):
        check_layout(self.layout)
        self.options().check()
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(self.group).__name__}")

    def rank_world(self) -> tuple[int, int]:
        if self.group is None and not (dist.is_available() and dist.is_initialized()):
            return 0, 1
        return dist.get_rank(self.group), dist.get_world_size(self.group)

    def options(self, softcap: float = 0.0) -> CallOptions:
        """One call's options in this context (`softcap`: the layer's), as `ring_flash_attn_func` makes them."""
        return CallOptions(scheme=self.scheme, layout=self.layout, backend=self.backend, transport=self.transport,
                           heads_k_stride=self.heads_k_stride, softcap=softcap)  # fmt: skip

    def mask(self, doc_ids: torch.Tensor | None, **kwargs) -> RingMask | GatherMask:
        """The scheme's mask (`ring_mask` or `gather_mask`, both taking `kwargs`) over this group and layout."""
        build = gather_mask if self.scheme == "allgather" else ring_mask
        return build(doc_ids, group=self.group, layout=self.layout, **kwargs)


_DEFAULT = RingContext()
_lock = threading.Lock()
_active: list[RingContext] = []  # a stack: the innermost context_parallel() last


@contextlib.contextmanager
def context_parallel(
    group: dist.ProcessGroup | None = None, layout: str = "zigzag", *, backend: str | None = None,
    transport: str | None = None, scheme: str = "ring", heads_k_stride: int = 1,
) -> Iterator[RingContext]:  # fmt: skip
    """Within this block, ring attention calls without `ring_masks` run over `group` with `layout`
    and `scheme` (`"ring"`, or `"allgather"` with `heads_k_stride` K/V heads per gather), and
    `shard_batch` without a group, layout or scheme takes them from here.

    Process-wide (not per thread: autograd replays checkpointed layers in its own threads), so one
    model per process; nested blocks restore the outer setting on exit. Yields the `RingContext`.
    """
    ctx = RingContext(group, layout, backend, transport, scheme, heads_k_stride)
    with _lock:
        _active.append(ctx)
    try:
        yield ctx
    finally:
        with _lock:
            for i in range(len(_active) - 1, -1, -1):
                if _active[i] is ctx:
                    del _active[i]
                    break


def current_context() -> RingContext:
    """The innermost active `context_parallel` setting, else the default group with zigzag."""
    return _active[-1] if _active else _DEFAULT


# ----------------------------------------------------------------------------- masks


@dataclass(frozen=True, eq=False)
class RingMasks:
    """One batch's masks, one per attention the model's layers use (the layer's `AttnSpec`: causal,
    with its sliding window or none), and the `RingContext` they were built for, whose scheme
    makes them `RingMask`s (the ring) or `GatherMask`s (the all-gather). Made by
    `ring_masks`/`shard_batch`; passed to the model as `ring_masks=`. A window not built up front
    is built on first use (eagerly; under torch.compile it must be built up front: give `config=`)."""

    context: RingContext
    seqlen: int
    doc_ids: torch.Tensor | None  # (B, N_global) int64 on the host, or None: one document per row
    device: torch.device
    masks: dict[AttnSpec, RingMask | GatherMask] = field(default_factory=dict)

    def for_spec(self, spec: AttnSpec) -> RingMask | GatherMask:
        mask = self.masks.get(spec)
        if mask is not None:
            return mask
        if torch.compiler.is_compiling():
            built = sorted((m.window for m in self.masks.values()), key=str)
            raise ValueError(
                f"ring_masks: no mask for sliding_window={spec.window} (built: {built}); under "
                "torch.compile build every window up front: shard_batch(..., config=model.config)"
            )
        mask = self.context.mask(self.doc_ids, seqlen=self.seqlen, causal=spec.causal, window=spec.window,
                                 device=self.device)  # fmt: skip
        self.masks[spec] = mask
        return mask


def layer_spec(window: int | None) -> AttnSpec:
    """A decoder layer's attention as the kernels' spec: causal, within HF's sliding `window`
    (key j visible from query i iff i − w < j <= i, the spec's window `(w - 1, 0)`) or none."""
    return AttnSpec(causal=True, window=window)


def layer_window(config, layer_idx: int | None) -> int | None:
    """The sliding window (keys seen, counting the diagonal) of layer `layer_idx` by its config:
    `config.sliding_window` where `config.layer_types[layer_idx] == "sliding_attention"`, or on
    every layer for configs without `layer_types` (Mistral); None: full causal attention."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and layer_idx is not None:
        kind = types[layer_idx]
        if kind == "chunked_attention":
            raise ValueError(
                f"config.layer_types[{layer_idx}] = 'chunked_attention' (config.attention_chunk_size): ring "
                "attention has no chunked attention"
            )
        return window if kind == "sliding_attention" else None
    return window


def model_windows(config) -> set[int | None]:
    """Every distinct sliding window of the config's layers (None: full causal)."""
    n = getattr(config, "num_hidden_layers", None)
    if getattr(config, "layer_types", None) is None or n is None:
        return {layer_window(config, None)}
    return {layer_window(config, i) for i in range(n)}


def doc_ids_from_positions(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Document ids `(B, N)` int64 of packed rows: a document starts wherever the position id does
    not follow its predecessor by 1 (transformers' `find_packed_sequence_indices`: restarts at 0
    from `DataCollatorWithFlattening`) and, given a padding `attention_mask`, wherever padding
    starts or stops (so no real token sees a pad token)."""
    pos = position_ids.to(torch.int64)
    new = torch.ones_like(pos, dtype=torch.bool)
    new[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
    if attention_mask is not None:
        m = attention_mask.to(torch.bool)
        new[:, 1:] |= m[:, 1:] != m[:, :-1]
    return new.cumsum(1) - 1


def ring_masks(
    doc_ids: torch.Tensor | None = None,
    *,
    seqlen: int | None = None,
    context: RingContext | None = None,
    config=None,
    device: torch.device | str | None = None,
) -> RingMasks:
    """This rank's `RingMasks` for one batch: `doc_ids (B, N_global)` global document ids (None:
    one document per row, then `seqlen` = N_global), for the windows of `config`'s layers (None:
    full causal only, others built on first use), over `context` (None: `current_context()`)."""
    context = context or current_context()
    if doc_ids is not None:
        doc_ids = doc_ids.detach().to("cpu", torch.int64)
        doc_ids = doc_ids.unsqueeze(0) if doc_ids.dim() == 1 else doc_ids
        seqlen = doc_ids.shape[-1] if seqlen is None else seqlen
        if bool((doc_ids == doc_ids[:, :1]).all()):
            doc_ids = None  # one document per row: the plain causal schedule, no intervals
    if seqlen is None:
        raise ValueError("seqlen: give N_global when doc_ids is None")
    masks = RingMasks(context, seqlen, doc_ids, torch.device(device) if device is not None else torch.device("cpu"))
    for window in model_windows(config) if config is not None else {None}:
        masks.for_spec(layer_spec(window))
    return masks


# ----------------------------------------------------------------------------- batch sharding


def _check_batch(batch: Mapping) -> tuple[torch.Tensor, int, int]:
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a dict of tensors, got {type(batch).__name__}")
    unknown = sorted(set(batch) - set(_BATCH_KEYS))
    if unknown:
        raise ValueError(
            f"batch: cannot shard keys {unknown}; shard_batch takes {list(_BATCH_KEYS)} (packed documents "
            "as position_ids restarting at 0, not flash-attention kwargs such as cu_seq_lens)"
        )
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError(f"batch['input_ids'] must be a (batch, seqlen) tensor, got {getattr(ids, 'shape', ids)}")
    B, N = ids.shape
    for key in _BATCH_KEYS[1:]:
        t = batch.get(key)
        if t is not None and (t.dim() != 2 or t.shape[1] != N or t.shape[0] not in (1, B)):
            raise ValueError(f"batch[{key!r}] must have shape ({B}, {N}) like input_ids, got {tuple(t.shape)}")
    return ids, B, N


def check_model(config) -> None:
    """Raise ValueError, naming the model type, if a model of `config` (its `model.config`) would
    not run its attention through the ring: another `attn_implementation`, or a model class that
    does not call transformers' AttentionInterface. `shard_batch(config=)` calls it."""
    model_type = getattr(config, "model_type", None)
    base = MODEL_MAPPING_NAMES.get(model_type)
    # The model type's base class and the config's own architectures: the classes transformers
    # would build, whose `is_backend_compatible` says whether their layers call the interface.
    for name in [*(base if isinstance(base, tuple) else [base]), *(getattr(config, "architectures", None) or [])]:
        cls = getattr(transformers, name, None) if isinstance(name, str) else None
        if cls is not None and not cls.is_backend_compatible():
            raise ValueError(
                f"model type {model_type!r} ({name}): its attention layers do not call transformers' "
                "AttentionInterface (e.g. ALiBi in the layer itself), so they would ignore ring attention and "
                "attend only within each rank's shard; ringflash.hf cannot serve this model"
            )
    # After the model type: a model that cannot take the ring keeps its own implementation too.
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"config._attn_implementation is {impl!r}, not {ATTN_IMPLEMENTATION!r}: this rank's model would "
            "not enter the ring (models built from one config object share it: build a reference model "
            "from copy.deepcopy(config), not from the ring model's config)"
        )


def shard_batch(
    batch: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None = None,
    layout: str | None = None,
    *,
    scheme: str | None = None,
    config=None,
    device: torch.device | str | None = None,
    check_ranks: bool = True,
) -> dict:
    """This rank's shard of a global causal-LM batch, ready for `model(**shard)`.

    Args:
        batch: `input_ids (B, N)`; optional `labels (B, N)` (HF convention: unshifted, -100 = no
            loss), `position_ids (B, N)` (restarting at 0 per packed document, as
            `DataCollatorWithFlattening` makes them; default 0..N-1), `attention_mask (B, N)`
            (padding: 0 = pad). N must split over the ranks (2·cp chunks for zigzag, cp contiguous).
        group, layout: the cp group and layout; None: `current_context()`'s (default group, zigzag).
        scheme: `"ring"` or `"allgather"`, which the model's layers then run (its masks are built for
            it); None: `current_context()`'s (the ring).
        config: the model's config, so every layer's sliding window gets its mask up front.
        device: where the shard goes (default: input_ids' device).
        check_ranks: first compare the batch across the group (one small all-gather of its shape
            and a digest of each field, ringflash/agree.py), so that a rank with another batch,
            or one that refuses its own, fails every rank at once.
    Raises ValueError (on every rank) if `config`'s model would not run its attention through
    the ring: another `attn_implementation`, or a model type whose layers bypass transformers'
    AttentionInterface (Bloom, MPT, Falcon).
    Returns:
        `input_ids`, `position_ids` (global), `labels` and `shift_labels` (the same shifted labels),
        each `(B, N/cp)`; `num_items_in_batch` (labelled tokens of the whole batch, a 0-dim
        tensor), `ring_masks` (`RingMasks`: documents and padding as document boundaries, one
        mask per window) and `use_cache=False`.
    """
    base = current_context()
    context = replace(base, group=base.group if group is None else group, layout=layout or base.layout,
                      scheme=scheme or base.scheme)  # fmt: skip
    rank, world = context.rank_world()
    try:
        ids, B, N = _check_batch(batch)
        try:
            check_splittable(N, world, context.layout)
        except ValueError as e:
            raise ValueError(f"batch['input_ids'] has {N} tokens per row: {e}") from None
        if config is not None:
            check_model(config)
        error = None
    except (TypeError, ValueError) as e:
        error = e
    checker = agree.check_comm(context.group) if check_ranks else None
    if checker is not None and checker.world > 1:  # the digests cost a pass over the batch: only with peers
        fields = {key: batch.get(key) for key in agree.BATCH_FIELDS} if error is None else None
        mine = agree.row(error is None, "shard_batch", world, layout=context.layout, scheme=context.scheme,
                         batch=fields)  # fmt: skip
        try:
            agree.check(checker, mine)
        except ValueError as e:
            error = error or e
    if error is not None:
        raise error
    device = torch.device(device) if device is not None else ids.device
    pos = batch.get("position_ids")
    pos = torch.arange(N, device=ids.device).expand(B, N) if pos is None else pos.expand(B, N)
    pad = batch.get("attention_mask")
    doc = doc_ids_from_positions(pos.cpu(), None if pad is None else pad.expand(B, N).cpu())
    masks = ring_masks(doc, seqlen=N, context=context, config=config, device=device)

    def mine(t: torch.Tensor) -> torch.Tensor:  # contiguous: HF's loss views the labels flat
        return shard(t, 1, rank, world, context.layout).to(device).contiguous()

    out = {"input_ids": mine(ids), "position_ids": mine(pos)}
    labels = batch.get("labels")
    if labels is not None:
        # Shift on the global sequence: the label of token t is token t+1's, wherever that lives.
        shifted = torch.full_like(labels.expand(B, N), IGNORE_INDEX)
        shifted[:, :-1] = labels.expand(B, N)[:, 1:]
        if pad is not None:
            shifted[pad.expand(B, N) == 0] = IGNORE_INDEX  # a pad query predicts nothing
        out["labels"] = out["shift_labels"] = mine(shifted)
        out["num_items_in_batch"] = (shifted != IGNORE_INDEX).sum().to(device)
    out["ring_masks"] = masks
    out["use_cache"] = False
    return out


# ----------------------------------------------------------------------------- attention


def _refuse_features(module, attention_mask, dropout: float, kwargs: dict) -> None:
    """Raise ValueError naming the config field of what ring attention cannot compute."""
    config = getattr(module, "config", None)
    if getattr(config, "alibi", False) or kwargs.get("position_bias") is not None:
        raise ValueError("config.alibi: ring attention has no ALiBi or other additive position bias")
    if dropout:
        raise ValueError(
            f"config.attention_dropout = {getattr(config, 'attention_dropout', dropout)}: ring attention has no "
            "attention dropout; set it to 0.0 for training"
        )
    varlen = [name for name in _VARLEN_KWARGS if kwargs.get(name) is not None]
    if varlen:  # the layer would attend across the documents they describe
        raise ValueError(
            f"{', '.join(varlen)}: ring attention does not read flash-attention's varlen arguments; give packed "
            "documents as position_ids restarting at 0 to ringflash.hf.shard_batch and call the model with its shard"
        )
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("is_causal = False: the transformers ring attention is causal (decoder) attention only")
    if attention_mask is not None:
        raise ValueError(
            f"attention_mask of shape {tuple(attention_mask.shape)}: ring attention takes no dense mask; give "
            "padding (attention_mask) or packed documents (position_ids) to ringflash.hf.shard_batch and call "
            "the model with the shard it returns"
        )


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The registered attention: query `(B, H, N_local, D)`, key/value `(B, Hkv, N_local, D)` ->
    `(B, N_local, H, D)` in the input dtype, and None (no attention weights)."""
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # (B, N, H, D) views
    masks = kwargs.get("ring_masks")
    ctx = masks.context if isinstance(masks, RingMasks) else current_context()
    try:
        _refuse_features(module, attention_mask, dropout, kwargs)
        if masks is not None and not isinstance(masks, RingMasks):
            raise TypeError(f"ring_masks must be a ringflash.hf.RingMasks (shard_batch's), got {type(masks).__name__}")
        if q.shape[1] != k.shape[1]:
            raise ValueError(
                f"{k.shape[1]} keys for {q.shape[1]} queries: ring attention runs without a KV cache "
                "(training or prefill): call the model with use_cache=False"
            )
        if "sliding_window" in kwargs:  # the model's own per-layer choice, as the built-in kernels get it
            window = kwargs["sliding_window"]
        else:
            window = layer_window(getattr(module, "config", None), getattr(module, "layer_idx", None))
        spec = layer_spec(window)
        mask = masks.for_spec(spec) if masks is not None else None
    except (TypeError, ValueError) as e:
        _announce(ctx, q, k)
        raise e
    # The layer's own score transforms, as it hands them to the built-in kernels: Gemma's softcap
    # (None: none) and gpt-oss's sinks (`s_aux`, in the model's dtype; the ring takes float32).
    sink = kwargs.get("s_aux")
    options = ctx.options(softcap=float(kwargs.get("softcap") or 0.0))
    flash = FlashArgs(window_size=spec.window_size if mask is None else (-1, -1))  # a mask holds its window
    return _run(q, k, v, flash, scaling, True, ctx.group, None, options, mask,
                None if sink is None else sink.float()), None  # fmt: skip


def _announce(ctx: RingContext, q: torch.Tensor, k: torch.Tensor) -> None:
    """This rank refuses the call: tell the other ranks of the ring, who may already wait in the
    ring's cross-rank check (a refusal that only this rank makes, a mask only it was given), so
    that they raise too instead of hanging. Not under torch.compile (see ringflash.api)."""
    if torch.compiler.is_compiling() or ctx.rank_world()[1] == 1:
        return
    from ringflash.ops import announce_rejection
    from ringflash.transport import resolve_transport, ring_comm

    announce_rejection(ring_comm(ctx.group, resolve_transport(ctx.transport)), q, k, True, ctx.layout)


def ring_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> None:
    """The registered mask function: no dense mask (masks come from `shard_batch`). A padding
    `attention_mask` given to the model is refused unless all ones (checked eagerly only)."""
    if attention_mask is None:
        return None
    if not torch.compiler.is_compiling() and bool(attention_mask.all()):
        return None
    raise ValueError(
        "attention_mask: ring attention does not take a padding mask in the model call; give it to "
        "ringflash.hf.shard_batch (padding becomes a document boundary) and call the model with its shard"
    )


AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ring_attention_mask)
