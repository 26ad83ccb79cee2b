"""The one error type for bad user input, and the checks that raise it.

A `ConfigError` always names the offending key or value and says what was expected; the CLI prints it
without a traceback and exits with status 2.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable


class ConfigError(ValueError):
    """A configuration value or input that cannot be used, with a message naming it."""


class RunStopped(RuntimeError):
    """A run that stops for a reason outside the code (a full disk, repeated non-finite updates), with a message
    that says what happened and what to do; the CLI prints it without a traceback and exits with `exit_code`."""

    exit_code = 1


class Interrupted(RunStopped):
    """The user pressed Ctrl-C (SIGINT): the run stopped cleanly at the end of a step."""

    exit_code = 130


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def output_file(path: str, key: str) -> Path:
    """`path` as a file a command is about to write (checked before any work, so a bad path costs nothing): not a
    directory, in a directory that exists or can be made."""
    file = Path(path).expanduser()
    require(not file.is_dir(), f"{key}={path!r} is a directory: expected a file path to write, e.g. {path.rstrip('/')}"
            f"/out.json")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"{key}={path!r}: cannot make its directory ({error.strerror})") from None
    return file


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def pick(table: dict[str, Any], name: str, what: str) -> Any:
    """`table[name]`, or a ConfigError that lists the valid names."""
    if name not in table:
        raise ConfigError(
            f"unknown {what} {name!r}{did_you_mean(str(name), table)}; expected one of {sorted(table)}"
        )
    return table[name]


def check_kwargs(fn: Callable, kwargs: dict[str, Any], prefix: str, exclude: Iterable[str] = ()) -> None:
    """Reject keys that `fn` does not accept, or that it takes but a config must not set (`exclude`: runtime
    arguments), naming them as the user wrote them (`prefix.key`)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    params = [name for name in params if name not in set(exclude)]
    for key in kwargs:
        if key not in params:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(
                f"unknown config key {where!r}{did_you_mean(key, params)}; "
                f"valid keys{' under ' + repr(prefix) if prefix else ''}: {sorted(params)}"
            )


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict)
    if origin in (tuple, list):
        # Config lists arrive as lists; a bare scalar is accepted where a (min, max) pair is expected.
        items = value if isinstance(value, (list, tuple)) else [value]
        inner = [a for a in args if a is not Ellipsis] or [Any]
        return all(_matches(v, inner[0]) for v in items)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def check_types(fn: Callable, kwargs: dict[str, Any], prefix: str) -> None:
    """Reject values whose type does not fit `fn`'s annotation, e.g. `task.max_number=abc`."""
    target = fn.func if isinstance(fn, functools.partial) else fn
    hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    for key, value in kwargs.items():
        if key in hints and not _matches(value, hints[key]):
            where = f"{prefix}.{key}" if prefix else key
            hint = hints[key]
            expected = str(hint) if typing.get_args(hint) else getattr(hint, "__name__", str(hint))
            raise ConfigError(f"{where}={value!r}: expected {expected.replace('typing.', '')}")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# Ranges a config value can be checked against by name: (test, what is expected).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: _number(v) and v > 0, "a finite number > 0"),
    "non_negative": (lambda v: _number(v) and v >= 0, "a finite number >= 0"),
    "at_least_1": (lambda v: _number(v) and v >= 1, "a number >= 1"),
    "probability": (lambda v: _number(v) and 0 <= v <= 1, "a probability in [0, 1]"),
    "probability_below_1": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "open_unit": (lambda v: _number(v) and 0 < v < 1, "a number strictly between 0 and 1"),
    "finite": (_number, "a finite number"),
}


def check_ranges(values: dict[str, Any], ranges: dict[str, str], prefix: str = "") -> None:
    """Each `values[key]` that is given (not None) within `RANGES[ranges[key]]`, or a ConfigError naming
    `prefix.key`, the value and the range."""
    for key, rule in ranges.items():
        value = values.get(key)
        if value is None:
            continue
        ok, expected = RANGES[rule]
        where = f"{prefix}.{key}" if prefix else key
        require(ok(value), f"{where}={value!r}: expected {expected}")
