"""Is a predicted math answer equal to the reference? Exact numbers first, symbolic equivalence second.

1. Light normalisation (`$`, `\\left`/`\\right`, `\\dfrac`, `\\text{}`, thousands separators, `\\%`, a
   trailing period) and string equality.
2. Exact rational comparison when both sides are plain numbers (`72`, `-3.5`, `1,000`, `3/4`,
   `\\frac{3}{4}`, `2.5e3`), with `fractions.Fraction`: no float rounding, no eval.
3. Symbolic equivalence with Hugging Face's `math-verify` (sympy-based) for everything else (`\\sqrt{2}/2`,
   intervals, sets, polynomials), run in a separate worker process that is killed after `timeout_s`.

An answer must be a value, not a calculation left to do: a prediction with an operator the reference does not
have (`\\int`, `\\sum`, `\\prod`, `\\lim`, a derivative) is wrong, whatever sympy would make of it
(`\\int_0^1 x\\,dx` is not an answer to "1/2", although it evaluates to it). That is the practice of the
MATH graders (Hendrycks' `is_equiv`, which d1 uses, compares normalised strings, so it never evaluates one) and
keeps a policy from being paid for copying the question into its answer.

Hostile answers never raise and never hang: longer than `MAX_ANSWER_CHARS`, non-ASCII digits (`٣`, `３`)
and numbers with absurd exponents score False with a reason, and anything slower than the timeout in
sympy is cut off. No torch is imported here.
"""

from __future__ import annotations

import atexit
import json
import re
import select
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

MAX_ANSWER_CHARS = 256
MAX_NUMBER_DIGITS = 64
MAX_EXPONENT = 400
STARTUP_TIMEOUT_S = 60.0

_NUMBER = re.compile(
    r"[+-]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)?(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", re.ASCII
)
_FRAC = re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}")
_UNEVALUATED = re.compile(r"\\(?:i*int|oint|sum|prod|lim|partial)(?![a-zA-Z])|\\frac\{d\}\{d|\\frac\{d\^")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def has_non_ascii_digit(text: str) -> bool:
    return any(c.isdigit() and not ("0" <= c <= "9") for c in text)


def normalize(answer: str) -> str:
    s = answer.strip().rstrip(".").strip().strip("$").strip()
    s = _TEXT.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"),
                     ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\%", ""), ("%", ""), ("\\$", ""),
                     ("^\\circ", ""), ("^{\\circ}", "")):
        s = s.replace(old, new)
    s = s.strip().rstrip(".").strip()
    return re.sub(r"\s+", " ", s)


def parse_number(text: str) -> Fraction | None:
    """An exact rational for a plain number, a/b or \\frac{a}{b}; None for anything else. Spaces around a
    fraction's parts go, but digits separated by a space are two numbers, not one ("7 2" is not 72)."""
    if re.search(r"[0-9]\s+[0-9]", text):
        return None
    s = text.replace(" ", "")
    frac = _FRAC.fullmatch(s)
    if frac is None and s.count("/") == 1:
        frac = re.fullmatch(r"([^/]+)/([^/]+)", s)
    if frac is not None:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        if num is None or den is None or den == 0:
            return None
        return num / den
    if not s or not _NUMBER.fullmatch(s) or not any(c.isdigit() for c in s):
        return None
    mantissa, _, exponent = s.lower().partition("e")
    if len(mantissa) > MAX_NUMBER_DIGITS or (exponent and abs(int(exponent)) > MAX_EXPONENT):
        return None  # 1e999999999 would build a billion-digit integer
    return Fraction(s.replace(",", ""))


def math_equal(pred: str, ref: str, symbolic: bool = True, timeout_s: float = 3.0) -> tuple[bool, str]:
    """(equal, reason). `symbolic=False` restricts the comparison to exact numbers (GSM8K)."""
    if len(pred) > MAX_ANSWER_CHARS:
        return False, f"answer longer than {MAX_ANSWER_CHARS} characters"
    if has_non_ascii_digit(pred):
        return False, "non-ASCII digit in answer"
    p, r = normalize(pred), normalize(ref)
    if p == r:
        return True, "ok"
    left = {m.group(0) for m in _UNEVALUATED.finditer(p)} - {m.group(0) for m in _UNEVALUATED.finditer(r)}
    if left:
        return False, f"unevaluated expression ({' '.join(sorted(left))}): expected its value"
    p_num, r_num = parse_number(p), parse_number(r)
    if p_num is not None and r_num is not None:
        return (True, "ok") if p_num == r_num else (False, "wrong answer")
    if not symbolic:
        return False, "wrong answer" if p_num is not None else "answer is not a number"
    equal, error = SANDBOX.equal(p, r, timeout_s)
    return (True, "ok") if equal else (False, error or "wrong answer")


class SymbolicSandbox:
    """One long-lived `symbolic_worker.py` process, restarted after a timeout or a crash. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        atexit.register(self.close)

    def _start(self) -> subprocess.Popen | None:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        worker = Path(__file__).with_name("symbolic_worker.py")
        self._proc = subprocess.Popen(
            [sys.executable, "-u", str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )
        if self._readline(STARTUP_TIMEOUT_S) != "ready\n":
            self.close()
        return self._proc

    def _readline(self, timeout_s: float) -> str:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return self._proc.stdout.readline() if ready else ""

    def equal(self, pred: str, ref: str, timeout_s: float) -> tuple[bool, str | None]:
        with self._lock:
            if self._start() is None:
                return False, "symbolic checker failed to start"
            seconds = max(1, int(round(timeout_s)))
            try:
                self._proc.stdin.write(json.dumps({"pred": pred, "ref": ref, "timeout": seconds}) + "\n")
                self._proc.stdin.flush()
            except OSError:
                self.close()
                return False, "symbolic checker crashed"
            # Two parses and one comparison, each bounded by `seconds` inside the worker; the kill below
            # is for what the worker's own timeouts cannot interrupt.
            line = self._readline(3 * seconds + 1.0)
            if not line:
                self.close()
                return False, f"symbolic check timed out after {timeout_s:g}s"
            reply = json.loads(line)
            return bool(reply["equal"]), reply["error"]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


SANDBOX = SymbolicSandbox()
