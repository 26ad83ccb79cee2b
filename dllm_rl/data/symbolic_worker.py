"""Symbolic answer comparison in a separate process (run as a script, never imported by the trainer).

Reads one JSON object per line from stdin, {"pred": str, "ref": str, "timeout": int}, and writes one line
back, {"equal": bool, "error": str | null}. The parent process kills this worker when an answer takes too
long (sympy can spend minutes on `9^{9^{9}}`-like input, and a C-level big-integer power cannot be
interrupted by a signal), so a hostile completion costs at most the timeout, never a hang.
"""

import json
import resource
import sys


def main() -> None:
    # A hostile expression must not take the machine's memory with it.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from math_verify import parse, verify

    sys.stdout.write("ready\n")
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        timeout = int(request["timeout"])
        try:
            gold = parse(f"${request['ref']}$", parsing_timeout=timeout)
            pred = parse(f"${request['pred']}$", parsing_timeout=timeout)
            reply = {"equal": bool(verify(gold, pred, timeout_seconds=timeout)), "error": None}
        except BaseException as exc:  # anything the parser raises is a wrong answer, not a crash
            reply = {"equal": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
