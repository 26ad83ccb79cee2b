"""Countdown: combine the given numbers with + - * / to reach a target, each number used exactly once.

Prompt and answer format follow the d1 paper (arXiv 2504.12216), which trains on the 3-number instances of
a Countdown set with numbers below 100 and targets up to 100 (4 numbers are an option here). Instances are generated
from a random expression tree over the drawn numbers (so every instance is solvable), with integer intermediate results
as in the TV game; the reward accepts any expression that reaches the target exactly in rational arithmetic.

The reward parses the expression with a small recursive-descent parser (never `eval`): ASCII digits,
+ - * / and parentheses only, binary operators only (no unary minus: it is not one of the four allowed
operations), bounded length and nesting, and the multiset of numbers checked before anything is computed.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from fractions import Fraction

from dllm_rl.data.d1_rewards import check_reward_style, d1_countdown
from dllm_rl.data.answers import extract_tag, is_formatted
from dllm_rl.data.task import (
    D1_FORMAT, Example, GeneratedTask, Reward, Solution, score,
)
from dllm_rl.errors import require

MAX_EXPRESSION_CHARS = 200
MAX_NESTING = 32
MAX_LITERAL_DIGITS = 6
PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}
SOLVER_STYLES = ("free", "in_order", "aligned", "aligned_first")


class ExpressionError(ValueError):
    pass


# ----------------------------------------------------------------------------------- safe expression parser
# An expression tree is an int (a literal) or a tuple (op, left, right).


def tokenize(text: str) -> list[str]:
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tokens, i = [], 0
    while i < len(text):
        c = text[i]
        if "0" <= c <= "9":
            j = i
            while j < len(text) and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_LITERAL_DIGITS:
                raise ExpressionError(f"number {text[i:j][:12]}... has more than {MAX_LITERAL_DIGITS} digits")
            tokens.append(text[i:j])
            i = j
        elif c in "+-*/()":
            tokens.append(c)
            i += 1
        elif c in " \t\n":
            i += 1
        else:
            raise ExpressionError(f"unexpected character {c!r}")
    return tokens


def parse_expression(text: str):
    """Parse `text` into a tree; raises ExpressionError with a readable reason."""
    tokens = tokenize(text)
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def binary(level: int, depth: int):
        nonlocal pos
        if depth > MAX_NESTING:
            raise ExpressionError(f"nesting deeper than {MAX_NESTING}")
        left = binary(level + 1, depth) if level < 2 else atom(depth)
        while peek() is not None and PRECEDENCE.get(peek()) == level:
            op = tokens[pos]
            pos += 1
            right = binary(level + 1, depth) if level < 2 else atom(depth)
            left = (op, left, right)
        return left

    def atom(depth: int):
        nonlocal pos
        tok = peek()
        if tok is None:
            raise ExpressionError("expression ends early")
        pos += 1
        if tok == "(":
            inner = binary(1, depth + 1)
            if peek() != ")":
                raise ExpressionError("missing ')'")
            pos += 1
            return inner
        if tok.isdigit():
            return int(tok)
        raise ExpressionError(f"unexpected {tok!r}")

    tree = binary(1, 0)
    if pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[pos]!r}")
    return tree


def literals(tree) -> list[int]:
    if isinstance(tree, int):
        return [tree]
    return literals(tree[1]) + literals(tree[2])


def evaluate(tree) -> Fraction:
    if isinstance(tree, int):
        return Fraction(tree)
    op, a, b = tree[0], evaluate(tree[1]), evaluate(tree[2])
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise ExpressionError("division by zero")
    return a / b


def to_text(tree, parent_op: str | None = None, right: bool = False, spaced: bool = False) -> str:
    """Print a tree with only the parentheses that precedence needs; `spaced` writes a space before each
    operator, as solve_aligned does ("(2 +3) *4")."""
    if isinstance(tree, int):
        return str(tree)
    op, a, b = tree
    text = f"{to_text(a, op, spaced=spaced)}{' ' if spaced else ''}{op}{to_text(b, op, right=True, spaced=spaced)}"
    if parent_op is None:
        return text
    looser = PRECEDENCE[op] < PRECEDENCE[parent_op]
    # a-(b+c) and a/(b*c) need brackets; a+(b-c) and a*(b/c) do not.
    right_of_inverse = right and PRECEDENCE[op] == PRECEDENCE[parent_op] and parent_op in "-/"
    return f"({text})" if looser or right_of_inverse else text


# ----------------------------------------------------------------------------------- reward


def countdown_reward(completion: str, numbers: list[int], target: int, format_weight: float = 0.0) -> Reward:
    """1 if the `<answer>` expression uses exactly `numbers` (each once) and equals `target`, else 0."""
    formatted = is_formatted(completion)
    answer, reason = extract_tag(completion)
    if answer is None:
        return Reward(score(0, formatted, format_weight), False, formatted, reason)
    try:
        tree = parse_expression(answer)
        used = sorted(literals(tree))
        if used != sorted(numbers):
            raise ExpressionError(f"uses {used}, expected each of {sorted(numbers)} exactly once")
        value = evaluate(tree)
    except ExpressionError as exc:
        return Reward(score(0, formatted, format_weight), False, formatted, str(exc))
    except RecursionError:
        return Reward(score(0, formatted, format_weight), False, formatted, "expression too deep")
    if value != target:
        return Reward(score(0, formatted, format_weight), False, formatted, f"evaluates to {value}, not {target}")
    return Reward(score(1, formatted, format_weight), True, formatted, "ok")


# ----------------------------------------------------------------------------------- solver


def solve_countdown(numbers: list[int], target: int, keep_order: bool = False) -> tuple | None:
    """Exhaustive search over all ways to combine every number once: a tree, or None if unsolvable.

    Pairs are combined until one value is left (4 numbers: at most 6*6 * 3*6 * 1*6 = 3,888 leaves). The
    first pass keeps intermediates non-negative integers, as a person would write; the second allows any
    rational, which is what the reward accepts, so None means no answer scores 1.

    `keep_order` searches only the trees that write the numbers in the order given (neighbours are
    combined, left operand first): 83-64-4 for [83, 64, 4] -> 15, never 4+83-64. About 60% of the
    default instances have such an answer; None then means none of them does.
    """
    def pairs(items):
        if keep_order:
            for i in range(len(items) - 1):
                yield i, i + 1, items[i], items[i + 1]
            return
        for i, j in itertools.combinations(range(len(items)), 2):
            (a, ta), (b, tb) = items[i], items[j]
            yield (i, j, (a, ta), (b, tb)) if a >= b else (i, j, (b, tb), (a, ta))

    def search(items: list[tuple[Fraction, object]], natural: bool):
        if len(items) == 1:
            return items[0][1] if items[0][0] == target else None
        for i, j, (a, ta), (b, tb) in pairs(items):
            rest = [items[k] for k in range(len(items)) if k not in (i, j)]
            candidates = [(a + b, ("+", ta, tb)), (a * b, ("*", ta, tb))]
            if not natural or a >= b:
                candidates.append((a - b, ("-", ta, tb)))
            if b != 0 and (not natural or a % b == 0):
                candidates.append((a / b, ("/", ta, tb)))
            if not natural and not keep_order:
                candidates.append((b - a, ("-", tb, ta)))
                if a != 0:
                    candidates.append((b / a, ("/", tb, ta)))
            for value, tree in candidates:
                # In a kept order the combined value takes the pair's place; otherwise it goes last.
                combined = rest[:i] + [(value, tree)] + rest[i:] if keep_order else rest + [(value, tree)]
                found = search(combined, natural)
                if found is not None:
                    return found
        return None

    start = [(Fraction(x), x) for x in numbers]
    return search(start, natural=True) or search(start, natural=False)


def solve_aligned(numbers: list[int], target: int) -> str | None:
    """The first bracket-free expression with the numbers in the given order that equals `target`, operators
    tried in the order + - * /, each written with a space before it: "83 -64 -4" for [83, 64, 4] -> 15.
    None if no such expression exists (about 40% of the default instances).

    The spacing makes the answer line up with the prompt's list "[83, 64, 4]": a separator of two
    characters (", " there, " -" here) between the numbers. When every number is written with the same
    number of digits (the embedded dLLM's tokenizer reads 4 as 04), each digit of the answer then sits at
    one fixed distance from the same digit in the prompt, which a small bidirectional model learns to copy
    as it copies Sudoku's given cells.
    """
    for ops in itertools.product("+-*/", repeat=len(numbers) - 1):
        text = str(numbers[0]) + "".join(f" {op}{x}" for op, x in zip(ops, numbers[1:]))
        try:
            if evaluate(parse_expression(text)) == target:
                return text
        except ExpressionError:  # division by zero
            continue
    return None


def steps_of(tree) -> list[str]:
    """The intermediate results of a tree, innermost first: ["3*5=15", "15+7=22"]."""
    if isinstance(tree, int):
        return []
    steps = steps_of(tree[1]) + steps_of(tree[2])
    a, b = evaluate(tree[1]), evaluate(tree[2])
    return steps + [f"{a}{tree[0]}{b}={evaluate(tree)}"]


# ----------------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class Countdown(GeneratedTask):
    name = "countdown"
    num_numbers: tuple[int, ...] = (3,)
    min_number: int = 1
    max_number: int = 99
    min_target: int = 1
    max_target: int = 100
    test_fraction: float = 0.1
    prompt_style: str = "compact"
    format_weight: float = 0.0
    # How the solver (SFT data, the solver external source) writes its answers; the reward accepts any
    # correct expression whatever this is. free: any tree, numbers in any order. in_order: the numbers in
    # the prompt's order, brackets as needed (solve_countdown's keep_order). aligned: the numbers in the
    # prompt's order, no brackets, one space before each operator (solve_aligned). in_order and aligned
    # decline the instances with no such answer (about 40%). aligned_first: the aligned answer where there is
    # one, else the in_order one, else the free one, spaced as aligned ("(2 +3) *4"): every solvable instance.
    solver_style: str = "free"
    reward_style: str = "default"  # default | d1 (dllm_rl/data/d1_rewards.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_numbers", tuple(self.num_numbers))
        require(self.solver_style in SOLVER_STYLES,
                f"solver_style must be one of {SOLVER_STYLES}, got {self.solver_style!r}")
        require(self.num_numbers and all(isinstance(k, int) and 2 <= k <= 6 for k in self.num_numbers),
                f"num_numbers must be a non-empty list of integers in [2, 6], got {list(self.num_numbers)}")
        require(1 <= self.min_number <= self.max_number,
                f"need 1 <= min_number <= max_number, got {self.min_number} and {self.max_number}")
        require(self.min_target <= self.max_target,
                f"need min_target <= max_target, got {self.min_target} and {self.max_target}")
        # + and * trees grow with their leaves (- and / only shrink), so the largest value is that of k copies of
        # max_number: their product for max_number >= 2; (1 + 1) * ... bounds the ones' trees by 2^k - 1
        k = max(self.num_numbers)
        largest = self.max_number ** k if self.max_number >= 2 else 2 ** k - 1
        require(self.max_target >= 1 and self.min_target <= largest,
                f"no instance can reach a target in [{self.min_target}, {self.max_target}]: values are positive "
                f"integers, and {k} numbers of at most {self.max_number} make at most {largest}; widen task.min_target"
                f"/max_target or the numbers")
        self.check_style()
        check_reward_style(self.reward_style)

    def draw(self, rng: random.Random) -> Example | None:
        """Numbers uniform in range; a random tree over them with positive integer intermediates; None when its
        value misses the target range (the caller draws again, within a bound)."""
        numbers = [rng.randint(self.min_number, self.max_number) for _ in range(rng.choice(self.num_numbers))]
        items: list[tuple[int, object]] = [(x, x) for x in numbers]
        while len(items) > 1:
            (a, ta), (b, tb) = items.pop(rng.randrange(len(items))), items.pop(rng.randrange(len(items)))
            if a < b:
                (a, ta), (b, tb) = (b, tb), (a, ta)
            ops = ["+", "*"] + (["-"] if a > b else []) + (["/"] if a % b == 0 else [])
            op = rng.choice(ops)
            value = {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b else 0}[op]
            items.append((value, (op, ta, tb)))
        target, tree = items[0]
        if not self.min_target <= target <= self.max_target:
            return None
        uid = f"{sorted(numbers)}->{target}"
        return Example(self.name, uid, self.question(numbers, target), to_text(tree),
                       {"numbers": numbers, "target": target})

    @staticmethod
    def question(numbers: list[int], target: int) -> str:
        return f"Numbers: {numbers}\nTarget: {target}"

    def compact_prompt(self, example: Example) -> str:
        return f"Countdown. {example.question}\n"

    def d1_prompt(self, example: Example) -> str:
        numbers, target = example.meta["numbers"], example.meta["target"]
        return (
            f"Using only the numbers {numbers}, write an arithmetic expression that evaluates to exactly "
            f"{target}. Use every number from the list exactly once, with the operations +, -, * and / "
            "as needed. Give only the final expression inside <answer></answer> tags, without an equals "
            "sign or the target, e.g. for numbers [2, 3, 4] and target 5: <answer>\n2*4-3\n</answer>\n"
            + D1_FORMAT.format(answer_hint="expression")
        )

    def reward(self, completion: str, example: Example) -> Reward:
        if self.reward_style == "d1":
            return d1_countdown(completion, example.meta["numbers"], example.meta["target"])
        return countdown_reward(completion, example.meta["numbers"], example.meta["target"], self.format_weight)

    def relabel(self, completion: str, example: Example) -> Example | None:
        """Hindsight: the problem `completion` solves instead, if it is one this task could pose: its answer is
        an expression over exactly the given numbers whose value v is an integer target in [min_target,
        max_target] other than the asked one, and (numbers, v) is a train-split problem. None otherwise. The
        caller verifies the relabelled pair with `reward`."""
        answer, _ = extract_tag(completion)
        if answer is None:
            return None
        numbers = example.meta["numbers"]
        try:
            tree = parse_expression(answer)
            if sorted(literals(tree)) != sorted(numbers):
                return None
            value = evaluate(tree)
        except (ExpressionError, RecursionError):
            return None
        if value.denominator != 1 or not self.min_target <= value <= self.max_target or value == example.meta["target"]:
            return None
        target = int(value)
        uid = f"{sorted(numbers)}->{target}"
        if not self.in_train_split(uid):
            return None
        return Example(self.name, uid, self.question(numbers, target), to_text(tree),
                       {"numbers": numbers, "target": target, "relabelled_from": example.uid})

    def solve(self, example: Example) -> Solution | None:
        numbers, target, style = example.meta["numbers"], example.meta["target"], self.solver_style
        text = solve_aligned(numbers, target) if style in ("aligned", "aligned_first") else None
        if text is not None:
            return Solution(text, tuple(steps_of(parse_expression(text))))
        if style == "aligned":
            return None
        tree = solve_countdown(numbers, target, keep_order=style in ("in_order", "aligned_first"))
        if tree is None and style == "aligned_first":  # no answer in the prompt's order: any order
            tree = solve_countdown(numbers, target)
        return None if tree is None else Solution(to_text(tree, spaced=style == "aligned_first"), tuple(steps_of(tree)))
