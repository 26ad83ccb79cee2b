"""Whether to run forwards under bf16 autocast: `bf16=auto|true|false` of `dllm-rl train` and `dllm-rl sft`.

bf16 autocast pays only where the CPU multiplies bf16 natively. With AVX512 (AVX512-BF16, AMX, or oneDNN's
AVX512 path) bf16 matmuls run 2-6x faster than fp32; on an AVX2-only CPU torch falls back to a bf16 kernel
about 100x slower than fp32 (measured on a 2-core AMD EPYC: 1 GFLOP/s against 87 for a 256x2048x768 matmul).
`auto` therefore turns autocast on where oneDNN reports bf16 support and off elsewhere, so one config is fast
on both kinds of machine. On a GPU, `auto` turns it on where the GPU computes in bf16 (Ampere and later:
`torch.cuda.is_bf16_supported()`). The two precisions give results that differ in the last bits; `true` / `false`
pin one.
"""

from __future__ import annotations

import warnings

import torch

from dllm_rl.errors import require


def native_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively (oneDNN's own check)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_bf16(value: bool | str, device: torch.device | str = "cpu") -> bool:
    """`bf16` as the user gave it (true, false or "auto") -> whether to autocast on `device`."""
    require(isinstance(value, bool) or value == "auto", f"bf16 must be one of true, false or auto, got {value!r}")
    native = torch.cuda.is_bf16_supported() if torch.device(device).type == "cuda" else native_bf16()
    if value is True and not native:  # a run pinned to bf16 on purpose still runs, only slower
        warnings.warn(f"bf16=true on a {torch.device(device).type.upper()} without native bf16: autocast runs an "
                      f"emulated kernel, on a CPU about 100x slower than fp32; bf16=auto decides by the hardware")
    return native if value == "auto" else value
