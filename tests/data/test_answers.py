import pytest

from dllm_rl.data.answers import extract_boxed, extract_final_answer, extract_hash, extract_tag, is_formatted


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>42</answer>", "42"),
        ("<reasoning>x</reasoning>\n<answer>\n 3*5+7 \n</answer>", "3*5+7"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),  # the last complete pair wins
        ("<answer>1</answer><answer>2", "1"),  # an unclosed trailing tag is ignored
        ("no tags", None),
        ("<answer>5", None),
        ("5</answer>", None),
        ("<answer>   </answer>", None),
    ],
)
def test_extract_tag(text, expected):
    answer, reason = extract_tag(text)
    assert answer == expected
    assert (reason == "ok") == (expected is not None)


def test_extract_tag_reasons_name_the_problem():
    assert extract_tag("<answer>5")[1] == "no </answer> tag"
    assert extract_tag("5</answer>")[1] == "unbalanced tags: </answer> without <answer>"
    assert extract_tag("")[1] == "no <answer> tag"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{12}.", "12"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{1} and \\boxed{\\sqrt{2}}", "\\sqrt{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("\\boxed 5", None),
        ("nothing", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text)[0] == expected


def test_extract_hash_and_final_answer_priority():
    assert extract_hash("work\n#### 1,234\n")[0] == "1,234"
    assert extract_hash("####")[0] is None
    # <answer> first (unwrapping a box inside it), then \boxed, then ####.
    assert extract_final_answer("\\boxed{1} <answer>\\boxed{2}</answer>")[0] == "2"
    assert extract_final_answer("<answer>3</answer> #### 4")[0] == "3"
    assert extract_final_answer("\\boxed{5} #### 4")[0] == "5"
    assert extract_final_answer("#### 4")[0] == "4"
    assert extract_final_answer("nothing") == (None, "no <answer> tag")


def test_format_reward():
    assert is_formatted("<reasoning>r</reasoning><answer>x</answer>")
    assert not is_formatted("<answer>x</answer><answer>y</answer>")
    assert not is_formatted("</answer>x<answer>")
    assert not is_formatted("<answer></answer>")
    assert not is_formatted("x")


def test_extraction_is_linear_on_hostile_input():
    # 10^5 unmatched opening tags: a backtracking regex would be quadratic here.
    text = "<answer>" * 100_000
    assert extract_tag(text)[0] is None
    assert extract_final_answer(text + "\\boxed{" * 50_000)[0] is None
