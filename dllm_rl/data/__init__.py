"""Tasks with verifiable rewards, and the tokenizers the embedded models use.

`TASKS` is the table of task builders, chosen once by name at the edge (`build_task`). Task modules and
their reward functions import no torch.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from dllm_rl.data.arithmetic import Arithmetic
from dllm_rl.data.countdown import Countdown
from dllm_rl.data.math_tasks import FileTask
from dllm_rl.data.sudoku import Sudoku
from dllm_rl.data.task import Example, Reward, Solution, Task, render_completion, render_prompt
from dllm_rl.errors import check_kwargs, check_types, pick

TASKS = {
    "countdown": Countdown,
    "sudoku": Sudoku,
    "arithmetic": Arithmetic,
    "gsm8k": partial(FileTask, "gsm8k"),
    "math500": partial(FileTask, "math500"),
}


def build_task(name: str, **kwargs: Any) -> Task:
    """The task called `name`, configured by the flat keys of its config group (`configs/task/<name>.yaml`)."""
    builder = pick(TASKS, name, "task")
    check_kwargs(builder, kwargs, "task")
    check_types(builder, kwargs, "task")
    return builder(**kwargs)


__all__ = ["TASKS", "build_task", "Example", "Reward", "Solution", "Task", "render_completion", "render_prompt"]
