"""logging.profile_step: kernels by category, exposed collectives and phases on synthetic events
(exact numbers), the kernel names read from kernels/, and one real profiled step of the README run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from ringflash.train.runs import runs
from ringflash.train.step_profile import (
    Kernel,
    breakdown,
    category,
    collect,
    length,
    overlap,
    phase_of,
    phase_range,
    ringflash_kernels,
    union,
)
from tests.dist_utils import run_ranks
from tests.train.test_runs import README_RUN, _launch

OURS = ringflash_kernels()


def test_the_launched_kernels_are_read_from_the_kernel_sources():
    # Launched by `fn[grid](...)` or handed to tuning.launch; inlined helpers and warp partitions are not kernels.
    assert {"_attn_fwd_kernel", "_bwd_dkdv", "_bwd_dq", "_bwd_preprocess", "_hopper_fwd", "_hopper_bwd",
                    "_merge_kernel", "_add_kernel"} == OURS  # fmt: skip


def test_a_folder_without_kernels_is_an_error(tmp_path):
    (tmp_path / "plain.py").write_text("def f():\n    return 1\n")
    with pytest.raises(FileNotFoundError, match=f"no launched @triton.jit / @gluon.jit kernel found in {tmp_path}"):
        ringflash_kernels(tmp_path)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("_attn_fwd_kernel", "attention"),
        ("_bwd_dq", "attention"),
        ("_hopper_bwd", "attention"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4> >(Flash_fwd_params)",
         "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "matmul"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "matmul"),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(Params)",
         "matmul"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::tanh_kernel_cuda>", "other"),
        ("triton_poi_fused_mul_silu_0", "other"),
        ("_fwd_inner", "other"),  # inlined into _attn_fwd_kernel: never a kernel of its own
        ("Memcpy DtoD (Device -> Device)", "other"),
    ],
)  # fmt: skip
def test_kernel_categories(name, expected):
    assert category(name, OURS) == expected


def test_interval_union_and_overlap():
    a = [(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (4.0, 4.0)]  # overlapping, unsorted, one empty
    assert union(a) == [(0.0, 3.0), (5.0, 7.0)]
    assert length(a) == 5.0
    b = [(2.5, 6.0), (6.5, 10.0)]
    assert overlap(a, b) == 0.5 + 1.0 + 0.5
    assert overlap(b, a) == overlap(a, b)
    assert overlap(a, []) == 0.0 and length([]) == 0.0


def test_phases_by_launch_time():
    ranges = {"step": [(0.0, 100.0)], "forward": [(1.0, 20.0)], "backward": [(30.0, 80.0)],
              "recompute": [(35.0, 45.0)], "optimizer": [(85.0, 95.0)]}  # fmt: skip
    assert [phase_of(t, ranges) for t in (1.0, 25.0, 30.0, 40.0, 50.0, 90.0, None)] == [
        "forward", "other", "backward", "recompute", "backward", "optimizer", "unlinked"
    ]  # fmt: skip


def test_breakdown_counts_exposed_collectives_busy_and_idle():
    """Device timeline (µs): a GEMM [0, 400), our attention [300, 700), an all-gather [600, 1000)
    that only the attention hides ([600, 700)), a norm [1200, 1300) during a reduce-scatter
    [1100, 1500); the step lasts 2000 µs."""
    kernels = [
        Kernel("sm90_xmma_gemm_bf16", 0.0, 400.0, launch=5.0),
        Kernel("_attn_fwd_kernel", 300.0, 700.0, launch=6.0),
        Kernel("ncclDevKernel_AllGather_RING_LL", 600.0, 1000.0, launch=2.0),
        Kernel("triton_per_fused_rms_norm_1", 1200.0, 1300.0, launch=40.0),  # recomputed in backward
        Kernel("ncclDevKernel_ReduceScatter_Sum_bf16", 1100.0, 1500.0, launch=60.0),
        Kernel("void at::native::fused_adam", 1500.0, 1600.0, launch=None),
    ]
    ranges = {"step": [(0.0, 2000.0)], "forward": [(4.0, 20.0)], "backward": [(30.0, 80.0)],
              "recompute": [(35.0, 45.0)], "optimizer": [(85.0, 95.0)]}  # fmt: skip
    out = breakdown(kernels, ranges, OURS)
    assert out["wall_ms"] == 2.0 and out["kernels"] == 6
    assert out["device_ms"] == {"attention": 0.4, "matmul": 0.4, "collectives": 0.8, "other": 0.2}
    # Busy: [0, 1000) ∪ [1100, 1600) = 1500 µs. Exposed NCCL: [700, 1000) and [1100, 1500) less [1200, 1300).
    assert out["device_busy_ms"] == pytest.approx(1.5) and out["device_idle_ms"] == pytest.approx(0.5)
    assert out["collectives_exposed_ms"] == pytest.approx(0.3 + 0.3)
    assert out["phase_device_ms"] == pytest.approx(
        {"forward": 0.8, "backward": 0.4, "recompute": 0.1, "optimizer": 0.0, "other": 0.4, "unlinked": 0.1}
    )
    assert out["phase_cpu_ms"] == pytest.approx({"forward": 0.016, "backward": 0.04, "recompute": 0.01,
                                                 "optimizer": 0.01})  # fmt: skip
    # Longest first; equal times keep their order on the timeline.
    assert [(k["name"], k["category"], round(k["ms"], 9)) for k in out["top_kernels"]] == [
        ("sm90_xmma_gemm_bf16", "matmul", 0.4), ("_attn_fwd_kernel", "attention", 0.4),
        ("ncclDevKernel_AllGather_RING_LL", "collectives", 0.4),
        ("ncclDevKernel_ReduceScatter_Sum_bf16", "collectives", 0.4),
        ("triton_per_fused_rms_norm_1", "other", 0.1), ("void at::native::fused_adam", "other", 0.1),
    ]  # fmt: skip


def _event(name, device, start, end, id_, linked=0, annotation=False):
    """A raw profiler event (torch's KinetoEvent) as `collect` reads it; times in µs."""
    return SimpleNamespace(name=lambda: name, device_type=lambda: device, start_ns=lambda: int(start * 1e3),
                           end_ns=lambda: int(end * 1e3), correlation_id=lambda: id_,
                           linked_correlation_id=lambda: linked, is_user_annotation=lambda: annotation)  # fmt: skip


def test_collect_links_kernels_to_their_launches_and_reads_the_phase_ranges():
    """A kernel's launch: its runtime call (same correlation id), else the op it is linked to;
    the device-side copies of user ranges are not kernels."""
    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        _event("ringflash.train.step", cpu, 0.0, 100.0, 1),
        _event("ringflash.train.forward", cpu, 2.0, 30.0, 2),
        _event("ringflash.train.forward", cpu, 40.0, 50.0, 3),  # a second micro-batch
        _event("aten::mm", cpu, 5.0, 9.0, 7),
        _event("cudaLaunchKernel", cpu, 6.0, 7.0, 1001, linked=7),
        _event("ringflash::attn_fwd", cpu, 10.0, 20.0, 8),
        _event("sm90_xmma_gemm", cuda, 50.0, 60.0, 1001, linked=7),
        _event("_attn_fwd_kernel", cuda, 60.0, 70.0, 1002, linked=8),  # no runtime event recorded
        _event("ncclDevKernel_AllGather", cuda, 65.0, 90.0, 1003),  # linked to nothing
        _event("ringflash.train.forward", cuda, 50.0, 70.0, 2, annotation=True),
    ]
    kernels, ranges = collect(events)
    assert kernels == [Kernel("sm90_xmma_gemm", 50.0, 60.0, 6.0), Kernel("_attn_fwd_kernel", 60.0, 70.0, 10.0),
                       Kernel("ncclDevKernel_AllGather", 65.0, 90.0, None)]  # fmt: skip
    assert ranges == {"step": [(0.0, 100.0)], "forward": [(2.0, 30.0), (40.0, 50.0)]}


def test_breakdown_needs_the_step():
    with pytest.raises(ValueError, match=r"ranges\['step'\] must hold the step's one interval, got None"):
        breakdown([], {"forward": [(0.0, 1.0)]}, OURS)


def test_a_profiled_step_of_the_readme_run_writes_its_breakdown(tmp_path):
    """configs/tiny_cpu.toml on 2 CPU ranks, 3 steps, step 2 profiled with activation checkpointing:
    no device kernels on CPU, so device time is reported unavailable and the phases' CPU time is given."""
    argv = [*README_RUN, f"--logging.dir={tmp_path}", "--train.steps=3", "--logging.profile_step=2",
            "--train.activation_checkpointing=true", "--checkpoint.enabled=false"]  # fmt: skip
    [[(code, out, err)], [(code1, _, _)]] = run_ranks(_launch, 2, args=(argv,), timeout_s=120)
    assert (code, code1) == (0, 0), err
    [run] = runs(tmp_path)
    report = json.loads((run / "profile_step2.json").read_text())
    assert report["step"] == 2 and report["world"] == 2 and len(report["ranks"]) == 2
    for rank in report["ranks"]:
        assert rank["wall_ms"] > 0 and rank["kernels"] == 0 and rank["device_busy_ms"] is None
        assert rank["device_ms"] == {"attention": None, "matmul": None, "collectives": None, "other": None}
        cpu = rank["phase_cpu_ms"]
        assert set(cpu) == {"forward", "backward", "recompute", "optimizer"}
        assert all(v > 0 for v in cpu.values()), cpu  # recompute: checkpointed blocks re-run in backward
        assert sum(cpu.values()) < rank["wall_ms"]
        assert rank["tflops_per_device"] > 0 and rank["mfu"] is None  # no peak known on CPU
    assert "profile of step 2 (rank 0 of 2): wall " in out, out
    assert "no device kernels recorded: device time unavailable" in out, out
    assert f"  breakdown of every rank: {run / 'profile_step2.json'}" in out, out
    assert not list(run.glob("profile_step1*")) and not list(run.glob("profile_step3*"))


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match=r"phase must be one of \('forward', 'backward', 'recompute', 'optimizer', "
                                         r"'step'\), got 'fwd'"):  # fmt: skip
        phase_range("fwd")
