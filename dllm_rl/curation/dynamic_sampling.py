"""DAPO's dynamic sampling (arXiv 2503.14476): keep generating until the step has B groups that teach.

A group whose rewards are all equal has zero advantage. Dynamic sampling drops such groups and draws further
prompts from the stream, round after round, until B groups with differing rewards are kept or the step has
spent `max_extra` rollouts beyond its B * G (a bound DAPO leaves to its `max_num_gen_batches`; here in rollouts,
so it does not depend on the round size). A round asks for as many prompts as groups are missing, times
`oversample` (rounded up). A step also ends after `max_rounds` rounds (with GRESO, a round whose prompts were
all skipped generates nothing, so the rollout bound alone would not end a step whose prompts are all skipped).
When more groups than B are kept, the ones of the latest prompts (highest prompt id) are dropped. What a step
generated, kept and dropped is logged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dllm_rl.errors import require


@dataclass(frozen=True)
class DynamicSamplingConfig:
    max_extra: int = 48  # rollouts a step may generate beyond prompts_per_step * group_size
    oversample: float = 1.0  # prompts a round asks for, per missing group
    max_rounds: int = 16  # rounds of generation a step may take

    def __post_init__(self) -> None:
        require(self.max_rounds >= 1, f"curation.dynamic_sampling.max_rounds={self.max_rounds!r}: expected >= 1")
        require(self.max_extra >= 0, f"curation.dynamic_sampling.max_extra={self.max_extra!r}: expected >= 0")
        require(self.oversample >= 1.0, f"curation.dynamic_sampling.oversample={self.oversample!r}: expected >= 1")


def next_round(kept: int, wanted: int, generated: int, budget: int, per_prompt: int, oversample: float) -> int:
    """How many prompts the next round draws: none once `wanted` groups are kept or the budget (rollouts, the
    step's own plus max_extra) cannot pay for one more group of `per_prompt`; else the missing groups times
    `oversample`, as many as the budget left pays for."""
    missing = wanted - kept
    affordable = (budget - generated) // per_prompt if per_prompt > 0 else 0
    if missing <= 0 or affordable <= 0:
        return 0
    return min(affordable, math.ceil(missing * oversample))


def groups_to_keep(informative: list[tuple[int, bool]], wanted: int) -> set[int]:
    """The prompt ids kept: those whose group has differing rewards (`informative`: (prompt id, has variance)
    over all ranks), the `wanted` lowest ids of them."""
    return set(sorted(q for q, ok in informative if ok)[:wanted])
