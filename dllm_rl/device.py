"""Where tensors live: the policy's device decides, once per stage.

The rule every stage follows: a tensor is made where the model that reads it runs, `device_of(model)`, by
naming that device in the factory call (`torch.zeros(..., device=device)`), or by deriving it from a tensor
that already lives there (`new_zeros`, `zeros_like`, arithmetic). Rollouts, estimator inputs, rewards'
tensors, advantages, loss inputs and external rows all follow from the policy's device this way; so do the
per-row `torch.Generator`s that draw rollout noise (`seeds.row_generators(seeds, device)`), because a
generator can only draw on its own device.

A few tensors are made on the CPU on purpose, each marked `# cpu: <why>` where it is made (tests/
test_device_placement.py reads every factory call in the package and fails on one that names no device and
carries no such mark):
- draws that must be the same on every device: the estimators' masks (N x C booleans from per-row CPU
  generators, moved to the scoring device), the minibatch permutations, the trigger uniforms. A GPU and a CPU
  run then score and train on the same masks and minibatches;
- bookkeeping read back into Python at once (metrics, gradient norms, lists of row indices);
- what is handed to a collective through `all_gather_object` (pickled; see `engine/dist.py`).

The seed contract holds on every device: a draw is a function of (seed, step, row). A CUDA generator draws
other numbers than a CPU generator with the same seed (Philox against Mersenne Twister), so sampled rollouts
at temperature > 0 differ between devices; greedy rollouts (temperature 0) and the estimator masks do not.

One process per GPU: under a launcher the process of LOCAL_RANK k uses cuda:k. `DS_ACCELERATOR=cpu` keeps a
process on the CPU on a machine that has a GPU (DeepSpeed reads the same variable).
"""

from __future__ import annotations

import os

import torch

from dllm_rl.errors import require


def gpu_usable() -> bool:
    """Whether this process should run on a GPU: CUDA is present and DS_ACCELERATOR does not say cpu."""
    return torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"


def default_device(local_rank: int | None = None) -> torch.device:
    """cuda:LOCAL_RANK where a GPU is usable (one process per GPU), else the CPU."""
    if not gpu_usable():
        return torch.device("cpu")
    if local_rank is None:  # some launchers set RANK only (one node)
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0)))
    rank = local_rank
    require(rank < torch.cuda.device_count(), f"LOCAL_RANK={rank}, but this machine has "
            f"{torch.cuda.device_count()} GPU(s): start one process per GPU")
    return torch.device("cuda", rank)


def resolve_device(value: str | torch.device = "auto") -> torch.device:
    """A `device` option as the user gave it: auto (see `default_device`), cpu, cuda or cuda:N."""
    if isinstance(value, torch.device):
        return value
    if value == "auto":
        return default_device()
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        device = None
    require(device is not None and device.type in ("cpu", "cuda"),
            f"device={value!r}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        require(torch.cuda.is_available(), f"device={value!r}, but torch finds no CUDA GPU on this machine "
                f"(torch {torch.__version__}); use device=cpu or device=auto")
        index = 0 if device.index is None else device.index
        require(index < torch.cuda.device_count(),
                f"device={value!r}: this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", index)
    return device


def device_of(model) -> torch.device:
    """Where a model runs: a DeepSpeed engine's or a Hugging Face model's own `device`, else its first
    parameter's (a wrapper such as `AdapterOff` or a `DiffusionPolicy` is looked through)."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "network", None)):
        device = getattr(candidate, "device", None)
        if isinstance(device, torch.device):
            return device
    parameter = next(model.parameters(), None) if hasattr(model, "parameters") else None
    return parameter.device if parameter is not None else torch.device("cpu")


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on `device` (a no-op context when not `enabled`)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)
