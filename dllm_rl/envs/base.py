"""What every multi-turn environment shares: the episode's rules around the environment's own (`Env`).

An environment is pure Python, seeded and deterministic: `reset(seed)` gives the first observation (text), and
`step(action text)` gives `Step(observation, reward, done, info)`. The rules every environment gets from `Env`:

- the action text is parsed by the environment (`parse`); the move may be written bare ("left") or inside
  `<action>...</action>` tags (the text inside the first pair is what is parsed);
- an unparsable or illegal action is a step like any other, with reward -`INVALID_PENALTY` (0.1, as CRBC) and the
  state unchanged; the episode goes on unless the environment's `invalid_ends` says it ends there (a failure);
- success is reward 1 on the step that reaches it (`done`, `info["success"]`); an environment may also end an
  episode as a failure (a hole of FrozenLake, a Sudoku with a blank no digit fits);
- a turn limit (`max_turns`): the step that reaches it without success ends the episode as a truncation, which is a
  failure (`info["truncated"]`);
- `anchor()` is a hashable key of the current state (the anchor states of step credit: two states of one group with
  equal keys are the same state), `solve()` the actions that reach success from the current state (None where
  none does), `describe()` the task's instructions (what a prompt begins with).

`info` of every step: `success`, `invalid` (the action was unparsable or illegal), `truncated`, `turn` (1-based),
`reason` (why an action was refused, or "ok").

A subclass implements `_reset(rng)`, `observe()`, `parse(text) -> move or None`, `refuse(move) -> reason or None`,
`apply(move) -> "success" | "failure" | None`, `anchor()`, `solve()` and `describe()`; see `dllm_rl/envs/grid.py`
for three small ones and the minimal example in docs/multi_turn.md.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any, Hashable

from dllm_rl.errors import require

INVALID_PENALTY = 0.1
ACTION_TAG = re.compile(r"<action>(.*?)</action>", re.S)


@dataclass(frozen=True)
class Step:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def action_text(text: str) -> str:
    """The move an action text names: inside the first `<action>...</action>` pair if there is one, else the whole
    text; whitespace at the ends dropped, lower case."""
    found = ACTION_TAG.search(text)
    return (found.group(1) if found else text).strip().lower()


class Env:
    name = ""
    max_turns = 10
    invalid_ends = False  # an unparsable or illegal action ends the episode (a failure)

    def __init__(self) -> None:
        self.turn, self.done = 0, True

    # ------------------------------------------------------------------ the episode's rules

    def reset(self, seed: int) -> str:
        """A fresh episode from `seed` (the same seed, the same episode): its first observation."""
        require(isinstance(seed, int), f"{self.name}: reset(seed) needs an integer seed, got {seed!r}")
        self._reset(random.Random(f"{self.name}|{seed}"))
        self.turn, self.done = 0, False
        return self.observe()

    def step(self, action: str) -> Step:
        require(not self.done, f"{self.name}: step() after the episode ended; reset(seed) starts another")
        self.turn += 1
        move = self.parse(action_text(action))
        reason = "cannot parse the action" if move is None else self.refuse(move)
        outcome = None
        if reason is None:
            outcome = self.apply(move)
        reward = -INVALID_PENALTY if reason is not None else 1.0 if outcome == "success" else 0.0
        truncated = outcome is None and self.turn >= self.max_turns and not (reason and self.invalid_ends)
        self.done = outcome is not None or truncated or (reason is not None and self.invalid_ends)
        info = {"success": outcome == "success", "invalid": reason is not None, "truncated": truncated,
                "turn": self.turn, "reason": reason or "ok"}
        return Step(self.observe(), reward, self.done, info)

    # ------------------------------------------------------------------ what an environment implements

    def _reset(self, rng: random.Random) -> None:
        raise NotImplementedError

    def observe(self) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> Any | None:
        raise NotImplementedError

    def refuse(self, move: Any) -> str | None:
        return None

    def apply(self, move: Any) -> str | None:
        raise NotImplementedError

    def anchor(self) -> Hashable:
        raise NotImplementedError

    def solve(self) -> list[str] | None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


def shortest_path(start: Hashable, moves, goal) -> list | None:
    """The moves of a shortest path from `start` to a state where `goal(state)`, by breadth-first search over
    `moves(state) -> [(move, next state)]` (in the order given: ties go to the earlier move); None if none."""
    if goal(start):
        return []
    parent: dict[Hashable, tuple[Hashable, Any]] = {start: (None, None)}
    frontier = [start]
    while frontier:
        following = []
        for state in frontier:
            for move, nxt in moves(state):
                if nxt in parent:
                    continue
                parent[nxt] = (state, move)
                if goal(nxt):
                    path = []
                    while parent[nxt][0] is not None:
                        nxt, move = parent[nxt]
                        path.append(move)
                    return path[::-1]
                following.append(nxt)
        frontier = following
    return None
