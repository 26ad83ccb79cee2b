"""What every external source returns, and the protocol it follows (the sources are in `sources.py` and
`served.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from dllm_rl.data.task import Example, Task


@dataclass(frozen=True)
class ExternalRollout:
    """One external completion of the step's prompt number `prompt_index`."""

    prompt_index: int
    text: str
    source: str
    behaviour_logp: float | None = None


class ExternalSource(Protocol):
    """A source may also have `step_metrics() -> dict[str, float]`, about its last `rollouts` call (logged as
    external/<key>); `prefetch(task, examples, count, seeds)`, which starts the work of a later `rollouts` call with
    the same arguments (called before the dLLM's own rollouts where the trigger allows); `close()`."""

    name: str

    def rollouts(self, task: Task, examples: Sequence[Example], count: int,
                 seeds: Sequence[Sequence[int]]) -> list[list[ExternalRollout]]:
        """`count` rollouts for each example (seeds[i][j] for rollout j of example i); one list per example."""
        ...
