"""One description of the step: the stages that follow the rollouts, in order, each with what it reads and writes,
the timer phase it counts towards, and whether it can run on one group alone.

Every path runs this list. The synchronous step (`dllm_rl.train.run_step`) collects the step's batch, then runs
`BEFORE_UPDATE` over it, `Learner.update`, then `AFTER_UPDATE`. The streamed step (`workers.pipe`,
dllm_rl/workers/pipe.py) runs the stages of `BEFORE_UPDATE` marked `per_group` on each group as it arrives, its
backward passes straight after (`Learner.update_stream`), and `AFTER_UPDATE` once at the end; the stages that need
the whole step (curation's `reweight` and `observe`) are inactive there, since the config refuses curation with the
pipe. Adding a stage is one entry in a list; `tests/test_stages.py` walks the lists and checks that what each stage
reads is written before it (by the collect stage, `COLLECTED`, or an earlier entry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dllm_rl.collect import StepBatch, observe_curation


@dataclass(frozen=True)
class Stage:
    name: str
    phase: str  # the PhaseTimer phase its seconds count towards (perf/<phase>_s)
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    per_group: bool  # it reads nothing beyond one group: the streamed step runs it on each group as it arrives
    run: Callable[[StepParts, StepBatch], None] | None  # (the step's parts, the batch or a group); None:
    # the update, which each path makes its own way (`Learner.update`, `Learner.update_stream`)


@dataclass
class StepParts:
    """The step's stages as the run built them: what every stage and both step paths are handed. No config in
    here: a stage uses what it was built with, and the config's keys are read only at the edge (dllm_rl/run_setup.py)
    and by the loop (dllm_rl/train.py)."""

    collect: Callable[[int], StepBatch]  # step -> this rank's batch: prompts, allocation, on-policy rows, rewards
    curation: Any  # a Curation: which prompts get rollouts and how many, which stay
    external: Any  # ExternalRollouts (ERILS), or None
    replay: Any  # ReplaySource (the bandit's replayed rows), or None
    advantages: Callable[[StepBatch], None]
    estimators: dict[str, Any]  # the sources this run can have -> the estimator that scores them
    score: Callable[[StepBatch], None]  # mask seeds, old and reference log-probs
    correct: Callable[[StepBatch], None] | None  # the sampler-learner correction (Sparse-RL), or None
    learner: Any  # a Learner
    dp: Any  # the DataParallel bookkeeping
    pad_id: int
    piped: bool  # workers.pipe: each group's stages and backward passes as it arrives (dllm_rl/workers/pipe.py)


# what `StepParts.collect` (choose prompts, allocate, generate, select, verify; dllm_rl/collect.py) leaves in the batch
COLLECTED = ("prompts", "on_policy rows", "rewards", "sampler record", "visits")

# The one stage that writes each field of a `StepBatch` (each source's rows apart; "collect" is `Run.collect`).
# Two kinds of write are not a field's: `metrics` is every stage's log (each stage its own keys), and a rank that
# lacks a source the others have gets an inert stand-in row of it from the shard stage (`DataParallel.shard_sources`,
# the data-parallel bookkeeping). What one strategy alone needs lives in its own state (DARTS's changed groups, the
# bandit's picks), not in the batch. `tests/test_stages.py` checks this on a run.
OWNERS = {"step": "collect", "examples": "collect", "prompt_texts": "collect", "prompt_ids": "collect",
          "group_sizes": "collect", "example_ids": "collect", "template": "collect", "visits": "collect",
          "episodes": "collect", "external_episodes": "external rollouts",
          "rows[on_policy]": "collect", "rows[external]": "external rollouts", "rows[replay]": "replayed rows",
          "auxiliary": "reweight"}


def _external(parts: StepParts, batch: StepBatch) -> None:
    if parts.external is not None:
        parts.external(batch)


def _replay(parts: StepParts, batch: StepBatch) -> None:
    if parts.replay is not None:
        parts.replay(batch)


def _correct(parts: StepParts, batch: StepBatch) -> None:
    if parts.correct is not None:
        parts.correct(batch)


BEFORE_UPDATE = [
    Stage("external rollouts", "external", ("prompts", "rewards"), ("external rows",), True, _external),
    Stage("advantages", "external", ("rewards", "external rows"), ("advantages", "loss weights"), True,
          lambda parts, batch: parts.advantages(batch)),
    Stage("reweight", "external", ("advantages", "sampler record"),
          ("advantages", "loss weights", "auxiliary rows", "replay picks"), False,
          lambda parts, batch: parts.curation.reweight(batch)),
    Stage("replayed rows", "external", ("replay picks",), ("replay rows",), False, _replay),
    Stage("observe curation", "external", ("visits", "external rows"), ("curation state",), False,
          lambda parts, batch: observe_curation(batch, parts.curation, parts.dp)),
    Stage("shard", "score", ("on_policy rows", "external rows"), ("shards",), True,  # and every other source there
          lambda parts, batch: parts.dp.shard_sources(batch.rows, parts.estimators)),
    Stage("old/ref log-probs", "score", ("shards", "advantages"), ("mask seeds", "old log-probs", "ref log-probs"),
          True, lambda parts, batch: parts.score(batch)),
    Stage("sampler correction", "score", ("on_policy rows", "sampler record"), ("loss weights", "correction"), True,
          _correct),
]
UPDATE = Stage("update", "update", ("advantages", "loss weights", "mask seeds", "old log-probs", "ref log-probs",
                                    "auxiliary rows", "replay rows"), ("policy",), False, None)
AFTER_UPDATE = [
    Stage("after update", "update", ("policy", "loss weights"), ("curation state",), False,
          lambda parts, batch: parts.curation.after_update(batch)),  # the bandit's feedback and replay buffer
]
