"""Hindsight relabelling: a failed rollout that exactly solves another problem the task could pose becomes a
verified-correct row of that problem (the VLA paper's idea, where the task allows it exactly).

- Countdown: an expression over exactly the given numbers that evaluates to some other integer v is a correct
  answer to the same numbers with target v, when v is a target the task could pose (`Countdown.relabel`).
- Sudoku: a complete, valid grid that contradicts some clues is a correct answer to the puzzle with those clues
  blanked, when that leaves at most the task's most blanks and the puzzle is in the train split; such a puzzle has
  several solutions (the original's among them), and the reward accepts any valid grid that keeps the clues
  (`Sudoku.relabel`).
A relabelled problem in the held-out split is never used. A task without a `relabel` method cannot relabel exactly
(GSM8K, MATH500, arithmetic: the question fixes the answer), and `curation=hindsight` on it is a named error.

The relabelled prompt is rendered by the task's own prompt function (and the run's chat template), the row is
verified by the task's own reward (1.0, or it is not used), and it goes to the loss as an auxiliary masked-diffusion
SFT row (`dllm_rl/algo/auxiliary.py`: its whole completion, the tokens up to and including the first EOS, after the
relabelled prompt), weighted `weight` against the GRPO loss. Not as an extra group member of its relabelled prompt:
that prompt has no group in the step, and a group of one has a zero advantage, so GRPO would learn nothing from it.
At most `per_prompt` rows per prompt (its failed rollouts in rollout order), on-policy rows only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dllm_rl.curation.echo import WEIGHTINGS
from dllm_rl.data.task import Example, Task
from dllm_rl.errors import require


@dataclass(frozen=True)
class HindsightConfig:
    weight: float = 0.1  # the auxiliary term's weight against the GRPO loss
    per_prompt: int = 1  # relabelled rows per prompt at most
    weighting: str = "elbo"  # the SFT loss's form: elbo | masked_mean (dllm_rl/algo/auxiliary.py)

    def __post_init__(self) -> None:
        require(math.isfinite(self.weight) and self.weight > 0,
                f"curation.hindsight.weight must be > 0 and finite, got {self.weight!r}")
        require(isinstance(self.per_prompt, int) and self.per_prompt >= 1,
                f"curation.hindsight.per_prompt must be >= 1, got {self.per_prompt!r}")
        require(self.weighting in WEIGHTINGS, f"curation.hindsight.weighting must be one of {WEIGHTINGS}, "
                f"got {self.weighting!r}")


def check_task(task: Task) -> None:
    """A task that can relabel exactly, or a named error."""
    require(callable(getattr(task, "relabel", None)),
            f"curation=hindsight: task {getattr(task, 'name', task)!r} cannot relabel a completion exactly (its "
            f"question fixes its answer); hindsight relabelling is defined for countdown and sudoku")


def relabelled(task: Task, completion: str, example: Example) -> Example | None:
    """The problem `completion` exactly solves instead of `example`, verified by the task's own reward, or None."""
    other = task.relabel(completion, example)
    if other is None:
        return None
    reward = task.reward(completion, other)
    return other if reward.correct and reward.score == 1.0 else None
