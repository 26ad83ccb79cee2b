"""`workers.max_staleness=S` > 0: asynchronous rollouts. The workers keep generating the next steps' groups while
the learner trains (ECHO-2's overlap), each group at most S policy versions behind the step that trains on it
(dllm_rl/workers/admission.py says why the bound holds, dllm_rl/workers/pipeline.py how groups are started and
collected). This stage replaces `CollectRollouts`: it returns the step's batch of verified on-policy groups, or
with `workers.pipe` (at any S, 0 included) hands them out one at a time as they finish (`stream`; pipe.py).

Off-policy choice: a group generated at version v < step is scored for its old log-probs by the current policy (the
"proximal" policy of decoupled PPO: the clipped ratio is taken against it), and the distance to the policy that
actually sampled it is corrected by the Sparse-RL stage (dllm_rl/algo/correction.py) against the per-token
log-probs the worker's sampler recorded: the `ordered` estimator, by the learner at its current version, truncated
(`sampler_correction.mode=weight|both`, required here) with the effective sample size logged.

Prompts are drawn ahead, in the run's one stream of prompts; a group's rollouts draw from seeds of the step it was
drawn for, so at any S a group is the same rollouts whatever worker makes it, from the same weights. A
checkpoint keeps the first prompt not yet trained on and those after it already trained on (a regenerated group can
be trained on after later ones); a resumed run draws again from there and skips those, regenerating what was in
flight from its seeds, at the resumed policy's version (so resume at S > 0 is not bit-exact: the in-flight groups
come from newer weights than they would have).

Several learner ranks: rank 0 alone holds the workers, the pipeline and its one admission (so one staleness bound,
decided once for the whole learner); every rank enters each publish (at ZeRO-3 the full weights are gathered for it,
once per snapshot, a collective) and then receives its share of the step's admitted groups, whole groups in a
contiguous run by rollouts (`balanced_runs`, as in-process steps split their prompts), with rank 0's rollout
metrics. A rank whose share is empty (fewer groups than ranks) takes the step's calls with a stand-in row.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch

from dllm_rl.buffer import concat_rows
from dllm_rl.collect import (InProcessRollouts, PromptSource, StepBatch, group_records, rollout_metrics, verify)
from dllm_rl.data.task import Task, render_prompt
from dllm_rl.data_parallel import DataParallel, balanced_runs
from dllm_rl.seeds import derive_seed
from dllm_rl.workers.admission import Admission
from dllm_rl.workers.pipeline import Job, Pipeline
from dllm_rl.workers.pools import PoolMeter
from dllm_rl.workers.ray_pool import RayBackend, WorkerPool, stop_ray
from dllm_rl.workers.remote import moved
from dllm_rl.workers.versions import Publisher


@dataclass
class PipelinedRollouts:
    prompts: PromptSource
    local: InProcessRollouts  # the seed contract and the rows' construction
    pool: WorkerPool | None  # rank 0's; None on the other learner ranks
    publisher: Publisher | None  # rank 0's
    weights: Callable[[], dict[str, torch.Tensor]]
    task: Task
    group_size: int
    max_staleness: int
    pad_id: int
    dp: DataParallel | None = None  # the learner's ranks (None: one process)
    gathered: Callable[[], ContextManager] = contextlib.nullcontext  # the full weights for a publish (ZeRO-3)
    owns_ray: bool = False
    sync_every: int = 1  # publish the learner's weights every this many updates
    step: int = 0  # the learner's step at the start (a resumed run's): admission counts its earlier groups as taken
    skip: set[int] = field(default_factory=set)  # prompt ids trained on before a resume, beyond its position
    drawn: dict[int, Any] = field(default_factory=dict)  # prompt id -> (Drawn, rendered prompt), not yet trained
    pipeline: Pipeline | None = None
    streamed: dict[str, float] = field(default_factory=dict)  # `stream`'s rollout/* metrics of its last step
    meter: PoolMeter | None = None  # the per-pool metrics (rank 0's)
    published_step: int | None = None  # the step of the newest snapshot this run published (every rank)
    version_seen: int = 0  # the newest published policy version, as rank 0 last said it (every rank)

    def __post_init__(self) -> None:
        if self.pool is None:  # a learner rank other than 0: it is given its groups
            return
        self.meter = PoolMeter(self.pool.pools)
        B = self.prompts.per_step
        admission = Admission.resumed({"taken": self.step * B, "violations": 0}, B, self.max_staleness)
        self.pipeline = Pipeline(RayBackend(self.pool), admission, self.draw, timeout_s=self.pool.timeout_s,
                                 sync_every=self.sync_every)

    def draw(self) -> list[Job]:
        """The next step's prompts of the stream, as jobs (prompts trained on before a resume are skipped)."""
        jobs = []
        while not jobs:
            for d in self.prompts.draw(self.prompts.per_step):
                if d.prompt_id in self.skip:
                    continue
                text = render_prompt(self.task.prompt(d.example), self.local.generator.tokenizer)
                self.drawn[d.prompt_id] = (d, text)
                step = d.prompt_id // self.prompts.per_step  # the step that draws it in the synchronous loop
                seeds = [derive_seed(self.local.seed, "rollout", step, d.prompt_id, g) for g in range(self.group_size)]
                jobs.append(Job(d.prompt_id, step, ([text] * self.group_size, seeds)))
        return jobs

    def __call__(self, step: int) -> StepBatch:
        started = time.perf_counter()
        published = self.publish(step)
        start = time.perf_counter()
        shares = self.shares(step, published, started) if self.pipeline is not None else None
        items, metrics, template = shares[0] if self.dp is None else self.dp.scatter_objects(shares)
        waited = time.perf_counter() - start  # the learner's idle time: not its own work on the rows below
        self.version_seen = int(metrics["rollout/policy_version"])
        batch = self.batch_of(step, items, template)
        batch.metrics.update({**metrics, "rollout/learner_wait_s": waited})
        return batch

    def shares(self, step: int, published: float, started: float) -> list[tuple[list, dict[str, float], str]]:
        """Rank 0: the step's admitted groups (taken from the pipeline, in prompt order) split over the learner's
        ranks, whole groups in contiguous runs by rollouts; per rank (its groups as (drawn prompt, rendered prompt,
        what the worker made), the step's rollout metrics, the step's template prompt)."""
        groups, taken = self.pipeline.take(step)
        made = [(m, lag) for (_, m), lag in zip(groups, taken.lags)]
        metrics = self.step_metrics(made, published, 0.0, started)
        items = [(*self.drawn.pop(job.key), result) for job, result in groups]
        ranks = 1 if self.dp is None else self.dp.size
        template = items[0][1]
        return [([items[i] for i in run], metrics, template)
                for run in balanced_runs([self.group_size] * len(items), ranks)]

    def stream(self, step: int) -> Iterator[StepBatch]:
        """Complete-group pipelining (`workers.pipe`): the step's groups as batches of their own, verified, as soon
        as they have finished; when the last is out, `streamed` holds the step's rollout/* metrics
        (`rollout/learner_wait_s`: the seconds spent waiting for the groups, the learner's idle time).

        With several learner ranks the groups go out in rounds, one group per rank a round (the next R to finish,
        rank r taking the r-th), so that every rank runs each round's stages and passes together (their
        collectives, and ZeRO-3's forwards, in step); a rank with no group in the last round takes it with a
        stand-in batch. ceil(B / R) rounds, known on every rank."""
        started = time.perf_counter()
        published, waited, made = self.publish(step), 0.0, []
        ranks = 1 if self.dp is None else self.dp.size
        groups = self.pipeline.stream(step) if self.pipeline is not None else None
        template = None
        for _ in range(-(-self.prompts.per_step // ranks)):
            start = time.perf_counter()
            shares = None
            if groups is not None:  # rank 0: the next finished groups, at most one per rank
                got = list(itertools.islice(groups, ranks))
                made += [(result, lag) for _, result, lag in got]
                items = [(*self.drawn.pop(job.key), result) for job, result, _ in got]
                template = template or items[0][1]
                shares = [([items[r]] if r < len(items) else [], template) for r in range(ranks)]
            mine, template = shares[0] if self.dp is None else self.dp.scatter_objects(shares)
            waited += time.perf_counter() - start
            yield self.batch_of(step, mine, template)
        metrics = self.step_metrics(made, published, 0.0, started) if groups is not None else None
        if groups is not None:
            next(groups, None)  # the pipeline's stream ends after the step's last group
        if self.dp is not None:
            metrics = self.dp.scatter_objects(None if metrics is None else [metrics] * ranks)
        self.streamed = {**metrics, "rollout/learner_wait_s": waited}
        self.version_seen = int(metrics["rollout/policy_version"])

    def publish(self, step: int) -> float:
        """This step's weights to the workers, every `sync_every` steps (and at the first step a run makes); the
        seconds it took. Every learner rank takes part (at ZeRO-3 the full weights are gathered for it, once);
        rank 0 publishes."""
        if self.published_step is not None and step - self.published_step < self.sync_every:
            return 0.0
        self.published_step = step
        start = time.perf_counter()
        with self.gathered():
            if self.pipeline is not None:
                self.pipeline.publish(self.publisher.publish(self.weights(), step))
        return time.perf_counter() - start

    def batch_of(self, step: int, items: list[tuple[Any, str, Any]], template: str | None = None) -> StepBatch:
        """The batch of `items` (each group's drawn prompt, rendered prompt and what its worker made of it): prompts,
        rows, rewards. No items (a rank given no group this step): one stand-in row on `template`."""
        batch = StepBatch(step, [d.example for d, _, _ in items], [text for _, text, _ in items],
                          [d.prompt_id for d, _, _ in items], [self.group_size] * len(items),
                          [d.example_id for d, _, _ in items], template=items[0][1] if items else template)
        if not items:
            batch.rows["on_policy"] = self.local.stand_in(batch)
            return batch
        device = self.local.generator.model.device
        parts = [self.local.rows_of(moved(made.samples, device), [(b, d.prompt_id, g) for g in range(self.group_size)],
                                    version=made.step)
                 for b, (d, _, made) in enumerate(items)]
        rows = concat_rows(parts, self.pad_id) if len(parts) > 1 else parts[0]
        rows.version = min(made.step for _, _, made in items)  # replaying the sampler's log-probs needs the step's own
        batch.rows["on_policy"] = rows
        verify(batch, self.task)
        batch.visits = group_records(batch)
        batch.metrics.update(rollout_metrics(rows, float(sum(made.samples.forwards for _, _, made in items))))
        return batch

    def step_metrics(self, made: list[tuple[Any, int]], published: float, waited: float,
                     started: float) -> dict[str, float]:
        """The step's rollout/* metrics and its pools' (`made`: what each group's worker returned, with its lag)."""
        adm, lags = self.pipeline.admission, [lag for _, lag in made]
        return {"rollout/lag_max": float(max(lags, default=0)), "rollout/lag_mean": sum(lags) / max(len(lags), 1),
                "rollout/lag_violations": float(adm.violations),
                "rollout/regenerated": float(self.pipeline.counters["regenerated"]),
                "rollout/worker_restarts": float(self.pipeline.counters["restarts"]),
                "rollout/policy_version": float(self.publisher.version),
                "rollout/publish_s": published, "rollout/snapshot_mb": self.publisher.last_mb,
                "rollout/learner_wait_s": waited, **self.meter(made, started)}

    @property
    def version(self) -> int:
        """The newest published policy version (rank 0's, as of its last step on the other ranks)."""
        return self.publisher.version if self.publisher is not None else self.version_seen

    def resume_state(self) -> dict[str, Any]:
        """Where a resumed run draws again: the first prompt not trained on, and those after it that were."""
        untrained = sorted(self.drawn)
        first = untrained[0] if untrained else self.prompts.position
        done_after = sorted(q for q in range(first, self.prompts.position) if q not in self.drawn) + \
            sorted(q for q in self.skip if q >= first)
        return {"position": first, "trained_after": sorted(set(done_after))}

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()
            self.pool.close()
        if self.owns_ray:
            stop_ray()

