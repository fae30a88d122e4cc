"""bench/kernel_kinds.py: a profile's kernels by kind, the device's idle time, the SDPA backend by name."""

import pytest

from bench.kernel_kinds import breakdown, busy_seconds, kind_of, sdpa_backend


@pytest.mark.parametrize(
    "name, kind",
    [
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT", "matmul"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norm and elementwise"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>",
            "norm and elementwise",
        ),
        ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>  log_softmax", "loss"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("ncclDevKernel_AllGather_RING_LL", "communication"),
        ("Memset (Device)", "other"),
    ],
)
def test_kernels_are_sorted_by_kind(name, kind):
    assert kind_of(name) == kind


def test_the_backend_is_named_by_its_kernels():
    assert sdpa_backend(["cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "gemm"]) == "cuDNN"
    assert sdpa_backend(["pytorch_flash::flash_bwd_dq_dk_dv_loop_kernel"]) == "flash"
    assert sdpa_backend(["fmha_cutlassF_bf16_aligned_64x64_rf_sm80"]) == "memory-efficient"
    assert sdpa_backend(["gemm", "softmax_warp_forward"]).startswith("math")


def test_idle_is_the_step_less_the_union_of_kernels():
    kernels = [("gemm", 0.0, 2.0), ("flash_fwd", 1.0, 3.0), ("triton_add", 5.0, 6.0)]  # two overlap
    assert busy_seconds((s, e) for _, s, e in kernels) == 4.0
    seconds = breakdown(kernels, step_seconds=10.0)
    assert seconds == {"matmul": 2.0, "attention": 2.0, "norm and elementwise": 1.0, "idle": 6.0}
