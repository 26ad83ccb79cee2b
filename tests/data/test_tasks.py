"""Properties every task must have: reference answers score 1, splits are disjoint, generation is
deterministic, and hostile completions score 0 with a reason, without raising or hanging."""

import threading

import pytest

from dllm_rl.data import TASKS, build_task
from dllm_rl.data.task import Solution, in_test_split, render_completion, render_prompt
from dllm_rl.data.tokenizers import SIMPLE_CHAT_TEMPLATE, build_char_tokenizer

PROCEDURAL = ["countdown", "sudoku", "arithmetic"]


@pytest.mark.parametrize("name", PROCEDURAL)
def test_reference_answers_of_1000_instances_score_one(name):
    task = build_task(name)
    for split in ("train", "test"):
        examples = task.examples(split, 1000, seed=0)
        assert len({ex.uid for ex in examples}) == 1000
        for style in ("d1", "compact"):
            rewards = [task.reward(render_completion(Solution(ex.answer), style), ex) for ex in examples]
            assert all(r.score == 1.0 and r.correct and r.formatted for r in rewards)


@pytest.mark.parametrize("name", PROCEDURAL)
def test_solver_solves_generated_instances(name):
    task = build_task(name)
    for ex in task.examples("train", 200, seed=1):
        assert task.reward(render_completion(task.solve(ex)), ex).correct


@pytest.mark.parametrize("name", PROCEDURAL)
def test_splits_are_disjoint_and_follow_the_hash_rule(name):
    task = build_task(name)
    train = {ex.uid for seed in (0, 1) for ex in task.examples("train", 500, seed)}
    test = {ex.uid for seed in (0, 1) for ex in task.examples("test", 500, seed)}
    assert not train & test
    assert all(in_test_split(name, uid, 0.1) for uid in test)
    assert not any(in_test_split(name, uid, 0.1) for uid in train)


@pytest.mark.parametrize("name", PROCEDURAL)
def test_generation_is_deterministic_for_a_seed(name):
    task = build_task(name)
    assert task.examples("train", 50, seed=7) == task.examples("train", 50, seed=7)
    assert task.examples("train", 50, seed=7) != task.examples("train", 50, seed=8)


def test_too_small_a_problem_space_fails_clearly():
    task = build_task("arithmetic", digits=1, num_operands=2, ops="+")
    with pytest.raises(ValueError, match="could only generate"):
        task.examples("train", 500, 0)  # only 10 * 10 = 100 distinct sums exist


HOSTILE = [
    "",
    "<answer></answer>",
    "<answer>" * 20_000,
    "</answer>" * 20_000,
    "<answer>9**9**9</answer>",
    "<answer>9^{9^{9}}</answer>",
    "<answer>" + "9" * 100_000 + "</answer>",
    "<answer>1e999999999</answer>",
    "<answer>1/0</answer>",
    "<answer>" + "(" * 5000 + "1" + ")" * 5000 + "</answer>",
    "<answer>" + "(" * 30 + "1" + ")" * 30 + "</answer>",
    "<answer>٣+٤</answer>",
    "<answer>\\boxed{\\frac{1}{0}}</answer>",
    "<answer>\\boxed{",
    "<answer>" + "\\sqrt{" * 200 + "2" + "}" * 200 + "</answer>",
    "\x00\udcff<answer>\ud800</answer>",
]


def run_with_deadline(fn, seconds: float):
    """Run fn in a thread; fail (instead of hanging the suite) if it does not return in time."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "reward did not return"
    return box["value"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TASKS))
def test_hostile_completions_score_zero_with_a_reason(name, fixtures):
    files = {"gsm8k": "gsm8k_train.jsonl", "math500": "math500_test.jsonl"}
    kwargs = {"train_file": str(fixtures / files[name]), "symbolic_timeout_s": 1.0} if name in files else {}
    if name == "gsm8k":
        kwargs.pop("symbolic_timeout_s")
    task = build_task(name, **kwargs)
    ex = task.examples("train", 1, 0)[0]
    for completion in HOSTILE:
        reward = run_with_deadline(lambda: task.reward(completion, ex), seconds=60)
        assert reward.score == 0.0 and not reward.correct, completion[:40]
        assert reward.reason and reward.reason != "ok"


def test_render_prompt_uses_the_chat_template():
    plain = build_char_tokenizer()
    chat = build_char_tokenizer(chat_template=SIMPLE_CHAT_TEMPLATE)
    assert render_prompt("2+2?", plain) == "2+2?"
    assert render_prompt("2+2?", None, system_prompt="Be brief.") == "Be brief.\n2+2?"
    assert render_prompt("2+2?", chat) == "User: 2+2?\nAssistant: "
    assert render_prompt("2+2?", chat, system_prompt="Be brief.") == "Be brief.\nUser: 2+2?\nAssistant: "
