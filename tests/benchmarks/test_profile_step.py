"""The profile's timeline summary on a hand-made trace."""

from benchmarks.step.openvla_profile import kind, timeline_report

MS = 1_000_000  # ns


def test_timeline_report_counts_busy_gaps_and_overlap():
    kernels = [  # (stream, start, end, name), two steps
        (7, 0, 10 * MS, "sm90_xmma_gemm_bf16"),
        (7, 12 * MS, 20 * MS, "triton_poi_fused_add_mul_0"),
        (13, 5 * MS, 15 * MS, "ncclDevKernel_ReduceScatter_Sum_f32"),
        (7, 21 * MS, 40 * MS, "multi_tensor_apply_kernel<FusedAdamMathFunctor>"),
    ]
    phases = [("parallax.optimizer", 20 * MS, 40 * MS), ("parallax.schedule", 0, 20 * MS)]
    text = timeline_report(kernels, steps=2, phases=phases)
    assert "timeline: 20.0 ms per step" in text  # 40 ms over 2 steps
    assert "stream 7: busy 18.5 ms (adam 9.5, gemm 5.0, compiled 4.0)" in text
    assert "stream 13: busy 5.0 ms (nccl 5.0)" in text
    # compute idle 3 ms in 40: 1.5 per step; the collective overlaps compute for 8 of its 10 ms
    assert "compute stream 7: idle 1.5 ms per step; other streams busy 5.0 ms, 4.0" in text
    # listed in GPU order; compute idles 2 of 20 ms in the first, 1 of 20 in the second
    assert (
        "phase parallax.schedule: 10.0 ms per step on the GPU timeline, "
        "compute stream busy 9.0, idle 1.0" in text
    )
    assert text.index("parallax.schedule") < text.index("parallax.optimizer")
    assert (
        "phase parallax.optimizer: 10.0 ms per step on the GPU timeline, "
        "compute stream busy 9.5, idle 0.5" in text
    )
    assert "2.00 ms  after sm90_xmma_gemm_bf16  before triton_poi_fused_add_mul_0" in text


def test_kernel_kinds():
    assert kind("ncclDevKernel_AllGather_RING_LL") == "nccl"
    assert kind("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNN") == "gemm"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert kind("void at::native::elementwise_kernel<128, 4>") == "other"
