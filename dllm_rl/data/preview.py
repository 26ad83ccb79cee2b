"""`dllm-rl tasks`: print a few examples of a task, then check the reference answers and the solver at scale.

For each printed example: the prompt as the model would see it, the reference answer, the reference
completion's reward and, where the task has an exact solver, the solver's completion and its reward. Then
`check` more examples are generated and scored the same way, and a summary line says how many scored 1.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from dllm_rl.data.task import Solution, Task, describe_splits, draw_examples, render_completion, render_prompt
from dllm_rl.errors import require


def preview_tasks(task: Task, n: int = 3, split: str = "train", seed: int = 0, check: int = 1000,
                  tokenizer=None, print_fn=print) -> dict:
    """Print `n` examples of `task` and score `check` more; returns the summary as a dict."""
    require(isinstance(check, int) and check >= 0, f"check must be a non-negative integer, got {check!r}")
    require(isinstance(n, int) and n >= 1, f"n must be a positive integer, got {n!r}")
    note = describe_splits(task, needed=(split,))
    if note:
        print_fn(note)
    start = time.perf_counter()
    shown = draw_examples(task, split, n, seed, "n")
    for i, ex in enumerate(shown):
        reference = render_completion(Solution(ex.answer), task.prompt_style)
        print_fn(f"=== {task.name} [{split}] example {i} (uid {ex.uid!r})")
        print_fn(f"--- prompt\n{render_prompt(task.prompt(ex), tokenizer)}")
        print_fn(f"--- reference answer: {ex.answer!r} -> reward {task.reward(reference, ex).score:g}")
        solution = task.solve(ex)
        if solution is not None:
            completion = render_completion(solution, task.prompt_style)
            print_fn(f"--- solver completion:\n{completion}\n--- solver reward: {task.reward(completion, ex)}")
    summary = {"task": task.name, "split": split, "checked": 0, "reference_ok": 0, "solver_ok": 0,
               "solver_missing": 0}
    if check:
        examples = draw_examples(task, split, check, seed + 1, "check")
        for ex in tqdm(examples, desc=f"checking {task.name}", unit="ex", disable=None):
            ref = task.reward(render_completion(Solution(ex.answer), task.prompt_style), ex)
            summary["reference_ok"] += ref.correct
            solution = task.solve(ex)
            if solution is None:
                summary["solver_missing"] += 1
            else:
                summary["solver_ok"] += task.reward(render_completion(solution, task.prompt_style), ex).correct
        summary["checked"] = len(examples)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    print_fn(
        f"=== summary: {summary['checked']} {split} examples of {task.name}: reference answers correct "
        f"{summary['reference_ok']}/{summary['checked']}, solver correct {summary['solver_ok']}/"
        f"{summary['checked'] - summary['solver_missing']} ({summary['solver_missing']} without a solver), "
        f"{summary['seconds']}s"
    )
    return summary
