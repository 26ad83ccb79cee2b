"""GRESO ("Act Only When It Pays", arXiv 2506.02177): skip, before any rollout, the prompts whose recent groups
taught nothing.

A group teaches nothing when its rewards are all equal (zero variance: zero advantage under every estimator).
GRESO keeps, per prompt, the number k of its most recent visits in a row (one visit per epoch of the prompt
stream) whose group had zero variance, and skips the prompt with probability

    P(skip) = 1 - max(p^k, floor)

so a prompt is tried again now and then (never skipped with certainty). The exploration probability p is kept
apart for easy prompts (the flat group was all correct) and hard ones (all wrong), and after each epoch each
p moves by `step` toward the target share of zero-variance groups (`target`, split 1/3 easy and 2/3 hard, as
the paper's defaults), within [p_min, p_max]: more zero-variance groups than the target make p smaller (skip
more), fewer make it larger. Defaults: p = 0.5, floor 0.01, step 0.01, target 0.25, bounds [0.05, 0.95].

Decisions: a group of one rollout is flat (nothing to compare), and "easy" means every reward of a flat group
is correct (the task's `Reward.correct`), "hard" anything else flat. With ERILS, a prompt whose last group got
kept external rows is not counted as flat (`exempt_external`): external rows give exactly such prompts a
signal. Everything here is a pure function of plain values; `Greso` (dllm_rl/curation/strategies.py) holds the
state and calls them.
"""

from __future__ import annotations

from dataclasses import dataclass

from dllm_rl.errors import require


@dataclass(frozen=True)
class GresoConfig:
    p_start: float = 0.5
    floor: float = 0.01
    step: float = 0.01
    target: float = 0.25
    easy_share: float = 1 / 3  # of the target: the rest is the hard prompts'
    p_min: float = 0.05
    p_max: float = 0.95
    exempt_external: bool = True

    def __post_init__(self) -> None:
        for key in ("p_start", "floor", "target", "easy_share", "p_min", "p_max"):
            value = getattr(self, key)
            require(0.0 <= value <= 1.0, f"curation.greso.{key}={value!r}: expected a probability in [0, 1]")
        require(self.step >= 0, f"curation.greso.step={self.step!r}: expected a number >= 0")
        require(self.p_min <= self.p_start <= self.p_max, f"curation.greso: expected p_min <= p_start <= p_max; got "
                f"{self.p_min}, {self.p_start}, {self.p_max}")


def skip_probability(streak: int, p: float, floor: float) -> float:
    """1 - max(p^k, floor) for a prompt flat in its last k visits in a row (0 for k = 0: never skipped)."""
    return 0.0 if streak <= 0 else 1.0 - max(p ** streak, floor)


def adapt(p: float, flat_share: float, target: float, step: float, low: float, high: float) -> float:
    """p after an epoch whose share of flat groups (of this kind, over all groups) was `flat_share`: a step down
    above the target (skip more), a step up below it, clipped to [low, high]; unchanged at the target."""
    if flat_share > target:
        p -= step
    elif flat_share < target:
        p += step
    return min(high, max(low, p))


def group_kind(correct: list[bool], rewards: list[float]) -> str:
    """"easy" (flat, all correct), "hard" (flat otherwise) or "mixed" (rewards differ: it teaches)."""
    if len(set(rewards)) > 1:
        return "mixed"
    return "easy" if correct and all(correct) else "hard"


def next_streak(streak: int, kind: str) -> int:
    """The run of flat visits after one more visit of `kind`."""
    return streak + 1 if kind in ("easy", "hard") else 0
