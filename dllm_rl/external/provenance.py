"""Provenance of the held-out prompts (ImagineBench's split): held-out pass@1 on the prompts the external policy
solves and on those it does not, so a run shows whether the dLLM learns beyond what the external rows teach it.

Measured once per held-out set at start-up (and again, identically, at a resume: the seeds depend on the run's
seed and the prompt's uid only): the external source is asked for `samples` completions of each held-out prompt,
exactly as a training step asks it (`source.rollouts`, the source's own prompt rendering and sampling settings),
and a prompt counts as solved when any of them is correct under the task's own reward. The text is judged as
the source wrote it, before the bridge into the dLLM's tokenizer and window: the question is what the external
policy knows, not what survives the trip (a JSONL source without stored rollouts for a held-out prompt does not
solve it). Logged with each held-out evaluation: `eval/pass1_external_solved`, `eval/pass1_external_failed`
(greedy pass@1 over each subset; a subset with no prompt is not logged) and `eval/external_solved_fraction`.
"""

from __future__ import annotations

from typing import Any, Sequence

from dllm_rl.data.task import Example, Task
from dllm_rl.seeds import derive_seed


def external_solves(source, task: Task, examples: Sequence[Example], samples: int, seed: int) -> dict[str, bool]:
    """uid -> whether any of the source's `samples` completions of that example is correct."""
    seeds = [[derive_seed(seed, "provenance", ex.uid, j) for j in range(samples)] for ex in examples]
    got = source.rollouts(task, list(examples), samples, seeds)
    return {ex.uid: any(task.reward(r.text, ex).correct for r in rollouts) for ex, rollouts in zip(examples, got)}


def split_pass1(records: Sequence[dict[str, Any]], solved: dict[str, bool]) -> dict[str, float]:
    """Greedy pass@1 over the held-out prompts the external policy solves and over those it does not (the mean
    of `correct` over each subset's records, one per prompt), and the solved fraction."""
    out = {"eval/external_solved_fraction": sum(solved[r["uid"]] for r in records) / len(records)}
    for name, side in (("solved", True), ("failed", False)):
        subset = [r["correct"] for r in records if solved[r["uid"]] is side]
        if subset:
            out[f"eval/pass1_external_{name}"] = sum(subset) / len(subset)
    return out


def describe(solved: dict[str, bool], source: str, samples: int) -> str:
    count = sum(solved.values())
    return (f"provenance: the external source {source} solves {count} of {len(solved)} held-out prompts "
            f"({samples} sample{'s' if samples != 1 else ''} each); held-out pass@1 is also logged on each side")
