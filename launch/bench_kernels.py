"""Kernel benchmark: ringflash's Triton kernels against torch SDPA (flash, cuDNN) and FlexAttention.

    python launch/bench_kernels.py                      # the full table, appended to benchmarks/kernels.jsonl
    python launch/bench_kernels.py --seqlens 4096 --head-dims 128 --no-flex   # quicker
    python launch/bench_kernels.py --masks              # packed documents and sliding windows
    python launch/bench_kernels.py --features           # what softcap, sinks, MLA head dims and a window cost
    python launch/bench_kernels.py --group 8 --tokens 16384 --seqlens 16384 --head-dims 64   # a 1B Llama's GQA
    python launch/benchmarks_md.py                      # then: BENCHMARKS.md and docs/bench_kernels.png

bf16, B·N = 32k tokens, H·D = 2048, causal and not; `--group G` gives K and V H/G heads (GQA).
FLOPs in FlashAttention's convention (forward 4·B·H·N²·D, halved when causal; backward 2.5×
forward). Each implementation is timed in
its native layout (SDPA and Flex take (B, H, N, D); ours (B, N, H, D)), the backward without the
forward, through `torch.autograd.grad` for the peers. Also measures the device's ceilings in the
same run: a dense bf16 matmul, the rate every attention kernel here is chasing, and a plain
device copy's bandwidth. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ringflash.bench import BENCHMARKS_DIR, attn_flops, markdown_table, record, time_ms
from ringflash.kernels import AttnSpec, backend_named
from ringflash.kernels.hopper_bwd import hopper_bwd_unsupported
from ringflash.kernels.hopper_fwd import hopper_fwd_unsupported


def _ours_steps(backend, spec, q, k, v, do, fallback=True):
    """Our `backend`'s forward and backward under `spec` as closures, on `(B, H, N, D)` inputs, and
    which kernels they run: `hopper` runs the Triton ones where its own do not apply (`fallback`),
    or raises (a row of it, not a second Triton row)."""
    # (B, H, N, D) inputs viewed as (B, N, H, D) with the same storage would be strided; give our
    # kernels their native contiguous layout instead, as SDPA gets its own.
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
    kern, ran = backend_named(backend), _kernels_ran(backend, spec, q, k, v, fallback)
    o, lse = kern.fwd_step(q, k, v, spec, None)
    fwd = lambda: kern.fwd_step(q, k, v, spec, None)
    bwd = lambda: kern.bwd_step(do, q, k, v, o, lse, spec, None)
    return fwd, bwd, ran


def _kernels_ran(backend, spec, q, k, v, fallback=True) -> str:
    """Which kernels `backend` runs forward and backward for `(B, N, H, D)` inputs under `spec`:
    `hopper`'s own, or the Triton ones it hands a call to, with why (raises instead unless `fallback`)."""
    if backend != "hopper":
        return "triton fwd, triton bwd"
    whys = {"fwd": hopper_fwd_unsupported(q, k, v, spec), "bwd": hopper_bwd_unsupported(q, k, v, spec)}
    if whys["bwd"] is not None and not fallback:
        raise RuntimeError(f"hopper backward: {whys['bwd']}")
    return ", ".join(f"hopper {s}" if why is None else f"triton {s} (hopper {why})" for s, why in whys.items())


def _through_op(backend, sink):
    """`ring_flash_attn_func` on one GPU, the path a model calls, with a learnable sink `(H,)` (a
    logit per head, near the rows' lse so that it matters) or without, on `(B, H, N, D)` inputs."""
    from ringflash import ring_flash_attn_func

    def make(q, k, v, do, causal):
        q, k, v, do = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        s = torch.nn.Parameter(torch.randn(q.shape[2], device=q.device) + 3.0) if sink else None
        leaves += [s] if sink else []
        fwd = lambda: ring_flash_attn_func(q, k, v, causal=causal, backend=backend, learnable_sink=s)
        o = fwd()
        bwd = lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)
        return fwd, bwd, f"{_kernels_ran(backend, AttnSpec(causal=causal), q, k, v)}, through ring_flash_attn_func"

    return make


def _ours(backend):
    def make(q, k, v, do, causal):
        return _ours_steps(backend, AttnSpec(causal=causal), q, k, v, do, fallback=False)[:2]

    return make


def _sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend]

    def make(q, k, v, do, causal):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd():
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

        o = fwd()
        bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        return fwd, bwd

    return make


def _flex(q, k, v, do, causal, score_mod=None, mask_mod=None):
    """FlexAttention, compiled: causal, or `mask_mod` as a block mask, and `score_mod` on the scaled scores."""
    import torch._dynamo
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compile per shape: three sequence lengths make 12, more than dynamo's recompile limit
    # (8), past which flex_attention runs uncompiled and fails on the later shapes.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(flex_attention, dynamic=False)
    N = q.shape[2]
    mask_mod = mask_mod or ((lambda b, h, qi, ki: qi >= ki) if causal else None)
    mask = create_block_mask(mask_mod, None, None, N, N, device=q.device) if mask_mod else None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    fwd = lambda: compiled(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    o = fwd()
    bwd = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    return fwd, bwd


def matmul_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / time_ms(lambda: a @ b) * 1e-9


def copy_tbps(nbytes: int = 1 << 30) -> float:
    """Device memory bandwidth of a plain copy, bytes read plus written, TB/s."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / time_ms(lambda: dst.copy_(src)) * 1e-9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--tokens", type=int, default=32768, help="B·N")
    ap.add_argument("--hidden", type=int, default=2048, help="H·D")
    ap.add_argument("--group", type=int, default=1, help="query heads per K/V head (GQA; 1: MHA)")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (it compiles for ~1 min)")
    ap.add_argument("--record-to", type=Path, default=BENCHMARKS_DIR, help="directory of the JSON-lines records")
    ap.add_argument("--no-record", action="store_true", help="print only")
    ap.add_argument("--masks", action="store_true",
                    help="instead: packed documents and sliding windows against dense causal (ours only)")
    ap.add_argument("--features", action="store_true",
                    help="instead: each feature's cost (softcap, sinks, MLA head dims, two-sided window) against "
                         "plain causal and SDPA/Flex, at N = the last of --seqlens, D = the last of --head-dims")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py times CUDA kernels: it needs a CUDA GPU")
    record_to = None if args.no_record else args.record_to
    if args.masks:
        return masks(args.seqlens[-1], args.head_dims[-1], args.hidden, args.group, not args.no_flex, record_to)
    if args.features:
        return features(args.seqlens[-1], args.head_dims[-1], args.tokens, args.hidden, args.group, record_to)

    impls = {"ringflash": _ours("triton"), "ringflash-hopper": _ours("hopper"), "sdpa-flash": _sdpa("flash"),
             "sdpa-cudnn": _sdpa("cudnn")}
    if not args.no_flex:
        impls["flex"] = _flex
    rows = []
    for D in args.head_dims:
        for N in args.seqlens:
            for causal in (True, False):
                B, H = args.tokens // N, args.hidden // D
                if H % args.group:
                    raise SystemExit(f"--group {args.group} must divide the {H} heads of D = {D}")
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(B, H // args.group if i in (1, 2) else H, N, D, device="cuda",
                                           dtype=torch.bfloat16, generator=g) for i in range(4))
                f_fwd, f_bwd = (attn_flops(B, H, N, N, D, causal, m) for m in ("fwd", "bwd"))
                measured = {}
                for name, make in impls.items():
                    try:
                        fwd, bwd = make(q, k, v, do, causal)
                        t_f, t_b = time_ms(fwd), time_ms(bwd)
                    except Exception as e:  # a peer that does not support this shape or device
                        print(f"{name} D={D} N={N} causal={causal}: n/a ({type(e).__name__}: {e})")
                        continue
                    measured[name] = (f_fwd / t_f * 1e-9, f_bwd / t_b * 1e-9, (f_fwd + f_bwd) / (t_f + t_b) * 1e-9)
                    torch.cuda.empty_cache()
                base = measured.get("sdpa-flash", (float("nan"),) * 3)[2]
                for name, (tf, tb, tfb) in measured.items():
                    rows.append((name, D, N, B, f"{H}/{H // args.group}" if args.group > 1 else H,
                                 "yes" if causal else "no", tf, tb, tfb, tfb / base))
                print(markdown_table(["impl", "D", "N", "B", "H", "causal", "fwd", "bwd", "fwd+bwd", "vs flash"],
                                     rows[-len(measured):]), flush=True)
    headers = ["impl", "D", "N", "B", "H", "causal", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s",
               "fwd+bwd ÷ sdpa-flash"]
    # GQA runs get their own title: the plot draws the newest MHA table (benchmarks_md.plot_kernels).
    kind = f"GQA ({args.group} query heads per K/V head) attention" if args.group > 1 else "attention"
    record("kernels", f"Kernels: bf16 {kind}, B·N = {args.tokens}, H·D = {args.hidden}", headers, rows,
           args=dict(dtype="bf16", tokens=args.tokens, hidden=args.hidden, head_dims=args.head_dims,
                     seqlens=args.seqlens, **({"group": args.group} if args.group > 1 else {})),
           peers=list(dict.fromkeys(row[0] for row in rows if row[0] != "ringflash")),  # those that ran
           ceilings={"matmul_tflops": matmul_tflops(), "copy_tbps": copy_tbps()}, directory=record_to)


def masks(N: int, D: int, hidden: int, group: int, flex: bool, record_to: Path | None) -> None:
    """One packed sequence of N tokens, bf16, H = hidden/D (K/V H/group heads): dense causal, packed
    documents (uniform and mixed lengths, causal and not) and sliding windows (causal and two-sided),
    each through our Triton and Hopper backends (which kernels ran is named), beside what a user
    could run instead in the same process: the uniform documents as a batch (Hopper, cuDNN through
    SDPA) and FlexAttention with the mask as a block mask. TFLOP/s count only the (query, key)
    pairs the mask keeps, so a kernel that skips the hidden blocks keeps its dense rate. `varlen`
    rows time `attn_varlen_fwd` / `attn_varlen_bwd` as a user calls them, with cu_seqlens (the intervals
    built from it on the first call and kept for that tensor)."""

    H = hidden // D
    if H % group:
        raise SystemExit(f"--group {group} must divide the {H} heads of D = {D}")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H // group if i in (1, 2) else H, N, D, device="cuda", dtype=torch.bfloat16,
                               generator=g) for i in range(4))  # the peers' layout (B, H, N, D)
    mixed = torch.randint(1024, 8193, (N // 1024,), generator=torch.Generator().manual_seed(0))
    mixed = torch.cat([torch.zeros(1, dtype=torch.long), mixed.cumsum(0)])
    mixed = torch.cat([mixed[mixed < N], torch.tensor([N])])
    cases = {"dense causal": (AttnSpec(causal=True), None, None, True)}
    for causal in (True, False):
        for L in (2048, 8192):
            cu = torch.arange(0, N + 1, L, device="cuda", dtype=torch.int32)
            cases[f"documents of {L}{'' if causal else ', not causal'}"] = (
                AttnSpec.documents(cu, N, causal=causal), cu, L, causal)
    cases["documents of 1k-8k"] = (AttnSpec.documents(mixed.to("cuda", torch.int32), N, causal=True),
                                   mixed.to("cuda", torch.int32), None, True)
    for w in (1024, 4096):
        cases[f"window {w}"] = (AttnSpec(causal=True, window=w), None, None, True)
    cases["window ±1024, not causal"] = (AttnSpec(window=(1024, 1024)), None, None, False)
    headers = ["impl", "mask", "fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd ms", "kernels that ran"]
    rows = []
    for name, (spec, cu, L, causal) in cases.items():
        vis = spec.intervals_for(q.transpose(1, 2), k.transpose(1, 2))
        pairs = N * (N + 1) / 2 if vis is None else (vis.kv_hi - vis.kv_lo).double().sum().item()
        flops = 4.0 * pairs * H * D
        impls = {"ringflash": lambda spec=spec: _ours_steps("triton", spec, q, k, v, do),
                 "ringflash-hopper": lambda spec=spec: _ours_steps("hopper", spec, q, k, v, do)}
        if cu is not None:
            impls["ringflash-hopper varlen"] = lambda cu=cu, c=causal: _varlen(q, k, v, do, cu, c)
        if L is not None:  # the same documents as a batch of L-token sequences
            batch = [t.reshape(t.shape[1], N // L, L, D).transpose(0, 1).contiguous() for t in (q, k, v, do)]
            impls["ringflash-hopper batch"] = lambda b=batch, c=causal: _ours_steps("hopper", AttnSpec(causal=c), *b)
            impls["sdpa-cudnn batch"] = lambda b=batch, c=causal: (*_sdpa("cudnn")(*b, c), "sdpa cudnn")
        if flex:
            impls["flex"] = lambda vis=vis: (*_flex(q, k, v, do, True, mask_mod=_mask_mod(vis)), "flex (compiled)")
        for impl, make in impls.items():
            try:
                fwd, bwd, ran = make()
                t_f, t_b = time_ms(fwd), time_ms(bwd)
                rows.append((impl, name, flops / t_f * 1e-9, 2.5 * flops / t_b * 1e-9, t_f + t_b, ran))
            except Exception as e:  # a peer that does not support this mask, or runs out of memory
                msg = str(e).splitlines()[0][:160] if str(e) else ""
                rows.append((impl, name, None, None, None, f"n/a ({type(e).__name__}: {msg})"))
            torch.cuda.empty_cache()
        print(markdown_table(headers, rows[-len(impls):]), flush=True)
    kv = f"/{H // group}" if group > 1 else ""
    record("kernels", f"Kernels: masks on one packed sequence, bf16, N = {N}, H = {H}{kv}, D = {D}", headers, rows,
           args=dict(dtype="bf16", masks=True, N=N, H=H, Hkv=H // group, D=D),
           peers=list(dict.fromkeys(r[0] for r in rows if r[0] in ("sdpa-cudnn batch", "flex") and r[2] is not None)),
           notes="TFLOP/s over the (query, key) pairs the mask keeps; blocks it hides are skipped. Batch rows: "
           "the same uniform documents as a batch of sequences (causal where the documents are). varlen: "
           "attn_varlen_fwd/bwd with cu_seqlens (intervals built on the first call, kept per cu_seqlens tensor).",
           directory=record_to)


def _varlen(q, k, v, do, cu, causal):
    """attn_varlen_fwd / attn_varlen_bwd on packed `(total, H, D)` views, as a user calls them."""
    from ringflash.kernels import attn_varlen_bwd, attn_varlen_fwd

    q, k, v, do = (t[0].transpose(0, 1).contiguous() for t in (q, k, v, do))
    spec = AttnSpec.documents(cu, q.shape[0], causal=causal)
    ran = _kernels_ran("hopper", spec, q[None], k[None], v[None]) + " (varlen entry)"
    o, lse = attn_varlen_fwd(q, k, v, cu, causal=causal, backend="hopper")
    fwd = lambda: attn_varlen_fwd(q, k, v, cu, causal=causal, backend="hopper")
    bwd = lambda: attn_varlen_bwd(do, q, k, v, o, lse, cu, causal=causal, backend="hopper")
    return fwd, bwd, ran


def _mask_mod(vis):
    """FlexAttention's mask_mod for one sequence's key intervals (kernels/masks.py)."""
    lo, hi = vis.kv_lo[0], vis.kv_hi[0]
    return lambda b, h, qi, ki: (ki >= lo[qi]) & (ki < hi[qi])


SOFTCAP = 50.0  # Gemma 2's attention-logit cap (30 is its final-logit one); the kernels' speed does not depend on it
WINDOW = 1024  # the two-sided window: keys i - 1024 ... i + 1024


def _first_sdpa(*names):
    """The first of SDPA's backends `names` that runs the case (forward and backward), tried in order."""

    def make(q, k, v, do, causal):
        whys = []
        for name in names:
            try:
                fwd, bwd = _sdpa(name)(q, k, v, do, causal)
                bwd()
                return fwd, bwd, f"sdpa {name}" + (f" ({'; '.join(whys)})" if whys else "")
            except RuntimeError as e:
                whys.append(f"{name}: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__}")
        raise RuntimeError("; ".join(whys))

    return make


def features(N: int, D: int, tokens: int, hidden: int, group: int, record_to: Path | None) -> None:
    """The speed cost of each feature at one shape, bf16, B = tokens/N, H = hidden/D: plain
    causal, logit softcapping, learnable sinks (beside plain causal through the same functional op),
    DeepSeek's MLA head dims (q/k 1.5·D, v D: 192 and 128 at D = 128) and a
    two-sided window, each by our Triton and Hopper backends (which kernels ran: Hopper's fall back to
    Triton's where they do not apply), SDPA (cuDNN; n/a where it has no such feature) and FlexAttention."""
    B, H, w, c = tokens // N, hidden // D, WINDOW, SOFTCAP
    if H % group:
        raise SystemExit(f"--group {group} must divide the {H} heads of D = {D}")
    g = torch.Generator(device="cuda").manual_seed(0)

    def inputs(dqk, dv):  # q, k, v, do in the peers' layout (B, H, N, D); K and V H/group heads
        shapes = ((H, dqk), (H // group, dqk), (H // group, dv), (H, dv))
        return [torch.randn(B, h, N, d, device="cuda", dtype=torch.bfloat16, generator=g) for h, d in shapes]

    def flex(**mods):
        return lambda q, k, v, do, causal: (*_flex(q, k, v, do, causal, **mods), "flex (compiled)")

    causal_pairs, window_pairs = N * N / 2, N * (2 * w + 1) - w * (w + 1)
    no_sdpa = "n/a: SDPA has no {}"
    two_sided = lambda b, h, qi, ki: (qi - ki <= w) & (ki - qi <= w)
    cases = [  # feature, spec, (q/k head dim, v head dim), (query, key) pairs counted, SDPA, Flex
        ("plain causal", AttnSpec(causal=True), (D, D), causal_pairs, _first_sdpa("cudnn"), flex()),
        (
            f"softcap {c:g}",
            AttnSpec(causal=True, softcap=c),
            (D, D),
            causal_pairs,
            no_sdpa.format("softcap"),
            flex(score_mod=lambda s, b, h, qi, ki: c * torch.tanh(s / c)),
        ),
        ("plain causal, through the op", AttnSpec(causal=True), (D, D), causal_pairs, "n/a: the row above",
         "n/a: the row above"),
        ("learnable sinks, through the op", AttnSpec(causal=True), (D, D), causal_pairs,
         "n/a: SDPA has no learnable sink", "n/a: a sink is no score_mod"),
        (
            f"MLA q/k {D * 3 // 2}, v {D}, causal",
            AttnSpec(causal=True),
            (D * 3 // 2, D),
            causal_pairs,
            _first_sdpa("cudnn", "flash", "efficient"),
            flex(),
        ),
        (
            f"window ±{w}, not causal",
            AttnSpec(window=(w, w)),
            (D, D),
            window_pairs,
            no_sdpa.format("window (its fused kernels)"),
            flex(mask_mod=two_sided),
        ),
    ]
    headers = ["impl", "feature", "fwd TFLOP/s", "bwd TFLOP/s", "fwd ms", "bwd ms", "kernels that ran"]
    rows = []
    for feature, spec, (dqk, dv), pairs, sdpa, flex_make in cases:
        q, k, v, do = inputs(dqk, dv)
        f_fwd = 2.0 * B * H * pairs * (dqk + dv)  # = attn_flops(B, H, N, N, D, causal) where dqk = dv = D
        impls = {
            "ringflash": lambda q, k, v, do, causal, spec=spec: _ours_steps("triton", spec, q, k, v, do),
            "ringflash-hopper": lambda q, k, v, do, causal, spec=spec: _ours_steps("hopper", spec, q, k, v, do),
            "sdpa": sdpa,
            "flex": flex_make,
        }
        if feature.endswith("through the op"):  # the functional op, as a model calls it: a sink joins there
            sink = feature.startswith("learnable sinks")
            impls["ringflash"], impls["ringflash-hopper"] = _through_op("triton", sink), _through_op("hopper", sink)
        for name, make in impls.items():
            if isinstance(make, str):
                rows.append((name, feature, None, None, None, None, make))
                continue
            try:
                fwd, bwd, ran = make(q, k, v, do, spec.causal)
                t_f, t_b = time_ms(fwd), time_ms(bwd)
                rows.append((name, feature, f_fwd / t_f * 1e-9, 2.5 * f_fwd / t_b * 1e-9, t_f, t_b, ran))
            except Exception as e:  # a peer that does not support this feature, or runs out of memory
                msg = str(e).splitlines()[0][:160] if str(e) else ""
                rows.append((name, feature, None, None, None, None, f"n/a ({type(e).__name__}: {msg})"))
            torch.cuda.empty_cache()
        print(markdown_table(headers, rows[-len(impls) :]), flush=True)
    kv = f"/{H // group}" if group > 1 else ""
    record(
        "kernels",
        f"Kernels: the cost of each feature, bf16, B = {B}, N = {N}, H = {H}{kv}, D = {D}",
        headers,
        rows,
        args=dict(dtype="bf16", features=True, B=B, N=N, H=H, Hkv=H // group, D=D, softcap=c, window=w),
        peers=list(dict.fromkeys(r[0] for r in rows if r[0] in ("sdpa", "flex") and r[2] is not None)),
        notes=f"FLOPs in FlashAttention's convention: forward 2·B·H·pairs·(Dqk + Dv), pairs N²/2 when causal "
        f"(halved, as for 4·B·H·N²·D where Dqk = Dv = D), the (query, key) pairs kept for the window; "
        f"backward 2.5× forward. Softcap c = {c:g} (Gemma 2's attention logits): scores s -> c·tanh(s/c), "
        f"Flex through score_mod. Sinks: a logit per head, through ring_flash_attn_func beside plain causal "
        f"through it. MLA: DeepSeek's training shape, q/k {D * 3 // 2}, v {D}, H·Dv = {hidden}. "
        f"Window: keys i - {w} ... i + {w}, Flex through a block mask. ms: median of one call.",
        directory=record_to,
    )


if __name__ == "__main__":
    main()
