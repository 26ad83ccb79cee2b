"""GRESO ("Act Only When It Pays", arXiv 2506.02177): skip, before any rollout, the prompts whose recent groups
taught nothing.

A group is "easy" when its mean correctness is at least `easy_mean` (0.98) and "hard" when it is at most
`hard_mean` (0.11), the reference implementation's thresholds on its reward (1 correct, 0.1 formatted but wrong,
0 unformatted); here they are applied to the share of correct rollouts (the task's `Reward.correct`), since a
task's reward may add a format bonus to the 1: for groups of up to 9 that is "all correct" and "none correct".
GRESO keeps, per prompt, the number k of its most recent visits in a row (one visit per epoch of the prompt
stream) whose group was easy, or hard, and skips the prompt with probability

    P(skip) = 1 - max(p^k, floor)

so a prompt is tried again now and then (never skipped with certainty). The exploration probability p is kept
apart for easy prompts and hard ones, and after each epoch each p moves by `step` toward the target share of such
groups (`target`, split 1/3 easy and 2/3 hard, as the paper's defaults), within [p_min, p_max]: a share at or
above the target makes p smaller (skip more, as the reference's `>=`), a share below it larger. Defaults: p = 0.5,
floor 0.01, step 0.01, target 0.25, bounds [0.05, 0.95].

Decisions of this project: p adapts once per epoch of the prompt stream (the reference adapts after every
training step, over the groups of that step); a group of one rollout with a reward in between is still judged
by its correctness. With ERILS, a prompt whose last group got kept external rows is not counted as easy or hard
(`exempt_external`): external rows give exactly such prompts a signal. Everything here is a pure function of
plain values; `Greso` (dllm_rl/curation/strategies.py) holds the state and calls them.
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
    easy_mean: float = 0.98  # a group whose share of correct rollouts is at least this is easy
    hard_mean: float = 0.11  # at most this, hard
    exempt_external: bool = True

    def __post_init__(self) -> None:
        for key in ("p_start", "floor", "target", "easy_share", "p_min", "p_max", "easy_mean", "hard_mean"):
            value = getattr(self, key)
            require(0.0 <= value <= 1.0, f"curation.greso.{key}={value!r}: expected a probability in [0, 1]")
        require(self.step >= 0, f"curation.greso.step={self.step!r}: expected a number >= 0")
        require(self.hard_mean < self.easy_mean, f"curation.greso: expected hard_mean < easy_mean; got "
                f"{self.hard_mean}, {self.easy_mean}")
        require(self.p_min <= self.p_start <= self.p_max, f"curation.greso: expected p_min <= p_start <= p_max; got "
                f"{self.p_min}, {self.p_start}, {self.p_max}")


def skip_probability(streak: int, p: float, floor: float) -> float:
    """1 - max(p^k, floor) for a prompt flat in its last k visits in a row (0 for k = 0: never skipped)."""
    return 0.0 if streak <= 0 else 1.0 - max(p ** streak, floor)


def adapt(p: float, flat_share: float, target: float, step: float, low: float, high: float) -> float:
    """p after an epoch whose share of easy (or hard) groups over all groups was `flat_share`: a step down at or
    above the target (skip more), a step up below it, clipped to [low, high]."""
    p = p - step if flat_share >= target else p + step
    return min(high, max(low, p))


def group_kind(correct: list[bool], easy_mean: float = 0.98, hard_mean: float = 0.11) -> str:
    """"easy" (a share of correct rollouts >= easy_mean), "hard" (<= hard_mean) or "mixed" (in between)."""
    share = sum(correct) / len(correct) if correct else 0.0
    return "easy" if share >= easy_mean else "hard" if share <= hard_mean else "mixed"


def next_streak(streak: int, kind: str) -> int:
    """The run of flat visits after one more visit of `kind`."""
    return streak + 1 if kind in ("easy", "hard") else 0
