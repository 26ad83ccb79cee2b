"""Multi-turn environments: pure Python, seeded, deterministic (the protocol: dllm_rl/envs/base.py).

| name          | what                                          | anchor                       | turns |
|---------------|-----------------------------------------------|------------------------------|-------|
| `corridor`    | walk to the key, pick it, open the far door   | (position, has key)          | 12    |
| `frozen_lake` | FrozenLake 4x4, deterministic, a map per seed | position                     | 12    |
| `countdown`   | Countdown, one operation a turn               | the sorted remaining numbers | 6     |
| `sudoku`      | 4x4 Sudoku, one cell a turn                   | the board                    | 14    |
| `sliding`     | the 2x3 sliding puzzle (episodes loop)        | the board                    | 20    |

`build_env("corridor", length=7)` builds one by name with its options; a user's own environment is named by its
import path, `build_env("my_pkg.module:MyEnv")` (a subclass of `Env`, docs/multi_turn.md has a minimal one).
"""

from __future__ import annotations

import importlib
from typing import Any

from dllm_rl.envs.base import INVALID_PENALTY, Env, Step, action_text
from dllm_rl.envs.grid import Corridor, FrozenLake, SlidingPuzzle
from dllm_rl.envs.puzzles import CountdownTurns, SudokuTurns
from dllm_rl.errors import ConfigError, check_kwargs, require

ENVIRONMENTS: dict[str, type[Env]] = {cls.name: cls for cls in (Corridor, FrozenLake, CountdownTurns, SudokuTurns,
                                                                 SlidingPuzzle)}


def env_class(name: str) -> type[Env]:
    """The environment class `name` names: a built-in one, or `package.module:Class`."""
    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    require(isinstance(name, str) and ":" in name,
            f"env={name!r}: expected one of {', '.join(ENVIRONMENTS)}, or an import path package.module:Class")
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"env={name!r}: cannot import {attr!r} from {module!r} ({exc})") from exc
    require(isinstance(cls, type) and issubclass(cls, Env),
            f"env={name!r}: {attr} is not a subclass of dllm_rl.envs.Env")
    return cls


def build_env(name: str, **options: Any) -> Env:
    """A fresh environment `name` with its options (each checked by name against its constructor)."""
    cls = env_class(name)
    check_kwargs(cls.__init__, options, f"env.{name}", exclude=("self",))
    return cls(**options)


__all__ = ["ENVIRONMENTS", "INVALID_PENALTY", "Corridor", "CountdownTurns", "Env", "FrozenLake", "SlidingPuzzle",
           "Step", "SudokuTurns", "action_text", "build_env", "env_class"]
