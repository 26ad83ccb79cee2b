"""GSM8K and MATH500 from local files in their public formats, read with `datasets`.

- GSM8K rows: `question`, `answer` = worked solution ending in `#### N` (the reference is N, commas removed).
- MATH500 rows: `problem`, `solution`, `answer` (plus `subject`, `level`, `unique_id` when present).

Files may be JSON Lines, JSON, Parquet or CSV. Nothing is downloaded. The split rule (`split_rule`):
- both `train_file` and `test_file`: the files are the splits, and a train problem that also appears in the test
  file is dropped (so the splits never overlap);
- one file: it is that whole split, and asking for the other split is a named error (`dllm-rl eval
  task.test_file=test.jsonl` scores the whole test set);
- one file and `test_fraction`: the file serves both splits, split by a hash of each problem's text; only when
  the user asks for it, so no file is silently cut.
`describe_splits()` says which rule applies and how many problems each split has; train and eval print it.
These tasks have no exact solver; the worked solution is kept in `meta["solution"]`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from dllm_rl.data.d1_rewards import check_reward_style, d1_gsm8k, d1_math
from dllm_rl.data.answers import extract_final_answer, is_formatted
from dllm_rl.data.math_equal import math_equal
from dllm_rl.data.task import (D1_FORMAT, Example, Reward, Solution, TooFewExamples, check_common, in_test_split,
                               score)
from dllm_rl.errors import ConfigError, require

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> tuple[dict, ...]:
    import datasets  # heavy; only the file-based tasks need it

    builder = BUILDERS.get(Path(path).suffix)
    require(builder is not None, f"cannot read {path!r}: expected a file ending in one of {sorted(BUILDERS)}")
    rows = datasets.load_dataset(builder, data_files=path, split="train")
    return tuple(rows.to_list())


def load_rows(path: str, columns: tuple[str, ...], key: str) -> tuple[dict, ...]:
    file = Path(path).expanduser()
    require(file.is_file(), f"{key}={path!r}: no such file")
    rows = _load(str(file.resolve()), file.stat().st_mtime)
    missing = [c for c in columns if rows and c not in rows[0]]
    require(not missing, f"{key}={path!r}: rows lack the column(s) {missing}; expected {list(columns)}")
    return rows


def _uid(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def gsm8k_example(row: dict, index: int, source: str) -> Example:
    solution, sep, final = str(row["answer"]).rpartition("####")
    if not sep or not final.strip():
        raise ConfigError(f"{source}: row {index} has no '#### N' final answer in its 'answer' field")
    question = str(row["question"]).strip()
    return Example("gsm8k", _uid(question), question, final.strip().replace(",", ""), {"solution": solution.strip()})


def math500_example(row: dict, index: int, source: str) -> Example:
    problem = str(row["problem"]).strip()
    meta = {k: row[k] for k in ("solution", "subject", "level", "unique_id") if k in row}
    return Example("math500", _uid(problem), problem, str(row["answer"]).strip(), meta)


@dataclass(frozen=True)
class FileTask:
    """A task whose problems come from files; `name` picks the format (see FORMATS)."""

    name: str = "gsm8k"
    train_file: str | None = None
    test_file: str | None = None
    test_fraction: float | None = None  # with one file: hash-split it into both splits (see the module docstring)
    prompt_style: str = "d1"
    format_weight: float = 0.0
    symbolic_timeout_s: float = 3.0
    reward_style: str = "default"  # default | d1 (dllm_rl/data/d1_rewards.py)

    def __post_init__(self) -> None:
        require(self.name in FORMATS, f"file task name must be one of {sorted(FORMATS)}, got {self.name!r}")
        require(self.train_file or self.test_file,
                f"task {self.name!r} reads local files: set task.train_file and/or task.test_file "
                f"(columns {list(FORMATS[self.name][0])})")
        require(not (self.train_file and self.test_file and self.test_fraction is not None),
                f"task.test_fraction={self.test_fraction!r} with both task.train_file and task.test_file: the files "
                f"are the splits; unset task.test_fraction (or give one file to hash-split)")
        check_common("train", None, self.test_fraction, self.prompt_style, fraction_optional=True)
        check_reward_style(self.reward_style)

    @property
    def split_rule(self) -> str:
        """"files" (each file is its split), "one file" (the file is its split, there is no other) or "hash"."""
        if self.train_file and self.test_file:
            return "files"
        return "one file" if self.test_fraction is None else "hash"

    def _read(self, split: str) -> list[Example]:
        columns, make = FORMATS[self.name]
        path, key = (self.train_file, "task.train_file") if split == "train" else (self.test_file, "task.test_file")
        rows = [make(row, i, path) for i, row in enumerate(load_rows(path, columns, key))]
        return list({ex.uid: ex for ex in rows}.values())  # drop duplicate problems

    def _split_rows(self, split: str) -> list[Example]:
        if self.split_rule == "files":
            test = self._read("test")
            if split == "test":
                return test
            held_out = {ex.uid for ex in test}
            return [ex for ex in self._read("train") if ex.uid not in held_out]
        given = "train" if self.train_file else "test"
        if self.split_rule == "one file":
            self.check_split(split)
            return self._read(given)
        test = split == "test"
        return [ex for ex in self._read(given) if in_test_split(self.name, ex.uid, self.test_fraction) == test]

    def check_split(self, split: str) -> None:
        """A named error when the files give no `split` (one file, no test_fraction, and it is the other split)."""
        given = "train" if self.train_file else "test"
        other = "test" if given == "train" else "train"
        require(self.split_rule != "one file" or split == given,
                f"{self.name}: there is no {split} split: only task.{given}_file is set, and it is the whole {given} "
                f"split; set task.{other}_file, or task.test_fraction (e.g. 0.1) to hash-split task.{given}_file "
                f"into both" + (", or eval_every=0 to train without held-out evaluation" if given == "train" else ""))

    def describe_splits(self, needed: tuple[str, ...] = ()) -> str:
        """Which split rule applies and how many problems each split has (reads the files); a named error when
        a split in `needed` does not exist."""
        for split in needed:
            self.check_split(split)
        if self.split_rule == "files":
            train, test = self._split_rows("train"), self._split_rows("test")
            dropped = len(self._read("train")) - len(train)
            return (f"{self.name}: the files are the splits: train {len(train)} problems from task.train_file"
                    f"{f' ({dropped} also in task.test_file dropped)' if dropped else ''}, test {len(test)} from "
                    f"task.test_file")
        given = "train" if self.train_file else "test"
        if self.split_rule == "one file":
            return f"{self.name}: task.{given}_file is the whole {given} split ({len(self._read(given))} problems)"
        train, test = self._split_rows("train"), self._split_rows("test")
        return (f"{self.name}: task.{given}_file hash-split with task.test_fraction={self.test_fraction:g}: train "
                f"{len(train)} problems, test {len(test)}")

    def examples(self, split: str, n: int | None, seed: int) -> list[Example]:
        check_common(split, n, self.test_fraction, self.prompt_style, fraction_optional=True)
        rows = self._split_rows(split)
        if n is None:
            return rows
        if n > len(rows):
            raise TooFewExamples(split, self.name, len(rows), n)
        return random.Random(f"{self.name}|{split}|{seed}").sample(rows, n)

    def prompt(self, example: Example) -> str:
        if self.prompt_style == "compact":
            return f"{example.question}\n"
        hint = "final answer (a number)" if self.name == "gsm8k" else "final answer in LaTeX, in \\boxed{}"
        return f"{example.question}\nSolve it step by step.\n" + D1_FORMAT.format(answer_hint=hint)

    def reward(self, completion: str, example: Example) -> Reward:
        if self.reward_style == "d1" and self.name == "gsm8k":
            return d1_gsm8k(completion, example.answer)
        if self.reward_style == "d1":
            return d1_math(completion, example.answer,
                           lambda pred, ref: math_equal(pred, ref, symbolic=True, timeout_s=self.symbolic_timeout_s))
        formatted = is_formatted(completion)
        answer, reason = extract_final_answer(completion)
        if answer is None:
            return Reward(score(0, formatted, self.format_weight), False, formatted, reason)
        equal, reason = math_equal(answer, example.answer, symbolic=self.name != "gsm8k",
                                   timeout_s=self.symbolic_timeout_s)
        return Reward(score(float(equal), formatted, self.format_weight), equal, formatted, reason)

    def solve(self, example: Example) -> Solution | None:
        return None


FORMATS = {
    "gsm8k": (("question", "answer"), gsm8k_example),
    "math500": (("problem", "answer"), math500_example),
}
