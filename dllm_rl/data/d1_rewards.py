"""The rewards d1 trains with (arXiv 2504.12216, its diffu-GRPO reward functions), as `task.reward_style=d1`.

This project's default rewards are 1 for a correct answer (plus `format_weight` for a well-formed `<answer>`
tag). d1 uses other scales and partial credit, and its published numbers come from them:

- **Sudoku**: the digits inside the last `<answer>` tags (anything else dropped), cut or padded with 0 to 16
  cells; the reward is the fraction of the puzzle's blank cells that hold the solution's digit.
- **Countdown**: 1.0 when the last `<answer>` holds an equation that uses exactly the given numbers and equals
  the target (within 1e-5); 0.1 when it holds an equation that uses other numbers, does not evaluate, or
  misses the target; 0 when there is none.
- **GSM8K**: the sum of five terms: 2.0 when the text of the last `<answer>` equals the reference answer; 0.5
  when that text is a whole number (digits only); 0.5 for the strict format (the whole completion is
  `<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n`); 0.5 for the soft format (it starts
  with `<reasoning>...</reasoning>`, then whitespace, then `<answer>...</answer>`); and up to 0.5 for the
  tags, 0.125 for each of `<reasoning>\\n`, `\\n</reasoning>\\n`, `\\n<answer>\\n` and `\\n</answer>` found
  exactly once, less 0.001 per character after the closing answer tag.
- **MATH500**: 2.0 for a correct final answer (the `\\boxed{}` inside the answer, compared by
  `math_equal`: d1 compares normalised strings with the MATH graders' `is_equiv`, which accepts fewer
  spellings of the same value), plus 0.5 when the `<answer>` holds a `\\boxed{}`.

`correct` is the task's notion of a solved problem (the full score of the correctness term); `formatted` is
the format term. Every check is a linear scan of the completion (no backtracking regular expressions).
"""

from __future__ import annotations

from dllm_rl.data.answers import CLOSE, OPEN, extract_boxed
from dllm_rl.data.task import Reward

REWARD_STYLES = ("default", "d1")


def check_reward_style(style: str) -> None:
    from dllm_rl.errors import require

    require(style in REWARD_STYLES, f"task.reward_style={style!r}: expected one of {list(REWARD_STYLES)}")


def last_answer_text(completion: str) -> str | None:
    """What d1 reads as the answer: the text after the last `<answer>` up to the next `</answer>` (or the end),
    stripped; None without an `<answer>` tag."""
    start = completion.rfind(OPEN)
    if start < 0:
        return None
    rest = completion[start + len(OPEN):]
    end = rest.find(CLOSE)
    return (rest if end < 0 else rest[:end]).strip()


def tagged_answer(completion: str) -> str | None:
    """The content of the last complete `<answer>...</answer>` pair (d1's regular expression takes the last)."""
    end = completion.rfind(CLOSE)
    start = completion.rfind(OPEN, 0, end) if end >= 0 else -1
    return None if start < 0 else completion[start + len(OPEN):end].strip()


def d1_sudoku(completion: str, puzzle: str, solution: str) -> Reward:
    answer = tagged_answer(completion)
    if answer is None:
        return Reward(0.0, False, False, "no <answer> tag")
    digits = "".join(c for c in answer if c.isdigit())
    if not digits:
        return Reward(0.0, False, True, "no digits in the answer")
    cells = (digits + "0" * 16)[:16]
    blanks = [i for i, c in enumerate(puzzle) if c == "0"]
    share = sum(cells[i] == solution[i] for i in blanks) / len(blanks) if blanks else 0.0
    return Reward(share, share == 1.0, True, "ok" if share == 1.0 else f"{share:.2f} of the blanks right")


def d1_countdown(completion: str, numbers: list[int], target: int) -> Reward:
    from dllm_rl.data.countdown import ExpressionError, evaluate, parse_expression

    equation = tagged_answer(completion)
    if equation is None:
        return Reward(0.0, False, False, "no <answer> tag")
    used = sorted(int(n) for n in "".join(c if c.isdigit() else " " for c in equation).split())
    if used != sorted(numbers):
        return Reward(0.1, False, True, f"uses {used}, expected each of {sorted(numbers)} once")
    try:
        value = evaluate(parse_expression(equation))
    except (ExpressionError, RecursionError, ZeroDivisionError) as error:
        return Reward(0.1, False, True, f"does not evaluate ({error})")
    if abs(float(value) - target) >= 1e-5:
        return Reward(0.1, False, True, f"evaluates to {value}, not {target}")
    return Reward(1.0, True, True, "ok")


def strict_format(text: str) -> bool:
    """`^<reasoning>\\n.*?\\n</reasoning>\\n<answer>\\n.*?\\n</answer>\\n$` with DOTALL (where `$` also matches
    before one final newline)."""
    head, middle, tail = "<reasoning>\n", "\n</reasoning>\n<answer>\n", "\n</answer>\n"
    if not text.startswith(head):
        return False
    at = text.find(middle, len(head))
    ends = [len(text)] + ([len(text) - 1] if text.endswith("\n") else [])  # `$` also matches before a final \n
    return at >= 0 and any(text[:end].endswith(tail) and at + len(middle) <= end - len(tail) for end in ends)


def soft_format(text: str) -> bool:
    """`<reasoning>.*?</reasoning>\\s*<answer>.*?</answer>` matched from the start of the completion."""
    if not text.startswith("<reasoning>"):
        return False
    last_close = text.rfind(CLOSE)
    at = text.find("</reasoning>", len("<reasoning>"))
    while at >= 0:
        after = at + len("</reasoning>")
        while after < len(text) and text[after].isspace():
            after += 1
        if text.startswith(OPEN, after):
            return last_close >= after + len(OPEN)
        at = text.find("</reasoning>", at + 1)
    return False


def xml_count(text: str) -> float:
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125 - len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125 - (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def d1_gsm8k(completion: str, answer: str) -> Reward:
    extracted = last_answer_text(completion)
    extracted = "" if extracted is None else extracted
    correct = extracted == answer
    strict, soft = strict_format(completion), soft_format(completion)
    total = 2.0 * correct + 0.5 * extracted.isdigit() + 0.5 * strict + 0.5 * soft + xml_count(completion)
    return Reward(total, correct, strict or soft, "ok" if correct else f"answer {extracted[:32]!r}, not {answer!r}")


def d1_math(completion: str, answer: str, equal) -> Reward:
    """`equal(prediction, reference) -> (bool, reason)` compares the final answers."""
    tagged = tagged_answer(completion)
    boxed_in_answer = tagged is not None and extract_boxed(tagged)[0] is not None
    final = extract_boxed(completion)[0]
    if final is None:
        final = tagged
    correct, reason = (False, "no final answer") if final is None else equal(final, answer)
    return Reward(2.0 * correct + 0.5 * boxed_in_answer, correct, boxed_in_answer, reason)
