"""The single-turn puzzles played one move a turn: Countdown one operation a turn, 4x4 Sudoku one cell a turn,
from the same instances as the tasks (dllm_rl/data/countdown.py, dllm_rl/data/sudoku.py)."""

from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import Hashable

from dllm_rl.data import sudoku
from dllm_rl.data.countdown import Countdown
from dllm_rl.envs.base import Env

OPERATION = re.compile(r"^(\d+)\s*([-+*/])\s*(\d+)(?:\s*=\s*\d+)?$")
PLACEMENT = re.compile(r"^(\d)\s*[, ]\s*(\d)\s*[, =]\s*(\d)$")


def combine(a: int, op: str, b: int) -> int | None:
    """a op b where it is a positive integer (the game's rule: exact division, no zero or negative), else None."""
    value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else 0}[op]
    return value if value > 0 else None


@lru_cache(maxsize=4096)
def countdown_plan(numbers: tuple[int, ...], target: int) -> tuple[str, ...] | None:
    """Operations that leave exactly `target` from the (sorted) `numbers`, each combining two of them; None if none
    do. Depth-first, pairs and operators in a fixed order."""
    if len(numbers) == 1:
        return () if numbers[0] == target else None
    for i in range(len(numbers)):
        for j in range(len(numbers)):
            if i == j:
                continue
            a, b = numbers[i], numbers[j]
            for op in "+-*/":
                if op in "+*" and i > j:
                    continue  # a + b and b + a are the same move
                value = combine(a, op, b)
                if value is None:
                    continue
                rest = tuple(sorted([x for k, x in enumerate(numbers) if k not in (i, j)] + [value]))
                found = countdown_plan(rest, target)
                if found is not None:
                    return (f"{a} {op} {b}",) + found
    return None


class CountdownTurns(Env):
    """Countdown, one operation a turn: combine two of the remaining numbers with + - * / (a positive integer
    result: exact division, no zero or negative), the result replacing them, until one number is left; success if
    it is the target. Action: "a op b" (e.g. "25 * 4"; "= result" after it is allowed). The instances are the
    Countdown task's (3 numbers by default), each solvable this way. Illegal: a number not among the remaining
    ones, a result that is not a positive integer. Anchor: the sorted remaining numbers."""

    name = "countdown"

    def __init__(self, num_numbers: int = 3, max_number: int = 99) -> None:
        super().__init__()
        self.task = Countdown(num_numbers=(num_numbers,), max_number=max_number)
        self.max_turns = 2 * (num_numbers - 1) + 2

    def _reset(self, rng: random.Random) -> None:
        example = None
        while example is None:
            example = self.task.draw(rng)
        self.numbers, self.target = sorted(example.meta["numbers"]), example.meta["target"]

    def describe(self) -> str:
        return ("Countdown: combine two of the numbers each turn (+ - * /, whole positive results) until one is "
                "left; it must equal the target. Action: a op b, e.g. 25 * 4.")

    def observe(self) -> str:
        return f"Numbers: {' '.join(map(str, self.numbers))}; target {self.target}."

    def parse(self, text: str) -> tuple[int, str, int] | None:
        found = OPERATION.match(text.replace("x", "*"))
        return None if found is None else (int(found.group(1)), found.group(2), int(found.group(3)))

    def refuse(self, move: tuple[int, str, int]) -> str | None:
        a, op, b = move
        rest = list(self.numbers)
        for x in (a, b):
            if x not in rest:
                return f"{x} is not among the numbers {self.numbers}"
            rest.remove(x)
        return None if combine(a, op, b) is not None else f"{a} {op} {b} is not a positive whole number"

    def apply(self, move: tuple[int, str, int]) -> str | None:
        a, op, b = move
        rest = list(self.numbers)
        rest.remove(a)
        rest.remove(b)
        self.numbers = sorted(rest + [combine(a, op, b)])
        if len(self.numbers) > 1:
            return None
        return "success" if self.numbers[0] == self.target else "failure"

    def anchor(self) -> Hashable:
        return tuple(self.numbers)

    def solve(self) -> list[str] | None:
        plan = countdown_plan(tuple(self.numbers), self.target)
        return None if plan is None else list(plan)


class SudokuTurns(Env):
    """4x4 Sudoku, one cell a turn: write a digit 1-4 into a blank cell, from the Sudoku task's puzzles (unique
    solutions, 4-10 blanks by default). Action: "row col digit", 1-based ("2 3 4": row 2, column 3, digit 4).
    Illegal: a cell that is not blank, a digit its row, column or box already holds. A digit the solution does not
    have there is legal; when a blank is left that no digit fits, the episode ends as a failure. Success: the grid
    is full. Anchor: the board."""

    name = "sudoku"

    def __init__(self, min_blanks: int = 4, max_blanks: int = 10) -> None:
        super().__init__()
        self.blanks = (min_blanks, max_blanks)
        self.max_turns = max_blanks + 4

    def _reset(self, rng: random.Random) -> None:
        puzzle, _ = sudoku.make_puzzle(rng, rng.randint(*self.blanks))
        self.grid = [int(c) for c in puzzle]

    def describe(self) -> str:
        return ("Sudoku 4x4: fill the blanks (0) so every row, column and 2x2 box holds 1-4 once, one cell a turn. "
                "Action: row col digit (1-based), e.g. 2 3 4.")

    def observe(self) -> str:
        text = "".join(map(str, self.grid))
        return "Board: " + "/".join(text[r * 4:(r + 1) * 4] for r in range(4))

    def parse(self, text: str) -> tuple[int, int, int] | None:
        found = PLACEMENT.match(text)
        if found is None:
            return None
        r, c, d = (int(g) for g in found.groups())
        return (r - 1, c - 1, d) if 1 <= r <= 4 and 1 <= c <= 4 and 1 <= d <= 4 else None

    def refuse(self, move: tuple[int, int, int]) -> str | None:
        r, c, d = move
        cell = r * 4 + c
        if self.grid[cell] != 0:
            return f"row {r + 1} column {c + 1} is not blank"
        return None if d in sudoku.candidates(self.grid, cell) else f"{d} clashes at row {r + 1} column {c + 1}"

    def apply(self, move: tuple[int, int, int]) -> str | None:
        r, c, d = move
        self.grid[r * 4 + c] = d
        blanks = [cell for cell in range(16) if self.grid[cell] == 0]
        if not blanks:
            return "success"
        return "failure" if any(not sudoku.candidates(self.grid, cell) for cell in blanks) else None

    def anchor(self) -> Hashable:
        return tuple(self.grid)

    def solve(self) -> list[str] | None:
        found = sudoku.solutions(self.grid, limit=1)
        if not found:
            return None
        return [f"{cell // 4 + 1} {cell % 4 + 1} {found[0][cell]}" for cell in range(16) if self.grid[cell] == 0]
