"""`python -m ringflash.plan`: the planner's table and recommendation for a model and a cluster
(`--help` lists every option; the model is ringflash/plan.py)."""

from __future__ import annotations

import argparse
from dataclasses import fields

import ringflash.plan
from ringflash.plan import Cluster, KernelRates, Model, plan, recommend

__all__ = ["main", "parser"]


def _tokens(s: str) -> int:
    mult = {"k": 1024, "m": 1024**2}.get(s[-1].lower(), 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str:
        # Flags and options without a value say what happens when absent in their help instead.
        return action.help if action.default in (None, False) else super()._get_help_string(action)


_COLUMNS = """columns: scheme across the r ranks (ring or allgather; r = 1 has none), u head-parallel ranks x r
ranks, the ring's transport; layer ms: one attention layer's forward + backward; a2a ms: its
all-to-alls (exposed); exposed ms: layer ms less its kernels' compute, the communication nothing
hides (the all-to-alls included); buffers GiB: what one attention call holds per GPU beyond its inputs and
outputs; model s: layer ms x --layers, the attention of one training step (no MLPs, no optimizer);
efficiency: the unsharded attention's FLOPs / (GPUs x time x the kernel's best rate)."""


def _positive(s: str) -> int:
    n = int(s)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ringflash.plan",
        description=ringflash.plan.__doc__.split("\n")[0] + "\nThe defaults are Llama-3-8B's attention (32 heads, "
        "8 K/V heads, head dim 128, 32 layers) at 1M tokens on one node of 8 H100/H200 GPUs.",
        epilog=_COLUMNS,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--heads", type=_positive, default=32, help="query heads")
    p.add_argument("--kv-heads", type=_positive, default=8, help="K/V heads (GQA; = --heads for MHA)")
    p.add_argument("--head-dim", type=_positive, default=128, help="head dimension")
    p.add_argument("--layers", type=_positive, default=32, help="attention layers (the 'model s' column)")
    p.add_argument("--batch", type=_positive, default=1, help="sequences per step")
    p.add_argument("--seqlen", type=_tokens, default="1M", help="global tokens per sequence, e.g. 131072, 128k, 1M")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous"), help="how the ring cuts a sequence")
    p.add_argument("--non-causal", action="store_true", help="full attention instead of causal")
    p.add_argument("--heads-k-stride", type=_positive, default=1, help="allgather: K/V heads gathered per chunk")
    p.add_argument("--backend", default="triton", choices=("triton", "hopper", "cudnn"),
                   help="the kernel backend the layers run: each layout at the rates of the kernels that run "
                   "its steps (the all-gather's per-row intervals at Triton's where the backend's own "
                   "decline them)")  # fmt: skip
    p.add_argument("--kernels", metavar="PATH", help="a kernels.jsonl to take the --backend's kernel rates from "
                   "(without: those shipped in ringflash/kernel_rates.json)")  # fmt: skip
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument("--gpus", type=_positive, help="all GPUs: --gpus-per-node of them per node "
                      "(fewer: one node of that many); instead of --nodes")  # fmt: skip
    for f in fields(Cluster):
        kind = _positive if f.name in ("gpus_per_node", "nodes") else type(f.default)
        (gpus if f.name == "nodes" else p).add_argument(
            "--" + f.name.replace("_", "-"), type=kind, default=f.default, help=f.metadata["help"]
        )
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    if a.gpus is not None:
        if a.gpus <= a.gpus_per_node:
            a.gpus_per_node, a.nodes = a.gpus, 1
        elif a.gpus % a.gpus_per_node:
            p.error(f"argument --gpus: {a.gpus} GPUs do not fill nodes of --gpus-per-node {a.gpus_per_node}")
        else:
            a.nodes = a.gpus // a.gpus_per_node
    c = Cluster(**{f.name: getattr(a, f.name) for f in fields(Cluster)})
    rates = KernelRates.load(a.kernels, a.backend) if a.kernels else None
    m = Model(a.heads, a.kv_heads, a.head_dim, a.layers, a.batch, not a.non_causal)
    preds = plan(m, a.seqlen, c, a.layout, rates, a.heads_k_stride, a.backend)
    print(f"H={m.heads} Hkv={m.kv_heads} D={m.head_dim} layers={m.layers} B={m.batch} N={a.seqlen} on "
          f"{c.nodes}x{c.gpus_per_node} GPUs ({a.layout}, {'causal' if m.causal else 'non-causal'}, "
          f"{a.backend} kernels)")  # fmt: skip
    print(f"{'row':>3} {'scheme':>10} {'u':>5} {'r':>5} {'transport':>12} {'layer ms':>10} {'a2a ms':>8} "
          f"{'exposed ms':>10} {'buffers GiB':>11} {'model s':>9} {'efficiency':>10}")  # fmt: skip
    for i, q in enumerate(preds, 1):
        print(f"{i:>3} {q.scheme if q.r > 1 else '-':>10} {q.u:>5} {q.r:>5} {q.transport:>12} {q.time_s * 1e3:>10.2f} "
              f"{q.a2a_s * 1e3:>8.2f} {(q.time_s - q.compute_s) * 1e3:>10.2f} {q.memory_bytes / 2**30:>11.2f} "
              f"{q.time_s * m.layers:>9.3f} {q.efficiency:>10.1%}")  # fmt: skip
    if not preds:
        print("no feasible grid (u must divide H and split or replicate the K/V heads)")
        return
    best, why = recommend(preds, c)
    if best is None:
        print(f"no recommendation: {why} (raise --memory-gib, or more GPUs)")
        return
    scheme = best.scheme if best.r > 1 else "ring"
    print(f"recommended: u={best.u} head-parallel x r={best.r}, scheme {scheme}, transport {best.transport} "
          f"(parallel.cp_heads={best.u}, parallel.cp_scheme={scheme}, cp={best.u * best.r})")  # fmt: skip
    print(f"why: {why}")
    print("model s = layer ms x layers: attention only, forward + backward of one step (--help explains each column)")


if __name__ == "__main__":
    main()
