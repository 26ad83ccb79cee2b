"""d1's rewards (`task.reward_style=d1`) against values worked out by hand from their definitions, and the 8B
recipes: every recipe composed with every task it names trains with d1's prompts, rewards and lengths."""

import json
from pathlib import Path

import pytest

from dllm_rl.cli import compose_config, to_plain
from dllm_rl.data import build_task
from dllm_rl.data.d1_rewards import soft_format, strict_format, xml_count
from dllm_rl.errors import ConfigError

RECIPES = Path(__file__).parents[2] / "configs" / "experiment"
D1_TASKS = ("gsm8k", "math500", "countdown", "sudoku")


def sudoku_example():
    task = build_task("sudoku", reward_style="d1", prompt_style="d1")
    return task, task.examples("test", 1, 0)[0]


def test_d1_sudoku_is_the_share_of_blanks_right_from_the_answers_digits():
    task, ex = sudoku_example()
    puzzle, solution = ex.meta["puzzle"], ex.answer
    blanks = [i for i, c in enumerate(puzzle) if c == "0"]
    assert task.reward(f"<answer>{solution}</answer>", ex).score == 1.0
    spaced = " ".join(solution[i:i + 4] for i in range(0, 16, 4))  # separators dropped
    assert task.reward(f"<reasoning>r</reasoning>\n<answer>\n{spaced}\n</answer>", ex).score == 1.0
    wrong = list(solution)
    for i in blanks[:2]:
        wrong[i] = "1" if solution[i] != "1" else "2"
    assert task.reward(f"<answer>{''.join(wrong)}</answer>", ex).score == pytest.approx((len(blanks) - 2) / len(blanks))
    short = solution[:blanks[-1]]  # padded with 0 from the last blank on
    right = sum(1 for i in blanks if i < blanks[-1])
    assert task.reward(f"<answer>{short}</answer>", ex).score == pytest.approx(right / len(blanks))
    assert task.reward(solution, ex).score == 0.0  # no answer tags


@pytest.mark.parametrize("completion, value", [
    ("<answer>3*5+7</answer>", 1.0), ("<answer> (7 + 3*5) </answer>", 1.0), ("<answer>3+5+7</answer>", 0.1),
    ("<answer>3*5</answer>", 0.1), ("<answer>3*5+8</answer>", 0.1), ("<answer>3/(5-5)+7</answer>", 0.1),
    ("3*5+7", 0.0),
])
def test_d1_countdown_gives_one_a_tenth_or_nothing(completion, value):
    task = build_task("countdown", reward_style="d1")
    from dllm_rl.data.task import Example

    ex = Example("countdown", "u", "q", "3*5+7", {"numbers": [3, 5, 7], "target": 22})
    assert task.reward(completion, ex).score == pytest.approx(value)


def file_task(name: str, tmp_path) -> tuple:
    rows = {"gsm8k": {"question": "How many?", "answer": "Count them.\n#### 72"},
            "math500": {"problem": "Half of one?", "solution": "It is $\\frac{1}{2}$.", "answer": "\\frac{1}{2}"}}
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps(rows[name]) + "\n")
    task = build_task(name, test_file=str(path), reward_style="d1")
    return task, task.examples("test", 1, 0)[0]


@pytest.mark.parametrize("completion, value", [
    ("<reasoning>\nadd\n</reasoning>\n<answer>\n72\n</answer>\n", 2.0 + 0.5 + 0.5 + 0.5 + 0.5),  # everything
    ("<reasoning>add</reasoning> <answer>72</answer> and more", 2.0 + 0.5 + 0.5),  # soft format, no xml terms
    ("<answer>\n7.2\n</answer>", 0.125 + 0.001),  # only "\n</answer>", with -1 trailing characters
    ("<reasoning>\nadd\n</reasoning>\n<answer>\n72\n</answer>\nextra", 2.0 + 0.5 + 0.5 + 0.125 * 2
     + (0.125 - 0.005) + (0.125 - 0.005)),  # the trailing "extra" costs 0.001 a character, twice; not strict
])
def test_d1_gsm8k_is_the_sum_of_its_five_terms(tmp_path, completion, value):
    task, ex = file_task("gsm8k", tmp_path)
    assert task.reward(completion, ex).score == pytest.approx(value)


def test_the_format_checks_match_their_regular_expressions():
    import re

    strict = re.compile(r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$", re.DOTALL)
    soft = re.compile(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", re.DOTALL)
    texts = ["<reasoning>\n\n</reasoning>\n<answer>\n\n</answer>\n",
             "<reasoning>\n</reasoning>\n<answer>\n\n</answer>\n",
             "<reasoning>a</reasoning>x</reasoning>\n<answer>b</answer>", "<reasoning>a</reasoning><answer>b",
             "<reasoning>\na\n</reasoning>\n<answer>\nb\n</answer>\n\n", " <reasoning>a</reasoning><answer>b</answer>",
             "<reasoning>a</reasoning> \n <answer></answer>", "<reasoning>\na\n</reasoning>\n<answer>\n</answer>\n"]
    for text in texts:
        assert strict_format(text) == bool(strict.match(text)), text
        assert soft_format(text) == bool(soft.match(text)), text
    import random

    rng, pieces = random.Random(0), ["<reasoning>", "</reasoning>", "<answer>", "</answer>", "\n", " ", "a"]
    for _ in range(3000):  # random arrangements of the pieces the patterns are made of
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        assert strict_format(text) == bool(strict.match(text)), repr(text)
        assert soft_format(text) == bool(soft.match(text)), repr(text)
    hostile = "<reasoning>" + "</reasoning>" * 50_000  # linear, not quadratic
    assert not soft_format(hostile) and xml_count(hostile) == 0.125 * 0


@pytest.mark.parametrize("completion, value", [
    ("<reasoning>r</reasoning><answer>\\boxed{\\frac{1}{2}}</answer>", 2.5), ("<answer>0.5</answer>", 2.0),
    ("<answer>\\boxed{3}</answer>", 0.5), ("\\boxed{1/2}", 2.0), ("no answer", 0.0),
])
def test_d1_math_is_two_for_the_answer_and_half_for_a_boxed_one(tmp_path, completion, value):
    task, ex = file_task("math500", tmp_path)
    assert task.reward(completion, ex).score == pytest.approx(value)


def test_a_reward_style_that_does_not_exist_is_named():
    with pytest.raises(ConfigError, match=r"task.reward_style='d2': expected one of \['default', 'd1'\]"):
        build_task("sudoku", reward_style="d2")


# the recipes built on d1's code (d1's own, ERILS's, SPG's): d1's prompts, rewards and rollout lengths
D1_RECIPES = sorted(p.stem for p in RECIPES.glob("*.yaml")
                    if to_plain(compose_config("train", [f"+experiment={p.stem}"]))["task"].get("reward_style") == "d1")


def test_the_d1_recipes_are_found():
    assert {"llada8b_d1", "dream7b_d1", "llada8b_erils", "llada8b_spg"} <= set(D1_RECIPES)


@pytest.mark.parametrize("recipe", D1_RECIPES)
@pytest.mark.parametrize("task", D1_TASKS)
def test_every_recipe_with_every_task_it_names_trains_with_d1s_prompts_rewards_and_lengths(recipe, task, tmp_path):
    text = (RECIPES / f"{recipe}.yaml").read_text()
    named = text.split("defaults:")[0]
    assert all(t in named.lower() for t in ("gsm8k",)) and ("MATH500" in named or "llada8b_d1" in text), recipe
    cfg = to_plain(compose_config("train", [f"+experiment={recipe}", f"task={task}"]))
    assert cfg["task"]["prompt_style"] == "d1" and cfg["task"]["reward_style"] == "d1"
    rollout = cfg["rollout"]
    assert (rollout["gen_length"], rollout["block_length"], rollout["steps"],
            rollout["temperature"]) == (256, 32, 128, 0.9)
    options = dict(cfg["task"])
    name = options.pop("name")
    if name in ("gsm8k", "math500"):
        built, ex = file_task(name, tmp_path)
        built = build_task(name, **{**options, "test_file": built.test_file})
    else:
        built = build_task(name, **options)
        ex = built.examples("test", 1, 0)[0]
    assert "<reasoning>" in built.prompt(ex)  # d1's format instructions
    best = {"gsm8k": f"<reasoning>\nr\n</reasoning>\n<answer>\n{ex.answer}\n</answer>\n",
            "math500": f"<reasoning>\nr\n</reasoning>\n<answer>\n\\boxed{{{ex.answer}}}\n</answer>\n",
            "countdown": f"<answer>{ex.answer}</answer>", "sudoku": f"<answer>{ex.answer}</answer>"}[name]
    assert built.reward(best, ex).score == {"gsm8k": 4.0, "math500": 2.5, "countdown": 1.0, "sudoku": 1.0}[name]
