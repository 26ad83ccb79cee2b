import random

import pytest

from dllm_rl.data.sudoku import Sudoku, all_grids, is_valid_grid, make_puzzle, solutions, sudoku_reward
from dllm_rl.errors import ConfigError

PUZZLE = "0124041310400031"
SOLUTION = "3124241313424231"


def answer(digits: str) -> str:
    return f"<answer>\n{digits}\n</answer>"


def test_known_puzzle_has_unique_solution():
    grid = [int(c) for c in PUZZLE]
    assert ["".join(map(str, s)) for s in solutions(grid)] == [SOLUTION]


def test_all_grids():
    grids = all_grids()
    assert len(grids) == 288  # the number of 4x4 Sudoku grids
    assert all(is_valid_grid(list(g)) for g in grids)


@pytest.mark.parametrize(
    "text, correct, reason",
    [
        (answer(SOLUTION), True, "ok"),
        (answer("3124 2413 1342 4231"), True, "ok"),            # whitespace between rows is fine
        (answer("1234341221434321"), False, "changes the clue at cell 1"),  # valid grid, other clues
        (answer("4124241313424231"), False, "not a valid grid"),  # blank 0 filled with a 4: row clash
        (answer("312424131342423"), False, "answer must be 16 digits from 1-4, got '312424131342423'"),
        (answer("31242413134242３1"), False, None),             # a fullwidth digit
        (answer("3124241313424235"), False, None),              # a 5
        ("3124241313424231", False, "no <answer> tag"),
    ],
)
def test_sudoku_reward(text, correct, reason):
    reward = sudoku_reward(text, PUZZLE)
    assert reward.correct is correct
    assert reward.score == float(correct)
    if reason is not None:
        assert reward.reason == reason


def test_partial_credit_counts_correct_blanks():
    # PUZZLE has 6 blanks (cells 0, 4, 9, 10, 12, 13) with solution digits 3, 2, 3, 2, 4, 2.
    # Swap the digits of cells 12 and 13 (4 <-> 2): 4 of 6 blanks stay right -> 4/6.
    wrong = SOLUTION[:12] + "24" + SOLUTION[14:]
    assert sudoku_reward(answer(wrong), PUZZLE, partial_credit=True).score == pytest.approx(4 / 6)
    assert sudoku_reward(answer(wrong), PUZZLE).score == 0.0
    assert sudoku_reward(answer(SOLUTION), PUZZLE, partial_credit=True).score == 1.0


@pytest.mark.parametrize("blanks", [1, 6, 10, 12])
def test_make_puzzle_blanks_and_uniqueness(blanks):
    rng = random.Random(blanks)
    for _ in range(20):
        puzzle, solution = make_puzzle(rng, blanks)
        assert puzzle.count("0") == blanks
        assert ["".join(map(str, s)) for s in solutions([int(c) for c in puzzle])] == [solution]
        assert all(p in ("0", s) for p, s in zip(puzzle, solution))


def test_blanks_out_of_range_is_rejected():
    with pytest.raises(ConfigError, match="blanks"):
        Sudoku(blanks=13)
    with pytest.raises(ConfigError, match="blanks"):
        Sudoku(blanks=(8, 4))


def test_solver_trace_fills_every_blank():
    task = Sudoku()
    ex = task.examples("test", 1, 0)[0]
    solution = task.solve(ex)
    assert len(solution.steps) == ex.meta["puzzle"].count("0")
    assert solution.answer == ex.answer
