"""Sudoku 4x4: fill the blanks so every row, column and 2x2 box holds 1-4 once.

Format as in the d1 paper (arXiv 2504.12216): the puzzle is a 16-character string read row by row with
'0' for a blank, and the answer is the completed 16-digit string. Puzzles are made by removing cells of a
random valid grid, one at a time, keeping only removals after which the solution is still unique, until
the chosen number of blanks is reached (a 4x4 Sudoku with a unique solution has at least 4 clues, so at
most 12 blanks).

The reward is 1 for a complete valid grid consistent with the clues (whitespace between digits is
ignored). d1 instead scores the fraction of blank cells filled correctly; `partial_credit=true` gives
that, measured against the validity rules rather than a stored solution (the solution is unique anyway).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from dllm_rl.data.d1_rewards import check_reward_style, d1_sudoku
from dllm_rl.data.answers import extract_tag, is_formatted
from dllm_rl.data.task import (
    D1_FORMAT, Example, GeneratedTask, Reward, Solution, score,
)
from dllm_rl.errors import require

SIZE = 4
CELLS = SIZE * SIZE
MAX_BLANKS = 12


def units_of(cell: int) -> tuple[list[int], list[int], list[int]]:
    r, c = divmod(cell, SIZE)
    box_r, box_c = 2 * (r // 2), 2 * (c // 2)
    return (
        [r * SIZE + j for j in range(SIZE)],
        [i * SIZE + c for i in range(SIZE)],
        [(box_r + i) * SIZE + box_c + j for i in range(2) for j in range(2)],
    )


UNITS = [units_of(cell) for cell in range(CELLS)]
PEERS = [sorted({p for unit in UNITS[cell] for p in unit} - {cell}) for cell in range(CELLS)]
ALL_UNITS = [UNITS[i * SIZE][0] for i in range(SIZE)] + [UNITS[j][1] for j in range(SIZE)] + [
    UNITS[cell][2] for cell in (0, 2, 8, 10)
]


def candidates(grid: list[int], cell: int) -> list[int]:
    used = {grid[p] for p in PEERS[cell]}
    return [d for d in range(1, SIZE + 1) if d not in used]


def solutions(grid: list[int], limit: int = 2) -> list[list[int]]:
    """Up to `limit` completions of `grid` (0 = blank), by backtracking on the most constrained cell."""
    found: list[list[int]] = []

    def search(g: list[int]) -> None:
        blanks = [c for c in range(CELLS) if g[c] == 0]
        if not blanks:
            found.append(list(g))
            return
        cell = min(blanks, key=lambda c: len(candidates(g, c)))
        for d in candidates(g, cell):
            g[cell] = d
            search(g)
            g[cell] = 0
            if len(found) >= limit:
                return

    search(list(grid))
    return found


@lru_cache(maxsize=1)
def all_grids() -> tuple[tuple[int, ...], ...]:
    """Every valid 4x4 grid (there are 288)."""
    return tuple(tuple(g) for g in solutions([0] * CELLS, limit=10_000))


def is_valid_grid(grid: list[int]) -> bool:
    return all(sorted(grid[c] for c in unit) == [1, 2, 3, 4] for unit in ALL_UNITS)


def make_puzzle(rng: random.Random, blanks: int) -> tuple[str, str]:
    """(puzzle, solution) strings with exactly `blanks` zeros and a unique solution."""
    while True:
        solution = list(rng.choice(all_grids()))
        puzzle = list(solution)
        order = list(range(CELLS))
        rng.shuffle(order)
        removed = 0
        for cell in order:
            if removed == blanks:
                break
            puzzle[cell] = 0
            if len(solutions(puzzle)) == 1:
                removed += 1
            else:
                puzzle[cell] = solution[cell]
        if removed == blanks:
            return "".join(map(str, puzzle)), "".join(map(str, solution))


def sudoku_reward(
    completion: str, puzzle: str, format_weight: float = 0.0, partial_credit: bool = False
) -> Reward:
    formatted = is_formatted(completion)
    answer, reason = extract_tag(completion)

    def result(correct: float, why: str) -> Reward:
        return Reward(score(correct, formatted, format_weight), correct == 1, formatted, why)

    if answer is None:
        return result(0, reason)
    digits = "".join(answer.split())
    if len(digits) != CELLS or any(c not in "1234" for c in digits):
        return result(0, f"answer must be 16 digits from 1-4, got {digits[:32]!r}")
    grid = [int(c) for c in digits]
    clash = [i for i, c in enumerate(puzzle) if c != "0" and grid[i] != int(c)]
    if clash:
        return result(0, f"changes the clue at cell {clash[0]}")
    if is_valid_grid(grid):
        return result(1, "ok")
    if partial_credit:
        # d1's credit: fraction of blanks filled with the (unique) solution's digit.
        solution = solutions([int(c) for c in puzzle], limit=1)[0]
        blanks = [i for i, c in enumerate(puzzle) if c == "0"]
        return result(sum(grid[i] == solution[i] for i in blanks) / len(blanks), "not a valid grid")
    return result(0, "not a valid grid")


def solve_steps(puzzle: str) -> tuple[str, tuple[str, ...]] | None:
    """Solve by repeatedly filling the most constrained blank; steps read "r1c3=2" (1-based)."""
    grid = [int(c) for c in puzzle]
    found = solutions(grid, limit=1)
    if not found:
        return None
    solution, steps = found[0], []
    while 0 in grid:
        cell = min((c for c in range(CELLS) if grid[c] == 0), key=lambda c: len(candidates(grid, c)))
        grid[cell] = solution[cell]
        steps.append(f"r{cell // SIZE + 1}c{cell % SIZE + 1}={solution[cell]}")
    return "".join(map(str, solution)), tuple(steps)


@dataclass(frozen=True)
class Sudoku(GeneratedTask):
    name = "sudoku"
    blanks: tuple[int, int] = (8, 12)
    partial_credit: bool = False
    test_fraction: float = 0.1
    prompt_style: str = "compact"
    format_weight: float = 0.0
    reward_style: str = "default"  # default | d1 (dllm_rl/data/d1_rewards.py)

    def __post_init__(self) -> None:
        blanks = (self.blanks, self.blanks) if isinstance(self.blanks, int) else tuple(self.blanks)
        object.__setattr__(self, "blanks", blanks)
        require(
            len(blanks) == 2 and 1 <= blanks[0] <= blanks[1] <= MAX_BLANKS,
            f"blanks must be an integer or a [min, max] pair within [1, {MAX_BLANKS}] "
            f"(a unique 4x4 solution needs at least 4 clues), got {list(blanks)}",
        )
        self.check_style()
        check_reward_style(self.reward_style)

    def draw(self, rng: random.Random) -> Example:
        puzzle, solution = make_puzzle(rng, rng.randint(*self.blanks))
        return Example(self.name, puzzle, f"Puzzle: {puzzle}", solution, {"puzzle": puzzle})

    def compact_prompt(self, example: Example) -> str:
        return f"Sudoku. {example.question}\n"

    def d1_prompt(self, example: Example) -> str:
        return (
            "Please solve the following 4x4 Sudoku puzzle. The puzzle is a 16-character string read "
            "left to right, top to bottom, where '0' is an empty cell.\nRules: fill every '0'; each row, "
            "each column and each 2x2 box must contain the digits 1-4 exactly once; keep the given "
            "digits.\nGive the solution as a 16-digit string with no spaces inside the answer tags.\n"
            + D1_FORMAT.format(answer_hint="16-digit solution")
            + f"\nSolve the following Sudoku puzzle: {example.meta['puzzle']}\n"
        )

    def reward(self, completion: str, example: Example) -> Reward:
        if self.reward_style == "d1":
            return d1_sudoku(completion, example.meta["puzzle"], example.answer)
        return sudoku_reward(completion, example.meta["puzzle"], self.format_weight, self.partial_credit)

    def relabel(self, completion: str, example: Example) -> Example | None:
        """Hindsight: the puzzle `completion` solves instead: its answer is a complete valid grid that contradicts
        some clues, and the puzzle with those clues blanked has at most `blanks[1]` blanks (as many as this task
        poses) and is a train-split puzzle. None otherwise. Such a puzzle always has several solutions (the
        original one still fits its clues), unlike the puzzles the task poses; the reward accepts any valid grid
        that keeps the clues, so the grid is a correct answer to it. The caller verifies the pair with `reward`."""
        answer, _ = extract_tag(completion)
        digits = "" if answer is None else "".join(answer.split())
        if len(digits) != CELLS or any(c not in "1234" for c in digits) or not is_valid_grid([int(c) for c in digits]):
            return None
        clues = example.meta["puzzle"]
        puzzle = "".join("0" if c != "0" and c != d else c for c, d in zip(clues, digits))
        blanks = puzzle.count("0")
        if puzzle == clues or blanks > self.blanks[1] or not self.in_train_split(puzzle):
            return None
        return Example(self.name, puzzle, f"Puzzle: {puzzle}", digits, {"puzzle": puzzle,
                                                                       "relabelled_from": example.uid})

    def solve(self, example: Example) -> Solution | None:
        solved = solve_steps(example.meta["puzzle"])
        return None if solved is None else Solution(*solved)
