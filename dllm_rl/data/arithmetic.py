"""Multi-digit arithmetic: evaluate an expression such as `347 + 58 * 26` (usual precedence).

Operands have a number of digits drawn from `digits`; operators come from `ops` (any of "+-*"). The
answer is an integer; the reward accepts an optionally signed ASCII integer (thousands separators
allowed) and nothing else. The exact solver writes the steps a person would: products first, then sums
from left to right.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from dllm_rl.data.answers import extract_tag, is_formatted
from dllm_rl.data.task import D1_FORMAT, Example, GeneratedTask, Reward, Solution, score
from dllm_rl.errors import require

# An answer of up to 100 digits: the largest value the task's ranges allow, 8 operands of 12 digits multiplied,
# has 96. The bound keeps a hostile completion's digit string from reaching int().
_INTEGER = re.compile(r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3}){1,33}|[0-9]{1,100})", re.ASCII)


def evaluate_steps(operands: list[int], ops: list[str]) -> tuple[int, list[str]]:
    """Value of `o0 op0 o1 op1 ...` with * before + and -, and the steps taken."""
    values, pending, steps = [operands[0]], [], []
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            steps.append(f"{values[-1]}*{x}={values[-1] * x}")
            values[-1] *= x
        else:
            values.append(x)
            pending.append(op)
    total = values[0]
    for op, x in zip(pending, values[1:]):
        new = total + x if op == "+" else total - x
        steps.append(f"{total}{op}{x}={new}")
        total = new
    return total, steps


def arithmetic_reward(completion: str, answer: int, format_weight: float = 0.0) -> Reward:
    formatted = is_formatted(completion)
    text, reason = extract_tag(completion)
    if text is None:
        return Reward(score(0, formatted, format_weight), False, formatted, reason)
    if not _INTEGER.fullmatch(text):
        return Reward(score(0, formatted, format_weight), False, formatted, f"not an integer: {text[:32]!r}")
    if int(text.replace(",", "")) != answer:
        return Reward(score(0, formatted, format_weight), False, formatted, "wrong answer")
    return Reward(score(1, formatted, format_weight), True, formatted, "ok")


@dataclass(frozen=True)
class Arithmetic(GeneratedTask):
    name = "arithmetic"
    digits: tuple[int, int] = (1, 3)
    num_operands: tuple[int, int] = (2, 3)
    ops: str = "+-*"
    test_fraction: float = 0.1
    prompt_style: str = "compact"
    format_weight: float = 0.0

    def __post_init__(self) -> None:
        for key in ("digits", "num_operands"):
            value = getattr(self, key)
            pair = (value, value) if isinstance(value, int) else tuple(value)
            object.__setattr__(self, key, pair)
        require(len(self.digits) == 2 and 1 <= self.digits[0] <= self.digits[1] <= 12,
                f"digits must be an integer or a [min, max] pair within [1, 12], got {list(self.digits)}")
        require(len(self.num_operands) == 2 and 2 <= self.num_operands[0] <= self.num_operands[1] <= 8,
                f"num_operands must be an integer or a [min, max] pair within [2, 8], got {list(self.num_operands)}")
        require(bool(self.ops) and set(self.ops) <= set("+-*"),
                f"ops must be a non-empty string of '+', '-', '*', got {self.ops!r}")
        self.check_style()

    def draw(self, rng: random.Random) -> Example:
        count = rng.randint(*self.num_operands)
        operands = []
        for _ in range(count):
            d = rng.randint(*self.digits)
            operands.append(rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1))
        ops = [rng.choice(self.ops) for _ in range(count - 1)]
        expression = " ".join(f"{x} {op}" for x, op in zip(operands, ops)) + f" {operands[-1]}"
        value, _ = evaluate_steps(operands, ops)
        return Example(self.name, expression, expression, str(value), {"operands": operands, "ops": ops})

    def compact_prompt(self, example: Example) -> str:
        return f"Compute {example.question}\n"

    def d1_prompt(self, example: Example) -> str:
        return (
            f"Compute {example.question}. Multiplication comes before addition and subtraction. "
            "Give only the final integer inside the answer tags.\n" + D1_FORMAT.format(answer_hint="integer")
        )

    def reward(self, completion: str, example: Example) -> Reward:
        return arithmetic_reward(completion, int(example.answer), self.format_weight)

    def solve(self, example: Example) -> Solution | None:
        value, steps = evaluate_steps(example.meta["operands"], example.meta["ops"])
        return Solution(str(value), tuple(steps))
