"""The DeepSpeed config as a plain function of flat arguments (no deepspeed import: it is a dict).

ZeRO stages (Rajbhandari et al., arXiv 1910.02054): 0 = plain data parallel, 1 = optimizer state
partitioned over ranks, 2 = + gradients, 3 = + parameters. Offload (ZeRO-Offload / ZeRO-Infinity) moves the
optimizer state (stage >= 1) or the parameters (stage 3) to CPU memory.

Mixed precision: `bf16=True` is DeepSpeed's bf16 mode (bf16 parameters and gradients, fp32 master weights in
the optimizer), what a GPU run of an 8B model wants. With `bf16=False` parameters stay fp32 and the trainer's
own `torch.autocast` (the top-level `bf16` option of `dllm-rl train`) gives bf16 matmuls, which is the faster
choice on CPU.

Buckets: DeepSpeed's default communication buckets hold 5e8 elements (a 2 GB fp32 gradient bucket at stage 3,
whatever the model's size). Given the model's `hidden_size` h, they are sized as transformers' DeepSpeed
integration does for "auto": reduce bucket h^2, ZeRO-3 prefetch bucket 0.9 h^2, and parameters under 10 h
elements kept whole on every rank at stage 3.

The trainer makes one optimizer step per minibatch, so `gradient_accumulation_steps` is 1 there and
`micro_batch_size` is the rows one rank holds in a minibatch; both are plain arguments for other callers.
"""

from __future__ import annotations

from typing import Any

from dllm_rl.errors import require

STAGES = (0, 1, 2, 3)
OFFLOAD_DEVICES = ("none", "cpu")


def deepspeed_config(*, stage: int = 0, bf16: bool = False, grad_clip: float = 1.0, micro_batch_size: int = 1,
                     gradient_accumulation_steps: int = 1, world_size: int = 1, offload_optimizer: str = "none",
                     offload_params: str = "none", pin_memory: bool = False,
                     hidden_size: int | None = None) -> dict[str, Any]:
    """A DeepSpeed config dict for a client (torch) optimizer; every bad value raises a ConfigError naming it."""
    require(stage in STAGES, f"deepspeed.stage must be one of {STAGES}, got {stage!r}")
    require(micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}")
    require(gradient_accumulation_steps >= 1,
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
    require(world_size >= 1, f"world_size must be >= 1, got {world_size}")
    require(hidden_size is None or hidden_size >= 1, f"hidden_size must be >= 1 or None, got {hidden_size}")
    require(grad_clip >= 0, f"grad_clip must be >= 0 (0 = no clipping), got {grad_clip}")
    for name, value in (("offload_optimizer", offload_optimizer), ("offload_params", offload_params)):
        require(value in OFFLOAD_DEVICES, f"deepspeed.{name} must be one of {OFFLOAD_DEVICES}, got {value!r}")
    require(offload_optimizer == "none" or stage >= 1,
            f"deepspeed.offload_optimizer={offload_optimizer!r} needs stage >= 1 (got stage {stage})")
    require(offload_params == "none" or stage == 3,
            f"deepspeed.offload_params={offload_params!r} needs stage 3 (got stage {stage})")
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update(contiguous_gradients=True, overlap_comm=False)
        if hidden_size is not None:
            zero["reduce_bucket_size"] = hidden_size**2
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        if hidden_size is not None:
            zero.update(stage3_prefetch_bucket_size=int(0.9 * hidden_size**2),
                        stage3_param_persistence_threshold=10 * hidden_size)
    if offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": offload_optimizer, "pin_memory": pin_memory}
    if offload_params != "none":
        zero["offload_param"] = {"device": offload_params, "pin_memory": pin_memory}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "gradient_clipping": grad_clip,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch's AdamW
        "zero_force_ds_cpu_optimizer": False,  # offload may step torch's AdamW on the CPU partitions
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
