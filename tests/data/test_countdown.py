from fractions import Fraction

import pytest

from dllm_rl.data.countdown import (
    Countdown, ExpressionError, countdown_reward, evaluate, literals, parse_expression, solve_aligned,
    solve_countdown, to_text,
)
from dllm_rl.data.task import Example, Solution, render_completion
from dllm_rl.data.tokenizers import build_char_tokenizer
from dllm_rl.sft import solver_examples
from dllm_rl.errors import ConfigError


def answer(expr: str) -> str:
    return f"<reasoning>x</reasoning>\n<answer>\n{expr}\n</answer>"


@pytest.mark.parametrize(
    "expr, numbers, target, correct",
    [
        ("3*5+7", [3, 5, 7], 22, True),
        ("7 + 5 * 3", [3, 5, 7], 22, True),        # precedence: 5*3 first
        ("(7+5)*3", [3, 5, 7], 36, True),
        ("(7+5)*3", [3, 5, 7], 22, False),         # evaluates to 36
        ("3*5+7", [3, 5, 7, 2], 22, False),        # 2 unused
        ("3*5+7+7", [3, 5, 7], 29, False),         # 7 used twice
        ("8/(3-8/3)", [8, 3, 8, 3], 24, True),     # needs exact rational arithmetic: 8/(1/3) = 24
        ("6/4*2", [6, 4, 2], 3, True),             # (6/4)*2, left to right
        ("6/(4*2)", [6, 4, 2], 3, False),          # 3/4
        ("-3+5+2", [3, 5, 2], 4, False),           # unary minus is not one of the operations
        ("3*5+7=22", [3, 5, 7], 22, False),        # no equals sign
    ],
)
def test_countdown_reward_hand_cases(expr, numbers, target, correct):
    reward = countdown_reward(answer(expr), numbers, target)
    assert reward.correct is correct
    assert reward.score == (1.0 if correct else 0.0)
    assert reward.formatted
    assert (reward.reason == "ok") is correct


def test_countdown_reasons_and_format_weight():
    assert (countdown_reward(answer("3*5"), [3, 5, 7], 15).reason
            == "uses [3, 5], expected each of [3, 5, 7] exactly once")
    assert countdown_reward(answer("7/(5-5)"), [7, 5, 5], 1).reason == "division by zero"
    assert countdown_reward(answer("3+5+7"), [3, 5, 7], 16).reason == "evaluates to 15, not 16"
    # format_weight adds to the score for a well-formed answer, whether right or wrong (d1 gives 0.1).
    assert countdown_reward(answer("3+5+7"), [3, 5, 7], 16, format_weight=0.1).score == pytest.approx(0.1)
    assert countdown_reward(answer("3+5+7"), [3, 5, 7], 15, format_weight=0.1).score == pytest.approx(1.1)
    assert countdown_reward("3+5+7", [3, 5, 7], 15, format_weight=0.1).score == 0.0


def test_parser_and_printer_agree():
    for text in ["1+2*3", "(1+2)*3", "1-(2-3)", "1-2-3", "8/(4/2)", "8/4/2", "2*(3/4)", "1+(2-3)"]:
        tree = parse_expression(text)
        assert evaluate(parse_expression(to_text(tree))) == evaluate(tree)
    assert evaluate(parse_expression("1-(2-3)")) == 2
    assert evaluate(parse_expression("8/4/2")) == 1
    assert to_text(parse_expression("1-(2-3)")) == "1-(2-3)"
    assert to_text(parse_expression("1+(2-3)")) == "1+2-3"
    with pytest.raises(ExpressionError, match="missing"):
        parse_expression("(1+2")


def test_solver_finds_a_correct_expression_or_none():
    tree = solve_countdown([8, 3, 8, 3], 24)
    assert tree is not None and evaluate(tree) == 24
    assert sorted(literals(tree)) == [3, 3, 8, 8]
    assert solve_countdown([1, 1, 1], 100) is None  # at most (1+1)*... = 3: unsolvable
    assert evaluate(solve_countdown([2, 3], Fraction(2, 3))) == Fraction(2, 3)


def test_the_in_order_solver_keeps_the_numbers_in_the_order_given():
    # Hand-checked: 5-(9-7) = 3 keeps [5, 9, 7], where the free solver writes 7-(9-5).
    assert to_text(solve_countdown([5, 9, 7], 3, keep_order=True)) == "5-(9-7)"
    assert to_text(solve_countdown([83, 64, 4], 15, keep_order=True)) == "83-64-4"
    assert to_text(solve_countdown([3, 5, 9], 7, keep_order=True)) == "3-5+9"   # a negative intermediate
    assert solve_countdown([2, 2, 3], 2, keep_order=True) is None      # only 3-2/2: no tree keeps 2, 2, 3
    assert to_text(solve_countdown([2, 2, 3], 2)) == "3-2/2"
    assert_solver_style_keeps_order("in_order")


def test_the_aligned_solver_writes_the_numbers_in_order_without_brackets():
    # Hand-checked, operators tried in the order + - * /: 83+64+4, 83+64-4, ... 83-64-4 = 15 is the first.
    assert solve_aligned([83, 64, 4], 15) == "83 -64 -4"
    assert solve_aligned([80, 1, 20], 60) == "80 -1 *20"        # precedence: 80-(1*20), no brackets needed
    assert solve_aligned([5, 9, 7], 3) == "5 -9 +7"             # a negative intermediate
    assert solve_aligned([2, 3, 4], 20) is None                # (2+3)*4 keeps the order but needs brackets
    assert to_text(solve_countdown([2, 3, 4], 20, keep_order=True)) == "(2+3)*4"
    assert solve_aligned([2, 2, 3], 2) is None
    assert solve_aligned([6, 3, 0], 2) == "6 /3 +0"             # 6+3/0 and the like are skipped, not an error
    assert_solver_style_keeps_order("aligned", brackets=False)


def assert_solver_style_keeps_order(style: str, brackets: bool = True):
    task, free = Countdown(solver_style=style), Countdown()
    examples = task.examples("train", 300, seed=1)
    solved = 0
    for ex in examples:
        solution = task.solve(ex)
        if solution is None:
            continue
        solved += 1
        assert literals(parse_expression(solution.answer)) == ex.meta["numbers"]
        assert brackets or "(" not in solution.answer
        assert task.reward(render_completion(solution), ex).correct
        assert free.solve(ex) is not None
    assert 0.4 < solved / len(examples) < 0.8
    styles = "\\('free', 'in_order', 'aligned', 'aligned_first'\\)"
    with pytest.raises(ConfigError, match=f"solver_style must be one of {styles}, got 'yes'"):
        Countdown(solver_style="yes")


def test_aligned_first_answers_every_instance_in_the_prompts_order_where_it_can():
    # Hand-checked: [83, 64, 4] -> 15 has an aligned answer; [2, 3, 4] -> 20 has none, but (2+3)*4 keeps the order.
    # The rest need another order: the free solver's tree, spaced the same way.
    task = Countdown(solver_style="aligned_first")
    assert task.solve(Example("countdown", "a", "", "", {"numbers": [83, 64, 4], "target": 15})).answer == "83 -64 -4"
    assert task.solve(Example("countdown", "b", "", "", {"numbers": [2, 3, 4], "target": 20})).answer == "(2 +3) *4"
    examples = task.examples("train", 300, seed=1)
    aligned, in_order, free = Countdown(solver_style="aligned"), Countdown(solver_style="in_order"), Countdown()
    kinds = {"aligned": 0, "in_order": 0, "free": 0}
    for ex in examples:
        solution = task.solve(ex)  # every generated instance is solvable, and every one is answered
        assert task.reward(render_completion(solution), ex).correct
        assert all(solution.answer[i - 1] == " " for i, c in enumerate(solution.answer) if c in "+-*/")
        assert sorted(literals(parse_expression(solution.answer))) == sorted(ex.meta["numbers"])
        if aligned.solve(ex) is not None:
            assert solution.answer == aligned.solve(ex).answer
            kinds["aligned"] += 1
        elif in_order.solve(ex) is not None:
            assert solution.answer.replace(" ", "") == in_order.solve(ex).answer
            kinds["in_order"] += 1
        else:
            assert solution.answer.replace(" ", "") == free.solve(ex).answer
            kinds["free"] += 1
    assert kinds["aligned"] > 0.4 * len(examples) and kinds["in_order"] > 0 and kinds["free"] > 0.2 * len(examples)


def test_aligned_answers_copy_the_prompt_digits_from_one_distance_with_single_digits_padded():
    # The reason for the aligned style: with every number below 100 written as two digits (the embedded
    # dLLM's tokenizer), each digit of the answer is the digit a fixed number of tokens earlier in the
    # prompt, the same distance for every digit and every prompt.
    tokenizer, task = build_char_tokenizer(pad_single_digits=True), Countdown(solver_style="aligned", max_target=99)
    distances = set()
    for example in solver_examples(task, 60, seed=2, with_steps=False, print_fn=lambda *_: None):  # SFT texts
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(example.prompt + example.completion)["input_ids"])
        digits = [i for i, t in enumerate(tokens) if t.isdigit()]
        assert len(digits) == 3 * 2 + 2 + 3 * 2                                # numbers, target, answer
        for a, b in zip(digits[:6], digits[8:]):
            assert tokens[a] == tokens[b]
            distances.add(b - a)
    assert len(distances) == 1


def test_generated_instances_are_solvable_and_in_range():
    task = Countdown(num_numbers=(3, 4))
    for ex in task.examples("train", 300, seed=3):
        numbers, target = ex.meta["numbers"], ex.meta["target"]
        assert len(numbers) in (3, 4) and all(1 <= x <= 99 for x in numbers)
        assert 1 <= target <= 100
        solution = task.solve(ex)
        assert task.reward(render_completion(solution), ex).correct
        assert task.reward(render_completion(Solution(ex.answer), "compact"), ex).correct


def test_prompt_styles():
    ex = Countdown().examples("train", 1, 0)[0]
    d1 = Countdown(prompt_style="d1").prompt(ex)
    assert str(ex.meta["numbers"]) in d1 and "<answer>" in d1 and "<reasoning>" in d1
    assert Countdown().prompt(ex) == f"Countdown. {ex.question}\n"


def test_an_unreachable_target_range_is_a_named_error_not_an_endless_loop(capsys):
    from dllm_rl import cli

    with pytest.raises(ConfigError, match=r"no instance can reach a target in \[101, 101\]: .* 2 numbers of at most "
                                          r"10 make at most 100"):
        Countdown(num_numbers=(2,), max_number=10, min_target=101, max_target=101)
    assert cli.main(["tasks", "task=countdown", "task.num_numbers=[2]", "task.max_number=10", "task.min_target=101",
                     "task.max_target=101"]) == 2
    assert "no instance can reach" in capsys.readouterr().err


def test_a_reachable_but_rare_target_range_fails_within_the_draw_bound():
    task = Countdown(min_target=970299, max_target=970299)  # only 99 * 99 * 99 reaches it
    with pytest.raises(ConfigError, match=r"could only generate 0 distinct train examples of 'countdown' out of "
                                          r"n=2 asked in 1400 random draws"):
        task.examples("train", 2, 0)
