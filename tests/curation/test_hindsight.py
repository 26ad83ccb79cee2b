"""Hindsight relabelling: Countdown and Sudoku relabel exactly (hand-made cases, and every label verifies under
the task's own reward), other tasks are refused by name, and the strategy turns failed rollouts into auxiliary
SFT rows of their relabelled prompts."""

import json

import pytest
import torch

from dllm_rl.curation import build_curation
from dllm_rl.curation.hindsight import relabelled
from dllm_rl.data import build_task
from dllm_rl.data.countdown import Countdown
from dllm_rl.data.sudoku import all_grids
from dllm_rl.data.task import Example, in_test_split
from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from tests.conftest import DigitRelabel
from tests.test_stages import batch_of

COUNTDOWN, SUDOKU = build_task("countdown"), build_task("sudoku")
CD = Example("countdown", "[3, 5, 7]->22", Countdown.question([3, 5, 7], 22), "3*5+7",
             {"numbers": [3, 5, 7], "target": 22})


def answer(text: str) -> str:
    return f"<answer>{text}</answer>"


def test_a_countdown_expression_answers_the_target_it_reaches():
    other = COUNTDOWN.relabel(answer("3+5+7"), CD)
    assert other.meta["numbers"] == [3, 5, 7] and other.meta["target"] == 15 and other.uid == "[3, 5, 7]->15"
    assert COUNTDOWN.prompt(other) == "Countdown. Numbers: [3, 5, 7]\nTarget: 15\n"
    assert COUNTDOWN.reward(answer("3+5+7"), other).score == 1.0 and COUNTDOWN.reward(answer("3+5+7"), CD).score == 0
    assert relabelled(COUNTDOWN, answer("3 * 7 + 5"), CD).meta["target"] == 26
    for text in ("7+5*3",  # already correct
                 "3*5*7",  # 105: above max_target
                 "7-5-3",  # -1: below min_target
                 "3/5+7",  # not an integer
                 "3+5",  # not every number
                 "3+5+7+7", "3+(5", "no answer"):
        assert COUNTDOWN.relabel(answer(text), CD) is None, text
    assert in_test_split("countdown", "[3, 5, 7]->16", 0.1)
    assert COUNTDOWN.relabel(answer("3*7-5"), CD) is None  # 16: a held-out problem is never trained on


def near_grids(solution: str, most: int):
    for grid in all_grids():
        text = "".join(map(str, grid))
        if 0 < sum(a != b for a, b in zip(text, solution)) <= most:
            yield text


def test_a_valid_sudoku_grid_answers_the_puzzle_without_the_clues_it_contradicts():
    ex = SUDOKU.examples("train", 1, 0)[0]
    puzzle = ex.meta["puzzle"]
    grid = next(g for g in near_grids(ex.answer, 4) if any(p != "0" and p != d for p, d in zip(puzzle, g))
                and SUDOKU.in_train_split("".join("0" if p != d else p for p, d in zip(puzzle, g))))
    other = relabelled(SUDOKU, answer(grid), ex)
    clashing = [i for i, (p, d) in enumerate(zip(puzzle, grid)) if p != "0" and p != d]
    assert other.meta["puzzle"] == "".join("0" if i in clashing else p for i, p in enumerate(puzzle))
    assert SUDOKU.reward(answer(grid), other).score == 1.0 and SUDOKU.reward(answer(grid), ex).score == 0
    assert SUDOKU.relabel(answer(ex.answer), ex) is None  # already correct
    bad = grid[:3] + ("1" if grid[3] != "1" else "2") + grid[4:]
    assert SUDOKU.relabel(answer(bad), ex) is None  # not a valid grid
    far = next(g for g in all_grids() if sum(p != "0" and p != d for p, d in zip(puzzle, "".join(map(str, g)))) > 4)
    assert SUDOKU.relabel(answer("".join(map(str, far))), ex) is None  # too many clues blanked: > 12 blanks


@pytest.mark.parametrize("task_name", ["countdown", "sudoku"])
def test_every_label_verifies_under_the_tasks_own_reward(task_name):
    task = build_task(task_name)
    labels = 0
    for ex in task.examples("train", 60, 1):
        if task_name == "countdown":
            a, b, c = ex.meta["numbers"]
            texts = ([f"{a}{x}{b}{y}{c}" for x in "+-*/" for y in "+-*/"]
                     + [f"({a}{x}{b}){y}{c}" for x in "+-" for y in "*/"])
        else:
            texts = list(near_grids(ex.answer, 8))
        for text in texts:
            other = task.relabel(answer(text), ex)
            if other is not None:
                labels += 1
                assert task.reward(answer(text), other).score == 1.0 and task.in_train_split(other.uid), (text, other)
    assert labels > 50


def test_a_task_without_exact_relabelling_is_a_named_error(char_tokenizer):
    with pytest.raises(ConfigError, match="curation=hindsight: task 'arithmetic' cannot relabel a completion exactly"):
        build_curation({"hindsight": {}}, group_size=2, prompts_per_step=2, seed=0, pool_size=4,
                       task=build_task("arithmetic"), tokenizer=char_tokenizer)
    with pytest.raises(ConfigError, match="curation.hindsight.per_prompt must be >= 1"):
        build_curation({"hindsight": {"per_prompt": 0}}, group_size=2, prompts_per_step=2, seed=0, pool_size=4)


def test_failed_rollouts_become_sft_rows_of_their_relabelled_prompts(make_rows, char_tokenizer):
    curation = build_curation({"hindsight": {"weight": 0.3}}, group_size=3, prompts_per_step=1, seed=0, pool_size=4,
                              task=COUNTDOWN, tokenizer=char_tokenizer)
    batch = batch_of([CD], sizes=[3])
    texts = [answer("3+5+7"), answer("3*7+5"), answer("7+5*3")]  # 15, 26, and correct
    on = make_rows("on_policy", 3, prompts=1, C=6, texts=texts)
    on.mask_NC[:, 4:] = 0
    on.rewards = [COUNTDOWN.reward(t, CD) for t in texts]
    batch.rows["on_policy"] = on
    curation.reweight(batch)
    rows = batch.auxiliary["hindsight"]
    assert len(rows) == 1 and rows.weight == 0.3  # per_prompt=1: the first failed rollout only
    prompt = char_tokenizer.decode(
        rows.ids_NL[0, : rows.prompt_length][rows.attention_mask_NL[0, : rows.prompt_length] == 1])
    assert prompt == COUNTDOWN.prompt(COUNTDOWN.relabel(texts[0], CD))
    assert torch.equal(rows.ids_NL[0, rows.prompt_length:], on.ids_NL[0, on.prompt_length:])  # its own window
    assert rows.target_NC.tolist() == [[True] * 4 + [False] * 2]  # the counted tokens
    assert batch.metrics["curation/hindsight_rows"] == 1 and batch.metrics["curation/hindsight_failed"] == 2


def test_a_run_learns_from_relabelled_rows(saved_model, tmp_path):
    run = tmp_path / "run"
    train(DigitRelabel(), model=saved_model, run_dir=str(run), curation={"hindsight": {"weight": 1.0}},
          rollout={"gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0}, external={"name": "none"},
          prompts_per_step=4, group_size=2, minibatch_size=8, train_pool=4, eval_every=0, sample_every=0,
          tensorboard=False, bf16=False, lr=1e-3, steps=2, print_fn=lambda *_: None)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(m["curation/hindsight_rows"] for m in metrics) > 0
    assert all(m["loss/hindsight"] > 0 for m in metrics if m["curation/hindsight_rows"] > 0)
