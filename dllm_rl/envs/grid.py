"""Three small worlds: a key-and-door corridor, a deterministic FrozenLake 4x4 and a 2x3 sliding puzzle."""

from __future__ import annotations

import random
from typing import Hashable

from dllm_rl.envs.base import Env, shortest_path

MOVES = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


class Corridor(Env):
    """A corridor of `length` cells: walk to the key, pick it up, walk to the door at the far end, open it.
    Actions: left, right, pick, open. Anchor: (position, has key). Illegal: walking off an end, picking where no
    key lies, opening without the key or away from the door."""

    name, max_turns = "corridor", 12

    def __init__(self, length: int = 5) -> None:
        super().__init__()
        self.length = length

    def _reset(self, rng: random.Random) -> None:
        self.key = rng.randrange(self.length - 1)
        self.position = rng.choice([p for p in range(self.length - 1) if p != self.key])
        self.has_key = False

    def describe(self) -> str:
        return ("Corridor: fetch the key, then open the door at the far right end. "
                "Actions: left, right, pick, open.")

    def observe(self) -> str:
        key = "you hold the key" if self.has_key else f"the key is at {self.key}"
        return f"You are at {self.position} of 0-{self.length - 1}; {key}; the door is at {self.length - 1}."

    def parse(self, text: str) -> str | None:
        return text if text in ("left", "right", "pick", "open") else None

    def refuse(self, move: str) -> str | None:
        if move in ("left", "right"):
            nxt = self.position + MOVES[move][1]
            return None if 0 <= nxt < self.length else f"cannot walk {move} from {self.position}"
        if move == "pick":
            return None if not self.has_key and self.position == self.key else "no key here"
        if not self.has_key:
            return "the door is locked and you hold no key"
        return None if self.position == self.length - 1 else "no door here"

    def apply(self, move: str) -> str | None:
        if move in ("left", "right"):
            self.position += MOVES[move][1]
        elif move == "pick":
            self.has_key = True
        else:
            return "success"
        return None

    def anchor(self) -> Hashable:
        return (self.position, self.has_key)

    def solve(self) -> list[str] | None:
        steps = []
        if not self.has_key:
            d = self.key - self.position
            steps += ["right" if d > 0 else "left"] * abs(d) + ["pick"]
        here = self.key if not self.has_key else self.position
        return steps + ["right"] * (self.length - 1 - here) + ["open"]


class FrozenLake(Env):
    """FrozenLake 4x4, deterministic (no slipping): walk from S (top left) to G (bottom right) over frozen cells
    F; a hole H ends the episode as a failure. Each seed draws its own map (holes with probability 0.2, redrawn
    until G can be reached). Actions: left, right, up, down; walking off the grid is illegal. Anchor: position."""

    name, max_turns = "frozen_lake", 12
    size = 4

    def _reset(self, rng: random.Random) -> None:
        n = self.size
        while True:
            cells = ["H" if rng.random() < 0.2 else "F" for _ in range(n * n)]
            cells[0], cells[-1] = "S", "G"
            self.map = ["".join(cells[r * n:(r + 1) * n]) for r in range(n)]
            self.position = (0, 0)
            if self.solve() is not None:
                return

    def describe(self) -> str:
        return ("FrozenLake: walk from S to G without stepping into a hole H (F is frozen ground). "
                "Actions: left, right, up, down.")

    def observe(self) -> str:
        r, c = self.position
        rows = [row if i != r else row[:c] + "@" + row[c + 1:] for i, row in enumerate(self.map)]
        return "Map (@ is you): " + "/".join(rows)

    def parse(self, text: str) -> str | None:
        return text if text in MOVES else None

    def step_from(self, position: tuple[int, int], move: str) -> tuple[int, int] | None:
        r, c = position[0] + MOVES[move][0], position[1] + MOVES[move][1]
        return (r, c) if 0 <= r < self.size and 0 <= c < self.size else None

    def refuse(self, move: str) -> str | None:
        return None if self.step_from(self.position, move) else f"cannot walk {move} off the lake"

    def apply(self, move: str) -> str | None:
        self.position = self.step_from(self.position, move)
        cell = self.map[self.position[0]][self.position[1]]
        return "success" if cell == "G" else "failure" if cell == "H" else None

    def anchor(self) -> Hashable:
        return self.position

    def solve(self) -> list[str] | None:
        def moves(p):
            if self.map[p[0]][p[1]] == "H":
                return []
            return [(m, q) for m in MOVES for q in [self.step_from(p, m)] if q is not None]

        return shortest_path(self.position, moves, lambda p: self.map[p[0]][p[1]] == "G")


class SlidingPuzzle(Env):
    """The 2x3 sliding puzzle: tiles 1-5 and a blank (0); slide the blank left, right, up or down until the board
    reads 123/450. Each seed scrambles the solved board by random slides (so it is solvable) and never starts
    solved. Moves can undo each other: episodes loop. Illegal: sliding the blank off the board. Anchor: the
    board."""

    name, max_turns = "sliding", 20
    rows, cols = 2, 3
    solved = (1, 2, 3, 4, 5, 0)

    def _reset(self, rng: random.Random) -> None:
        board = self.solved
        while board == self.solved:
            for _ in range(rng.randint(4, 12)):
                board = rng.choice([b for _, b in self.neighbours(board)])
        self.board = board

    def describe(self) -> str:
        return ("Sliding puzzle: slide the blank (0) until the board reads 123/450. "
                "Actions: left, right, up, down (the direction the blank moves).")

    def observe(self) -> str:
        text = "".join(map(str, self.board))
        return f"Board: {text[:self.cols]}/{text[self.cols:]}"

    def parse(self, text: str) -> str | None:
        return text if text in MOVES else None

    def slide(self, board: tuple[int, ...], move: str) -> tuple[int, ...] | None:
        r, c = divmod(board.index(0), self.cols)
        nr, nc = r + MOVES[move][0], c + MOVES[move][1]
        if not (0 <= nr < self.rows and 0 <= nc < self.cols):
            return None
        out = list(board)
        out[r * self.cols + c], out[nr * self.cols + nc] = out[nr * self.cols + nc], 0
        return tuple(out)

    def neighbours(self, board: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        return [(m, b) for m in MOVES for b in [self.slide(board, m)] if b is not None]

    def refuse(self, move: str) -> str | None:
        return None if self.slide(self.board, move) else f"cannot slide the blank {move}"

    def apply(self, move: str) -> str | None:
        self.board = self.slide(self.board, move)
        return "success" if self.board == self.solved else None

    def anchor(self) -> Hashable:
        return self.board

    def solve(self) -> list[str] | None:
        return shortest_path(self.board, self.neighbours, lambda b: b == self.solved)
