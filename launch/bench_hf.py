"""A `transformers` causal LM trained through ringflash's attention against transformers' own SDPA.

    python launch/bench_hf.py                                   # ~1.1B Llama shape, 16k and 32k tokens
    python launch/bench_hf.py --seqlens 8192 --layers 2 --impls ring_attention sdpa --no-record
    python launch/bench_hf.py --seqlens 16384 --layers 4 --profile 15   # where each one's GPU time goes

One GPU, random init, bf16 weights with float32 AdamW states, activation checkpointing (HF's,
non-reentrant) for every implementation, batch 1. Each step is forward + backward + optimizer
step on fresh random tokens; the implementations alternate step-for-step blocks so that clock
drift falls on all of them. Reports tokens/s, model TFLOP/s (6·params·tokens for the matmuls plus
the causal attention's FlashAttention-convention FLOPs, 3.5 × 2·N²·H·D per layer; recomputation
not counted) and the peak memory of the steps. Appends a record to benchmarks/hf.jsonl.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ringflash.bench import BENCHMARKS_DIR, record

# "sdpa:flash" / "sdpa:cudnn" pin SDPA's kernel (plain "sdpa" lets torch's dispatcher choose);
# "ring_attention:cudnn" / ":hopper" run the ring on that ringflash kernel backend (plain: the Triton one).
IMPLS = ("ring_attention", "ring_attention:cudnn", "ring_attention:hopper", "sdpa", "sdpa:flash", "sdpa:cudnn",
         "flash_attention_2")


def build(impl: str, args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    import ringflash.hf  # noqa: F401  (registers "ring_attention")

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seqlens),
        rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.set_attn_implementation(impl.split(":")[0])
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def kernel_choice(impl: str):
    """The context an implementation's steps run in: SDPA pinned to one kernel, or the ring on a
    given kernel backend, or nothing."""
    from contextlib import nullcontext

    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ringflash.hf

    name, _, kernel = impl.partition(":")
    if not kernel:
        return nullcontext()
    if name == "ring_attention":
        return ringflash.hf.context_parallel(backend=kernel)
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kernel])


def step_fn(model, n: int, args, impl: str):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        ids = torch.randint(0, args.vocab, (1, n), device="cuda")
        with kernel_choice(impl):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


def flops_per_step(params: int, n: int, args) -> float:
    head_dim = args.hidden // args.heads
    attn = 3.5 * 2.0 * n * n * args.heads * head_dim * args.layers  # causal: half of 4·N²·H·D, fwd + 2.5× bwd
    return 6.0 * params * n + attn


def profile(args) -> None:
    """One step of each implementation under torch.profiler: its GPU time by kernel, the top rows."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for n in args.seqlens:
        for impl in args.impls:
            model = build(impl, args)
            step, opt = step_fn(model, n, args, impl)
            step()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            events = prof.key_averages()
            total = sum(e.self_device_time_total for e in events) / 1e3
            print(f"\n== {impl}, {n} tokens, {args.layers} layers: {total:.1f} ms of GPU time", flush=True)
            print(events.table(sort_by="self_device_time_total", row_limit=args.profile, max_name_column_width=70),
                  flush=True)
            del model, opt, step
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[16384, 32768])
    ap.add_argument("--impls", nargs="+", default=["ring_attention", "sdpa", "sdpa:flash", "sdpa:cudnn"], choices=IMPLS)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per implementation and length")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--record-to", type=str, default=str(BENCHMARKS_DIR))
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="ROWS",
                    help="instead: one profiled step per implementation, its top ROWS kernels by GPU time")
    args = ap.parse_args()
    if args.profile:
        return profile(args)
    rows = []
    for n in args.seqlens:
        times: dict[str, list[float]] = {impl: [] for impl in args.impls}
        peak: dict[str, float] = {}
        params = 0
        for _ in range(args.rounds):
            for impl in args.impls:
                model = build(impl, args)
                params = sum(p.numel() for p in model.parameters())
                step, opt = step_fn(model, n, args, impl)
                step()  # compile, allocate the optimizer states
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step()
                    torch.cuda.synchronize()
                    times[impl].append(time.perf_counter() - t0)
                peak[impl] = max(peak.get(impl, 0.0), torch.cuda.max_memory_allocated() / 2**30)
                del model, opt, step
                torch.cuda.empty_cache()
        for impl in args.impls:
            s = statistics.median(times[impl])
            tflops = flops_per_step(params, n, args) / s / 1e12
            rows.append([impl, n, round(params / 1e9, 3), round(n / s), round(tflops, 1), round(peak[impl], 2),
                         round(s * 1e3, 1)])  # fmt: skip
    record(
        "hf", "transformers Llama (random init) trained through each attention implementation, one GPU",
        ["attn_implementation", "seq_len", "params (B)", "tokens/s", "model TFLOP/s", "peak GiB", "step ms"], rows,
        args=dict(layers=args.layers, hidden=args.hidden, ffn=args.ffn, heads=args.heads, kv_heads=args.kv_heads,
                  vocab=args.vocab, dtype="bf16 weights, fp32 AdamW", activation_checkpointing=True, batch=1,
                  steps=args.steps, rounds=args.rounds),
        peers=[i for i in args.impls if not i.startswith("ring_attention")],
        notes="Median step time over the rounds; implementations alternate per round; peak = the largest "
              "max_memory_allocated of its rounds.",
        directory=None if args.no_record else __import__("pathlib").Path(args.record_to),
    )  # fmt: skip


if __name__ == "__main__":
    main()
