import pytest

from dllm_rl.data import build_task
from dllm_rl.errors import ConfigError


def gsm8k(fixtures, **kw):
    return build_task("gsm8k", train_file=str(fixtures / "gsm8k_train.jsonl"),
                      test_file=str(fixtures / "gsm8k_test.jsonl"), **kw)


def test_gsm8k_reads_the_public_format(fixtures):
    task = gsm8k(fixtures)
    train = task.examples("train", None, 0)
    test = task.examples("test", None, 0)
    assert [ex.answer for ex in test] == ["12", "3"]
    # The train file's "Tom has 5 apples" duplicates a test question (up to whitespace): dropped from train.
    assert len(train) == 3
    assert not {ex.uid for ex in train} & {ex.uid for ex in test}
    answers = {ex.answer for ex in train}
    assert answers == {"72", "10", "2000"}  # "#### 2,000" -> "2000"
    natalia = next(ex for ex in train if ex.answer == "72")
    assert natalia.meta["solution"].endswith("72 clips altogether in April and May.")


@pytest.mark.parametrize(
    "completion, correct",
    [("<answer>72</answer>", True), ("<answer>72.00</answer>", True), ("<answer>\\boxed{72}</answer>", True),
     ("so #### 72", True), ("<answer>73</answer>", False), ("<answer>seventy-two</answer>", False), ("", False)],
)
def test_gsm8k_reward(fixtures, completion, correct):
    task = gsm8k(fixtures)
    ex = next(ex for ex in task.examples("train", None, 0) if ex.answer == "72")
    assert task.reward(completion, ex).correct is correct


def test_one_file_is_hash_split_only_when_test_fraction_asks(fixtures):
    task = build_task("gsm8k", train_file=str(fixtures / "gsm8k_train.jsonl"), test_fraction=0.5)
    train, test = task.examples("train", None, 0), task.examples("test", None, 0)
    assert len(train) + len(test) == 4 and train and test
    assert not {ex.uid for ex in train} & {ex.uid for ex in test}
    assert task.describe_splits() == (f"gsm8k: task.train_file hash-split with task.test_fraction=0.5: train "
                                      f"{len(train)} problems, test {len(test)}")


def test_a_file_given_for_one_split_is_that_whole_split(fixtures):
    """Only a test file (GSM8K's or MATH500's test set): every problem is scored, and there is no train split;
    only a train file: every problem trains, none is held back."""
    only_test = build_task("math500", test_file=str(fixtures / "math500_test.jsonl"))
    assert len(only_test.examples("test", None, 0)) == 6
    assert only_test.describe_splits(("test",)) == "math500: task.test_file is the whole test split (6 problems)"
    with pytest.raises(ConfigError, match="math500: there is no train split: only task.test_file is set"):
        only_test.examples("train", 1, 0)
    with pytest.raises(ConfigError, match="there is no train split"):
        only_test.describe_splits(("train", "test"))
    only_train = build_task("gsm8k", train_file=str(fixtures / "gsm8k_train.jsonl"))
    assert len(only_train.examples("train", None, 0)) == 4
    with pytest.raises(ConfigError, match="there is no test split.*task.test_fraction.*or eval_every=0"):
        only_train.examples("test", None, 0)
    assert gsm8k(fixtures).describe_splits(("train", "test")) == (
        "gsm8k: the files are the splits: train 3 problems from task.train_file (1 also in task.test_file dropped), "
        "test 2 from task.test_file")
    with pytest.raises(ConfigError, match="task.test_fraction=0.1 with both task.train_file and task.test_file"):
        gsm8k(fixtures, test_fraction=0.1)


def test_sampling_n_is_deterministic(fixtures):
    task = gsm8k(fixtures)
    assert task.examples("train", 2, 5) == task.examples("train", 2, 5)
    with pytest.raises(ConfigError, match="has only 3 problems"):
        task.examples("train", 10, 0)


@pytest.mark.slow
def test_math500_reward_is_symbolic(fixtures):
    task = build_task("math500", test_file=str(fixtures / "math500_test.jsonl"), test_fraction=0.5)
    examples = {ex.answer: ex for split in ("train", "test") for ex in task.examples(split, None, 0)}
    assert len(examples) == 6
    cases = [
        ("\\frac{3}{4}", "<answer>0.75</answer>", True),
        ("\\frac{3}{4}", "The answer is \\boxed{\\dfrac{3}{4}}.", True),
        ("2\\sqrt{2}", "<answer>\\sqrt{8}</answer>", True),
        ("x^2+2x+1", "<answer>(x+1)^2</answer>", True),
        ("(-1,1)", "<answer>(-1, 1)</answer>", True),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "<answer>(3, \\pi/2)</answer>", True),
        ("4", "<answer>x = 4</answer>", True),
        ("4", "<answer>5</answer>", False),
        ("2\\sqrt{2}", "<answer>2\\sqrt{3}</answer>", False),
    ]
    for ref, completion, correct in cases:
        assert task.reward(completion, examples[ref]).correct is correct, (ref, completion)


def test_bad_files_are_named(fixtures, tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        build_task("gsm8k", train_file=str(tmp_path / "missing.jsonl")).examples("train", None, 0)
    with pytest.raises(ConfigError, match=r"lack the column\(s\) \['question', 'answer'\]"):
        build_task("gsm8k", train_file=str(fixtures / "wrong_columns.jsonl")).examples("train", None, 0)
    with pytest.raises(ConfigError, match="row 0 has no '#### N'"):
        build_task("gsm8k", train_file=str(fixtures / "bad_gsm8k.jsonl")).examples("train", None, 0)
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ConfigError, match="expected a file ending in one of"):
        build_task("gsm8k", train_file=str(tmp_path / "data.txt")).examples("train", None, 0)
    with pytest.raises(ConfigError, match="set task.train_file"):
        build_task("math500")
