"""What every task shares: the records it produces, the train/test split rule, prompt and completion text.

A task is a small frozen dataclass built from flat config keys (see `dllm_rl.data.TASKS`). It produces
`Example`s, renders an example's prompt, scores a completion with a pure string reward, and, where an exact
solver exists, solves an example with a step-by-step trace (used later as an external policy, for SFT data
and for hindsight relabelling).

Splits: an example belongs to the test split when a hash of its canonical key (`uid`) falls below
`test_fraction`. The rule depends on nothing but the key, so train and test never share a problem, whatever
seeds or sizes are asked for. (Tasks read from files use the files as splits; see math_tasks.py.) A task may
say which rule it uses with `describe_splits()`, which the commands print. This module imports no torch.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from dllm_rl.errors import ConfigError, require

SPLITS = ("train", "test")
PROMPT_STYLES = ("d1", "compact")

# The answer format every task asks for. The "d1" style follows the d1 paper's prompts (arXiv 2504.12216):
# reasoning in <reasoning> tags, then the final answer alone in <answer> tags.
D1_FORMAT = (
    "Respond in the following format:\n<reasoning>\nYour reasoning here\n</reasoning>\n"
    "<answer>\n{answer_hint}\n</answer>"
)


class TooFewExamples(ConfigError):
    """A split holds fewer examples than asked; `worded(key)` says it with the key the user sets."""

    def __init__(self, split: str, task: str, available: int, asked: int):
        self.split, self.task, self.available, self.asked = split, task, available, asked
        super().__init__(self.worded("n"))

    def worded(self, key: str) -> str:
        null = f", or {key}=null for the whole split" if key in NULLABLE_COUNTS else ""
        return (f"{key}={self.asked}: the {self.split} split of {self.task!r} has only {self.available} problems; "
                f"use {key}<={self.available}{null}")


NULLABLE_COUNTS = ("num_prompts",)  # count keys where null means the whole split


def draw_examples(task: "Task", split: str, n: int | None, seed: int, key: str) -> list["Example"]:
    """`task.examples(split, n, seed)`, with too few examples named by `key`, the setting that asked for `n`."""
    try:
        return task.examples(split, n, seed)
    except TooFewExamples as error:
        raise ConfigError(error.worded(key)) from None


def train_examples_up_to(task: "Task", n: int, seed: int) -> list["Example"]:
    """The first `n` train examples, or all of a smaller train split; an empty one is a named error."""
    try:
        return task.examples("train", n, seed)
    except TooFewExamples as error:
        require(error.available > 0, f"the train split of {task.name!r} is empty (a task file's problems that are "
                f"also in its test file are dropped from training; set task.train_file)")
        return task.examples("train", error.available, seed)


@dataclass(frozen=True)
class Example:
    """One problem. `answer` is the reference final answer (what belongs inside <answer> tags); `meta`
    holds what the reward needs (numbers and target, the puzzle, ...), JSON-serialisable."""

    task: str
    uid: str
    question: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reward:
    """The score an RL step optimises, plus why: `correct` and `formatted` are the parts, `reason` is "ok"
    or what went wrong (for logging)."""

    score: float
    correct: bool
    formatted: bool
    reason: str


@dataclass(frozen=True)
class Solution:
    """An exact solver's output: the final answer and the reasoning steps that lead to it."""

    answer: str
    steps: tuple[str, ...] = ()


class Task(Protocol):
    name: str
    prompt_style: str

    def examples(self, split: str, n: int | None, seed: int) -> list[Example]: ...

    def prompt(self, example: Example) -> str: ...

    def reward(self, completion: str, example: Example) -> Reward: ...

    def solve(self, example: Example) -> Solution | None: ...


def in_test_split(task_name: str, uid: str, test_fraction: float) -> bool:
    """Deterministic split membership from the example's key alone (stable across Python processes)."""
    digest = hashlib.blake2b(f"{task_name}\x00{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < test_fraction


def check_common(split: str, n: int | None, test_fraction: float | None, prompt_style: str,
                 fraction_optional: bool = False) -> None:
    """The arguments every task checks; `test_fraction` may be None only where `fraction_optional` (file tasks)."""
    require(split in SPLITS, f"split must be one of {SPLITS}, got {split!r}")
    require(n is None or (isinstance(n, int) and n > 0), f"n must be a positive integer, got {n!r}")
    require(
        (fraction_optional and test_fraction is None)
        or (isinstance(test_fraction, (int, float)) and not isinstance(test_fraction, bool)
            and 0.0 < test_fraction < 1.0),
        f"test_fraction must be in (0, 1){' or null' if fraction_optional else ''}, got {test_fraction!r}",
    )
    require(prompt_style in PROMPT_STYLES, f"prompt_style must be one of {PROMPT_STYLES}, got {prompt_style!r}")


def sample_unique(
    task_name: str,
    split: str,
    n: int,
    seed: int,
    test_fraction: float,
    draw: Callable[[random.Random], Example | None],
    max_tries_per_example: int = 200,
) -> list[Example]:
    """Draw examples from a seeded generator, keeping those of `split` with a key not seen before. A draw may
    return None (an attempt that missed the task's constraints); every draw counts against the bound of
    `max_tries_per_example * n + 1000`, so a setting that is unreachable, or too rare to use, fails with a named
    error instead of running on.

    `random.Random` seeded with a string is deterministic across processes (it hashes the string with
    SHA-512), so the same (task, split, seed) always gives the same list.
    """
    rng = random.Random(f"{task_name}|{split}|{seed}")
    want_test = split == "test"
    seen: set[str] = set()
    out: list[Example] = []
    for _ in range(max_tries_per_example * n + 1000):
        ex = draw(rng)
        if ex is None or ex.uid in seen or in_test_split(task_name, ex.uid, test_fraction) != want_test:
            continue
        seen.add(ex.uid)
        out.append(ex)
        if len(out) == n:
            return out
    raise ConfigError(
        f"could only generate {len(out)} distinct {split} examples of {task_name!r} out of n={n} asked in "
        f"{max_tries_per_example * n + 1000} random draws; widen the task's ranges or ask for fewer"
    )


def describe_splits(task: Task, needed: tuple[str, ...] = ()) -> str | None:
    """The task's line on its split rule and sizes (None for a task that does not say), after checking that the
    splits in `needed` exist (a named error otherwise)."""
    describe = getattr(task, "describe_splits", None)
    return None if describe is None else describe(needed)


class GeneratedTask:
    """What the procedurally generated tasks (Sudoku, Countdown, arithmetic) share. A subclass is a frozen
    dataclass with the fields `test_fraction` and `prompt_style`, a `name`, and the methods `draw(rng)` (one
    random example), `compact_prompt(example)` and `d1_prompt(example)`; it calls `check_style()` in its
    `__post_init__`."""

    name: str
    test_fraction: float
    prompt_style: str

    def check_style(self) -> None:
        check_common("train", None, self.test_fraction, self.prompt_style)

    def describe_splits(self, needed: tuple[str, ...] = ()) -> str:
        return (f"{self.name}: generated problems, split by a hash of each problem with "
                f"task.test_fraction={self.test_fraction:g}")

    def examples(self, split: str, n: int | None, seed: int) -> list[Example]:
        """`n` distinct examples of `split` (1000 when n is None), the same for the same seed."""
        check_common(split, n, self.test_fraction, self.prompt_style)
        return sample_unique(self.name, split, n or 1000, seed, self.test_fraction, self.draw)

    def prompt(self, example: Example) -> str:
        return self.compact_prompt(example) if self.prompt_style == "compact" else self.d1_prompt(example)

    def in_train_split(self, uid: str) -> bool:
        """Whether a problem of key `uid` belongs to the train split (a relabelled problem must: hindsight
        never trains on a held-out one)."""
        return not in_test_split(self.name, uid, self.test_fraction)

    def draw(self, rng: random.Random) -> Example | None:
        """One random example, or None for an attempt that missed the task's constraints (see sample_unique)."""
        raise NotImplementedError

    def compact_prompt(self, example: Example) -> str:
        raise NotImplementedError

    def d1_prompt(self, example: Example) -> str:
        raise NotImplementedError


def render_prompt(
    text: str, tokenizer: Any = None, system_prompt: str | None = None
) -> str:
    """The prompt as the model sees it: through the tokenizer's chat template when it has one."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        return text if system_prompt is None else f"{system_prompt}\n{text}"
    messages = [{"role": "user", "content": text}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def render_completion(solution: Solution, prompt_style: str = "d1") -> str:
    """A completion in the format the prompts ask for, e.g. the text an exact solver would write."""
    if prompt_style == "compact":
        steps = "".join(f"{s}\n" for s in solution.steps)
        return f"{steps}<answer>{solution.answer}</answer>"
    reasoning = "\n".join(solution.steps)
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{solution.answer}\n</answer>"


def score(correct: float, formatted: bool, format_weight: float) -> float:
    """Reward = correctness (1/0, or a fraction for partial credit) + format_weight * [well formatted]."""
    return float(correct) + format_weight * float(formatted)
