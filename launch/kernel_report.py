"""What ptxas makes of each Triton kernel for an H100 (sm_90), on any machine: no GPU needed.

    python launch/kernel_report.py
    python launch/kernel_report.py --kernels dkdv --head-dims 128 --causal 1 --tiles 128,64,8,3 128,64,8,2
    python launch/kernel_report.py --kernels fwd dkdv dq --head-dims 192 --dv 128   # DeepSeek's MLA
    python launch/kernel_report.py --kernels hopper_fwd hopper_fwd_step hopper_bwd --ranges   # documents, windows

Triton compiles for a named target without a device, with the ptxas its wheel bundles. Each kernel
is built as an H100 runs it (tensor-descriptor loads where the head dims allow them, bf16 inputs,
dense mask) at its tuned tile
or the `--tiles` given, and ptxas reports registers per thread, bytes spilled to local memory, and
whether it serialised the asynchronous matrix multiplies (warning C7514: an instruction touches a
wgmma's accumulator while it is in flight). A kernel that spills or serialises is slow before it
is ever timed, so a change to a kernel's body or tile can be checked here first and the scarce GPU
time kept for what passes (a first filter, not a verdict: some spill-free variants lost too). The figures are the
installed Triton's; the GPU image runs Triton 3.6, and other versions allocate differently.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from triton.experimental.gluon import language as gl

from ringflash.kernels import hopper_bwd, hopper_fwd, interpreting, triton_bwd, triton_fwd
from ringflash.kernels.hopper import smem_layout
from ringflash.kernels.launch_utils import block_d
from ringflash.kernels.tuning import KERNELS, Tile, pairs_dkdv, tile_config, tile_for

JIT_FNS = {"fwd": triton_fwd._attn_fwd_kernel, "dkdv": triton_bwd._bwd_dkdv, "dq": triton_bwd._bwd_dq}
DESCRIPTORS = ("Q", "K", "V", "DO")  # loaded through tensor descriptors on Hopper
SM90 = GPUTarget("cuda", 90, 32)


def constexprs(kernel: str, head_dim: int, causal: bool, group: int, tile: Tile, softcap: bool = False,
               dv: int | None = None) -> dict:
    """The compile-time arguments the launchers in kernels/ pass, for the dense bf16 case (with a
    logit softcap if asked; v's head dim `dv`, default `head_dim`). Descriptor loads where both
    head dims are their own blocks, as `launch_utils.tma_ok` allows."""
    dv = dv or head_dim
    bd, bdv = block_d(head_dim), block_d(dv)
    consts = dict(HEAD_DIM=head_dim, HEAD_DIM_V=dv, GROUP=group, CAUSAL=causal, RANGES=False, UPCAST=False,
                  PRECISION="tf32", TMA=bd == head_dim and bdv == dv, BLOCK_D=bd, BLOCK_DV=bdv, MERGE=False,
                  ACCUMULATE=False, SOFTCAP=softcap, PAIRED=pairs_dkdv(causal, group, max(bd, bdv)),
                  **tile_config(kernel, tile).kwargs)
    fn = JIT_FNS[kernel]
    wanted = {fn.arg_names[i] for i in fn.constexprs}
    missing = wanted - consts.keys()
    if missing:
        raise RuntimeError(f"kernel_report does not know the {kernel} kernel's constexprs {sorted(missing)}")
    return {k: v for k, v in consts.items() if k in wanted}


def signature(kernel: str, consts: dict) -> tuple[dict, dict]:
    """Argument types by the kernels' naming, and the divisibility a 16k launch would specialise on."""
    fn = JIT_FNS[kernel]
    q_rows, kv_rows = (consts["BLOCK_M"], consts["BLOCK_N"])
    rows = {"Q": q_rows, "DO": q_rows, "K": kv_rows, "V": kv_rows}
    dims = {"Q": consts["HEAD_DIM"], "K": consts["HEAD_DIM"], "V": consts["HEAD_DIM_V"], "DO": consts["HEAD_DIM_V"]}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        if name in DESCRIPTORS and consts["TMA"]:
            sig[name] = f"tensordesc<bf16[1,{rows[name]},{dims[name]}]>"
            continue
        if name in ("LSE", "Delta", "OA"):
            sig[name] = "*fp32"
        elif name in ("KV_LO", "KV_HI", "Q_LO", "Q_HI"):
            sig[name] = "*i32"
        elif name in ("qk_scale", "softmax_scale", "cap"):
            sig[name] = "fp32"
        elif name.startswith("stride") or name in ("H", "Hkv", "Nq", "Nk", "n_sms"):
            sig[name] = "i32"
        else:  # outputs and the tensors they are added to
            sig[name] = "*bf16"
        if name != "n_sms" and sig[name] != "fp32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def ptxas_info(compiled) -> dict:
    """What ptxas says of a kernel Triton compiled for sm_90 (`triton.compile(..., target=SM90)`):
    registers a thread, bytes spilled, shared memory, and whether it serialised the wgmmas."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "kernel.ptx")
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", str(ptx), "-o", str(ptx) + ".o"],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return dict(registers=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                shared_kb=compiled.metadata.shared / 1024, serialised="C7514" in log)


def ptxas_report(kernel: str, head_dim: int, causal: bool, group: int, tile: Tile, softcap: bool = False,
                 dv: int | None = None) -> dict:
    consts = constexprs(kernel, head_dim, causal, group, tile, softcap, dv)
    sig, attrs = signature(kernel, consts)
    compiled = triton.compile(ASTSource(JIT_FNS[kernel], sig, consts, attrs), target=SM90,
                              options={"num_warps": tile[2], "num_stages": tile[3]})
    return ptxas_info(compiled)


def hopper_report(kernel: str, head_dim: int, causal: bool, ranges: bool = False, softcap: bool = False) -> dict:
    """`ptxas_report` for a Gluon kernel (kernels/hopper_fwd.py, kernels/hopper_bwd.py): one tile
    each, so none to choose; GQA's group is a runtime argument there. `hopper_fwd_step` is the
    forward as a ring's later steps compile it: merged into a float32 accumulator, pointer stores.
    `ranges`: the per-row key intervals' variant (documents, windows, the all-gather); `softcap`:
    the logit-softcapping variant."""
    from triton.experimental.gluon._runtime import GluonASTSource  # Gluon's ASTSource: no public name yet

    def desc(dtype: str, block: list[int], swizzle: int | None = None) -> str:
        gdt = {"bf16": gl.bfloat16, "fp32": gl.float32}[dtype]
        return f"tensordesc<{dtype}[{','.join(map(str, block))}],{smem_layout(block, gdt, swizzle)!r}>"

    if kernel in ("hopper_fwd", "hopper_fwd_step"):
        step = kernel == "hopper_fwd_step"
        fn, num_warps = hopper_fwd._hopper_fwd, 4
        q_block, kv_block = [1, hopper_fwd.WG_ROWS, head_dim], [1, hopper_fwd.BLOCK_N, head_dim]
        wgs, regs, overlap = hopper_fwd.WARPGROUPS[head_dim]
        consts = dict(CAUSAL=causal and not ranges, RANGES=ranges, SOFTCAP=softcap, TMA_OUT=not step, MERGE=step,
                      WGS=wgs, WG_ROWS=hopper_fwd.WG_ROWS, BLOCK_N=hopper_fwd.BLOCK_N, D=head_dim,
                      STAGES=hopper_fwd.STAGES, CONSUMER_REGS=regs, OVERLAP=overlap,
                      ROWS_P2=triton.next_power_of_2(wgs * hopper_fwd.WG_ROWS), num_warps=num_warps)
        sig = dict(q_desc=desc("bf16", q_block), k_desc=desc("bf16", kv_block), v_desc=desc("bf16", kv_block),
                   o_desc=desc("bf16", q_block), O="*fp32" if step else "*bf16", OA="*fp32", LSE="*fp32")
    else:
        hb = hopper_bwd
        fn, num_warps = hb._hopper_bwd, hb.NUM_WARPS
        block_m = hb.BLOCK_M[head_dim, softcap]
        q_block, kv_block = [1, block_m, head_dim], [1, hb.BLOCK_N, head_dim]
        consts = dict(CAUSAL=causal and not ranges, RANGES=ranges, SOFTCAP=softcap, ACCUMULATE=False, BLOCK_M=block_m,
                      BLOCK_N=hb.BLOCK_N, D=head_dim, STAGES=hb.STAGES, num_warps=num_warps)
        sig = dict(q_desc=desc("bf16", q_block), do_desc=desc("bf16", q_block), k_desc=desc("bf16", kv_block),
                   v_desc=desc("bf16", kv_block), dq_desc=desc("fp32", q_block, hb.DQ_SWIZZLE[head_dim]),
                   lse_desc=desc("fp32", [1, block_m]), delta_desc=desc("fp32", [1, block_m]), DK="*bf16",
                   DV="*bf16", DKA="*bf16", DVA="*bf16")
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("KV_LO", "KV_HI", "Q_LO", "Q_HI"):
            sig[name] = "*i32"
        elif name not in sig:
            sig[name] = "fp32" if name in ("qk_scale", "cap", "softmax_scale") else "i32"
    compiled = triton.compile(GluonASTSource(fn, sig, consts), target=SM90, options={"num_warps": num_warps})
    return ptxas_info(compiled)


def parse_tile(text: str) -> Tile:
    try:
        tile = tuple(int(x) for x in text.split(","))
    except ValueError:
        tile = ()
    if len(tile) != 4:
        raise argparse.ArgumentTypeError(f"--tiles: expected outer,inner,warps,stages (e.g. 128,64,8,3), got {text!r}")
    return tile


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    hopper = ("hopper_fwd", "hopper_fwd_step", "hopper_bwd")  # Gluon: their own tiles
    ap.add_argument("--kernels", nargs="+", choices=(*KERNELS, *hopper), default=[*KERNELS, *hopper])
    ap.add_argument("--head-dims", type=int, nargs="+", choices=(32, 64, 96, 128, 192, 256), default=[64, 128])
    ap.add_argument("--dv", type=int, choices=(32, 64, 96, 128, 192, 256), default=None,
                    help="v's head dim for the Triton kernels (default: each head dim's own)")
    ap.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=[1, 0])
    ap.add_argument("--group", type=int, default=1, help="query heads per K/V head (GQA)")
    ap.add_argument("--queries", type=int, default=16384, help="query rows, for the GQA tile rule")
    ap.add_argument("--tiles", type=parse_tile, nargs="+", default=None, help="instead of the tuned tiles")
    ap.add_argument("--softcap", action="store_true", help="the kernels' logit-softcapping variant")
    ap.add_argument("--ranges", action="store_true",
                    help="the Gluon kernels' per-row key intervals variant (documents, windows, the all-gather)")
    args = ap.parse_args(argv)
    if interpreting():
        ap.error("TRITON_INTERPRET=1 turns the kernels into interpreted functions: unset it to compile them")

    if args.ranges and any(k not in hopper for k in args.kernels):
        ap.error("--ranges: the Gluon kernels' variant; name --kernels among " + ", ".join(hopper))
    if args.dv and any(k in hopper for k in args.kernels):
        ap.error("--dv: the Gluon kernels run one head dim (the hopper backend hands the rest to Triton)")
    cap = ", logit softcap" if args.softcap else ""
    cap += ", per-row key intervals" if args.ranges else ""
    dv = f", v head dim {args.dv}" if args.dv else ""
    print(f"ptxas for sm_90 (Triton {triton.__version__}): dense bf16, descriptor loads where they fit{cap}{dv}\n")
    print("| kernel | D | causal | group | tile | registers | spilled (stores / loads, B) | shared KiB "
          "| wgmma serialised |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kernel in args.kernels:
        for head_dim in args.head_dims:
            for causal in map(bool, args.causal):
                if kernel in ("hopper_fwd", "hopper_fwd_step"):
                    wgs = hopper_fwd.WARPGROUPS[head_dim][0]
                    tiles = [(wgs * hopper_fwd.WG_ROWS, hopper_fwd.BLOCK_N, 4 * wgs + 1, hopper_fwd.STAGES)]
                elif kernel == "hopper_bwd":
                    hb = hopper_bwd
                    tiles = [(hb.BLOCK_N, hb.BLOCK_M[head_dim, args.softcap], hb.NUM_WARPS + 1, hb.STAGES)]
                else:
                    bd = max(block_d(head_dim), block_d(args.dv or head_dim))
                    tiles = args.tiles or [tile_for(kernel, bd, descriptors=True, group=args.group,
                                                    queries=args.queries)]
                for tile in tiles:
                    if kernel in hopper:
                        r = hopper_report(kernel, head_dim, causal, args.ranges, args.softcap)
                    else:
                        r = ptxas_report(kernel, head_dim, causal, args.group, tile, args.softcap, args.dv)
                    print(f"| {kernel} | {head_dim} | {'yes' if causal else 'no'} | {args.group} | {tile} | "
                          f"{r['registers']} | {r['spill_stores']} / {r['spill_loads']} | {r['shared_kb']:.0f} | "
                          f"{'yes (C7514)' if r['serialised'] else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
