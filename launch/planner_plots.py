"""docs/planner.md's validation table and docs/planner_{8b,70b}.png from ringflash.plan's model.

python launch/planner_plots.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ringflash.plan import Cluster, KernelRates, Model, plan
from ringflash.plan_validation import validation_rows, validation_table

DOCS = Path(__file__).resolve().parent.parent / "docs"
SHAPES = {"8b": ("Llama-3-8B", Model(32, 8, 128, 32)), "70b": ("Llama-3-70B", Model(64, 8, 128, 80))}
GPUS = [8, 16, 32, 64, 128, 256, 512, 1024]
TOKENS = {"128k": 2**17, "512k": 2**19, "1M": 2**20, "4M": 2**22}


def main() -> None:
    rates = KernelRates.from_records()
    for key, (name, m) in SHAPES.items():
        fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(11, 4.2))
        for label, n in TOKENS.items():
            best = [plan(m, n, Cluster(nodes=g // 8), rates=rates)[0] for g in GPUS]
            ax_t.plot(GPUS, [b.time_s * m.layers for b in best], marker="o", label=f"{label} tokens")
            ax_e.plot(GPUS, [b.efficiency for b in best], marker="o", label=f"{label} tokens")
            for g, b in zip(GPUS, best):
                ax_e.annotate(f"{b.u}", (g, b.efficiency), fontsize=7, xytext=(2, 3), textcoords="offset points")
        for ax in (ax_t, ax_e):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs (8 per node)")
            ax.grid(alpha=0.3)
        ax_t.set_yscale("log")
        ax_t.set_ylabel("attention fwd+bwd, all layers (s)")
        ax_e.set_ylabel("efficiency (label: recommended u)")
        ax_e.set_ylim(0, 1.05)
        ax_t.legend()
        fig.suptitle(
            f"{name} (H={m.heads}, Hkv={m.kv_heads}, D={m.head_dim}, {m.layers} layers): best grid, "
            "ringflash.plan defaults (Triton kernel rates; NVLink: NCCL ring hops 155 GB/s, collectives 360; "
            "IB 42 GB/s per GPU)",
            fontsize=9,
        )
        fig.tight_layout()
        fig.savefig(DOCS / f"planner_{key}.png", dpi=110)
        plt.close(fig)
    table = validation_table(validation_rows())
    md = DOCS / "planner.md"
    text = md.read_text()
    start, end = "<!-- validation table: generated -->", "<!-- end of generated table -->"
    md.write_text(text[: text.index(start) + len(start)] + "\n" + table + "\n" + text[text.index(end) :])


if __name__ == "__main__":
    main()
