import pytest

from dllm_rl.data.arithmetic import Arithmetic, arithmetic_reward, evaluate_steps


def test_evaluate_steps_respects_precedence():
    # 347 + 58 * 26 - 9 = 347 + 1508 - 9 = 1846
    value, steps = evaluate_steps([347, 58, 26, 9], ["+", "*", "-"])
    assert value == 1846
    assert steps == ["58*26=1508", "347+1508=1855", "1855-9=1846"]
    assert evaluate_steps([2, 3, 4], ["*", "*"]) == (24, ["2*3=6", "6*4=24"])
    assert evaluate_steps([5, 7], ["-"]) == (-2, ["5-7=-2"])


@pytest.mark.parametrize(
    "inner, correct",
    [("1846", True), ("1,846", True), ("+1846", True), (" 1846 ", True), ("1846.0", False),
     ("1845", False), ("١٨٤٦", False), ("1846 apples", False), ("9" * 5000, False)],
)
def test_arithmetic_reward(inner, correct):
    reward = arithmetic_reward(f"<answer>{inner}</answer>", 1846)
    assert reward.correct is correct
    assert reward.score == float(correct)


def test_generated_expressions_match_their_answers():
    task = Arithmetic(digits=(2, 4), num_operands=(2, 4))
    for ex in task.examples("train", 200, 0):
        operands = ex.meta["operands"]
        assert all(10 <= x <= 9999 for x in operands)
        assert 2 <= len(operands) <= 4
        # Python's own evaluation of the expression is an independent reference here (trusted input).
        assert int(ex.answer) == eval(ex.question)  # noqa: S307


def test_the_longest_reference_answers_of_the_task_ranges_score_one():
    task = Arithmetic(digits=12, num_operands=8, ops="*")  # the largest values the ranges allow: up to 96 digits
    examples = task.examples("train", 20, 0)
    assert max(len(ex.answer) for ex in examples) > 90
    assert all(task.reward(f"<answer>{ex.answer}</answer>", ex).correct for ex in examples)
