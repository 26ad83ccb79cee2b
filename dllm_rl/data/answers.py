"""Answer extraction from completions: `<answer>` tags, `\\boxed{}` and GSM8K's `#### N`.

Pure string functions, linear in the completion length whatever it contains (no backtracking regular
expressions over the whole completion: a hostile completion of 10^5 unmatched `<answer>` tags must not
take quadratic time). Every function returns `(answer, reason)`: the answer or None, and why.
"""

from __future__ import annotations

OPEN, CLOSE = "<answer>", "</answer>"


def extract_tag(text: str) -> tuple[str | None, str]:
    """Content of the last complete `<answer>...</answer>` pair, stripped."""
    end = text.rfind(CLOSE)
    if end < 0:
        return None, "no </answer> tag" if OPEN in text else "no <answer> tag"
    start = text.rfind(OPEN, 0, end)
    if start < 0:
        return None, "unbalanced tags: </answer> without <answer>"
    content = text[start + len(OPEN) : end].strip()
    return (content, "ok") if content else (None, "empty <answer> tag")


def extract_boxed(text: str) -> tuple[str | None, str]:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), with nested braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None, "no \\boxed{}"
    brace = text.find("{", start)
    if brace < 0 or text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None, "\\boxed without {"
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                content = text[brace + 1 : i].strip()
                return (content, "ok") if content else (None, "empty \\boxed{}")
    return None, "unbalanced braces in \\boxed{}"


def extract_hash(text: str) -> tuple[str | None, str]:
    """GSM8K style: what follows the last `####` on its line."""
    i = text.rfind("####")
    if i < 0:
        return None, "no ####"
    content = text[i + 4 :].split("\n", 1)[0].strip()
    return (content, "ok") if content else (None, "empty after ####")


def extract_final_answer(text: str) -> tuple[str | None, str]:
    """The final answer of a math completion: the `<answer>` tag (unwrapping a `\\boxed{}` inside it),
    else the last `\\boxed{}`, else `#### N`."""
    answer, reason = extract_tag(text)
    if answer is not None:
        boxed, _ = extract_boxed(answer)
        return (boxed if boxed is not None else answer), "ok"
    for extract in (extract_boxed, extract_hash):
        other, _ = extract(text)
        if other is not None:
            return other, "ok"
    return None, reason


def is_formatted(text: str) -> bool:
    """Format reward: exactly one `<answer>` tag and one `</answer>` tag, in that order, non-empty."""
    if text.count(OPEN) != 1 or text.count(CLOSE) != 1:
        return False
    answer, _ = extract_tag(text)
    return answer is not None
