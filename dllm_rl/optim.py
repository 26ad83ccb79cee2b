"""The learning-rate schedule shared by RL training and SFT.

`lr_factor` multiplies the peak learning rate: a linear warmup over the first `warmup` steps (step s gets
(s + 1) / warmup), then either the peak ("constant") or a half-cosine from the peak down to `floor` times the
peak over the remaining steps ("cosine", as in most LLM recipes). RL training uses it through torch's
`LambdaLR` with floor 0; SFT sets each step's rate by hand with floor 0.1.
"""

from __future__ import annotations

import math

from dllm_rl.errors import require

LR_SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, total: int, schedule: str = "constant", warmup: int = 0, floor: float = 0.0) -> float:
    """The learning rate of 0-based `step` of `total`, as a fraction of the peak."""
    require(schedule in LR_SCHEDULES, f"lr_schedule must be {' or '.join(map(repr, LR_SCHEDULES))}, got {schedule!r}")
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
