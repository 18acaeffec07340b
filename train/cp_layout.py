"""What `parallel.cp_heads = auto` and `parallel.cp_scheme = auto` become: the planner's choice for the
run's model and the node rank 0 sees (`choose_cp_layout`), made before the mesh is built
(`train/parallel.py`'s `distributed`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ringflash import plan
from ringflash.kernel_rates import rates_backend
from ringflash.layout import SCHEMES
from ringflash.train.config import AUTO, Config, ConfigError, kernel_backend


def choose_cp_layout(run: Config, gpus_per_node: int, device_name: str) -> tuple[int, str, str]:
    """`parallel.cp_heads` and `parallel.cp_scheme` of `run` with "auto" resolved, and one line
    saying what was chosen and why ("" when neither is auto).

    The planner (`ringflash.plan.choose_layout`) predicts the model's attention (heads, K/V heads,
    head dim, data.batch_size sequences of data.seq_len tokens, causal, dense) on cp GPUs,
    `gpus_per_node` of them a node, over the run's transport and layout, at the rates of the run's
    kernel backend (`hopper`, `cudnn`, and `auto` on an H100/H200: the Hopper kernels'; else the
    Triton kernels') and the links of H100/H200s
    whatever `device_name` says. A transformers model (`model.kind = hf`) runs its attention over
    all of cp (u = 1): with `cp_scheme = "auto"` the planner chooses the scheme for its HF
    config's shape. A pure function of its arguments, so ranks handed the same ones choose alike.
    """
    p, m = run.parallel, run.model
    if AUTO not in (p.cp_heads, p.cp_scheme):
        return p.cp_heads, p.cp_scheme, ""
    u = None if p.cp_heads == AUTO else p.cp_heads
    if p.cp == 1 or (m.kind == "hf" and p.cp_scheme != AUTO):
        u, scheme = u or 1, "ring" if p.cp_scheme == AUTO else p.cp_scheme
        why = "model.kind = hf: no head grid, the scheme cp_scheme gives" if p.cp > 1 else "cp = 1: nothing to split"
    else:
        dtype_bytes = 4 if run.train.dtype == "float32" else 2
        if m.kind == "hf":
            shape, windows, softcap = _hf_attention(m, run.data.batch_size, dtype_bytes)
            u = 1  # its attention crosses all of cp (ringflash.hf): no head grid
        else:
            shape = plan.Model(m.n_heads, m.n_kv_heads, m.dim // m.n_heads, m.n_layers, run.data.batch_size,
                               dtype_bytes=dtype_bytes)  # fmt: skip
            windows, softcap = bool(m.window), 0.0
        # The mask and softcap decide which kernels run on the backend (the rates predicted at).
        kind = "intervals" if run.data.pack_documents else "window" if windows else None
        cluster = plan.cluster_of(p.cp, gpus_per_node)
        schemes = SCHEMES if p.cp_scheme == AUTO else (p.cp_scheme,)
        gpu = "" if any(g in device_name for g in ("H100", "H200")) else f", as H100/H200s (this run: {device_name})"
        name = kernel_backend(p)[0]
        # auto runs the Hopper kernels on H100/H200s, the Triton ones on other GPUs
        backend = rates_backend("triton" if name == "auto" and gpu else name)
        try:
            best, why = plan.choose_layout(shape, run.data.seq_len, cluster, transport=p.transport, layout=p.layout,
                                           schemes=schemes, u=u, backend=backend, kind=kind,
                                           softcap=softcap)  # fmt: skip
        except ValueError as e:
            raise ConfigError(f"parallel.cp_heads = {p.cp_heads}, parallel.cp_scheme = {p.cp_scheme}: {e}") from None
        # r = 1 has no scheme (the prediction says ring): a scheme the config gives stays.
        u, scheme = best.u, best.scheme if p.cp_scheme == AUTO else p.cp_scheme
        window_key = "the HF config's sliding windows" if m.kind == "hf" else "model.window"
        masks = ((window_key, windows), ("data.pack_documents", run.data.pack_documents))
        unmodelled = " and ".join(key for key, on in masks if on)
        nodes = "" if cluster.nodes == 1 else f" on {cluster.nodes} nodes"
        kernels_named = "" if backend == "triton" else f", {backend} kernels"
        heads = f" ({shape.heads}/{shape.kv_heads} heads of {shape.head_dim}, HF config)" if m.kind == "hf" else ""
        why = f"ringflash.plan for {p.cp} GPUs{nodes}{gpu}{kernels_named}{heads}: {why}"
        if unmodelled:
            why += f"; predicted as dense causal attention ({unmodelled} not modelled)"
    chosen = [f"parallel.{key} = auto: {value}" for key, value, asked in
              (("cp_heads", u, p.cp_heads), ("cp_scheme", scheme, p.cp_scheme)) if asked == AUTO]  # fmt: skip
    return u, scheme, f"{', '.join(chosen)} ({why})"


def _hf_attention(m, batch: int, dtype_bytes: int) -> tuple[plan.Model, bool, float]:
    """(the attention shape of a transformers model's config, whether any of its layers has a
    sliding window, its logit softcap or 0)."""
    from ringflash.hf import model_windows
    from ringflash.train.hf_model import head_dim, hf_config

    hf = hf_config(m)
    heads = hf.num_attention_heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    windows = any(w is not None for w in model_windows(hf))
    softcap = float(getattr(hf, "attn_logit_softcapping", None) or 0.0)  # Gemma 2's
    shape = plan.Model(heads, kv_heads, head_dim(hf), hf.num_hidden_layers, batch, dtype_bytes=dtype_bytes)
    return shape, windows, softcap


def node_of_rank_0(device: torch.device) -> tuple[int, str]:
    """(processes per node, device name) as rank 0 sees them, on every rank: what the layout is
    chosen from must not differ between ranks (nodes of different GPUs or process counts)."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0))  # torchrun's; else every GPU of the host
    if device.type == "cuda":
        node = [(per_node or torch.cuda.device_count(), torch.cuda.get_device_name(device))]
    else:
        node = [(per_node or dist.get_world_size(), "cpu")]
    dist.broadcast_object_list(node, src=0)
    return node[0]
