"""`workers.pipe=true`: complete-group pipelining (RolloutPipe). Each of the step's groups enters the learner as
soon as a worker has finished it: its external rows, advantages and scoring, then its forward and backward passes,
while the workers are still generating the step's other groups; the gradients accumulate and the step ends with
one optimizer step, equal to the synchronous update up to float rounding (`Learner.update_stream` says how the
loss normaliser, known only once every group is in, is applied; tested against `Learner.update`).

It works at any staleness bound (at S = 0 the step's groups are its own, from this step's weights: on-policy) and
needs what keeps every stage before the update local to a group: one inner iteration and one minibatch (one
update per step), no curation (its decisions are over the whole step), ERILS without self-normalised importance
weights (`mixing.correction=is` with `is_self_normalize`: divided by their mean over the step's rows), ZeRO stage 0
or 3 (`Engine.stream_update`) and DeepSpeed's fp32 weights (its bf16 mode keeps the gradient in buffers of its own);
the config refuses the rest by name. With several learner ranks the groups come in rounds, one per rank
(`PipelinedRollouts.stream`), every rank running each round's stages and passes together. The Sparse-RL correction's metrics (`correction/*`)
are then means of each group's, weighted by its rows. ERILS's running baseline (`mixing.statistic=running`) is held
at its value at the step's start while the groups arrive and moved once at the end (`ExternalMixer.baseline_held`):
the synchronous step's advantages.

The step's metrics: `perf/rollout_s` is the time the learner waited for groups (its idle time, also
`rollout/learner_wait_s`), `perf/external_s` and `perf/score_s` the per-group stages added up, `perf/update_s`
the rest (forwards, backwards, the optimizer step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import torch

from dllm_rl.buffer import Rows, concat_rows
from dllm_rl.collect import StepBatch
from dllm_rl.stages import COUNTS, step_metrics
from dllm_rl.step import AFTER_UPDATE, BEFORE_UPDATE, StepParts
from dllm_rl.tracking import PhaseTimer


def run_piped_step(parts: StepParts, step: int, timer: PhaseTimer) -> tuple[StepBatch, dict[str, float]]:
    """One step of `dllm_rl.train.run_step` with its groups streamed into the update (`parts.collect` is a
    `PipelinedRollouts`)."""
    stage, dp = parts.collect, parts.dp

    def prepare(group: StepBatch) -> None:  # the step's stages that one group can run alone, in the step's order
        for each in BEFORE_UPDATE:
            if each.per_group:
                with timer(each.phase):
                    each.run(parts, group)

    start = time.perf_counter()
    timer.current = "update"
    mixer = parts.external.mixer if parts.external is not None else None
    with mixer.baseline_held() if mixer is not None else contextlib.nullcontext():
        update_metrics, groups = parts.learner.update_stream(stage.stream(step), prepare)
    batch = merge_groups(groups, parts.pad_id)
    for each in AFTER_UPDATE:
        each.run(parts, batch)
    batch.metrics.update(stage.streamed)
    waited = stage.streamed["rollout/learner_wait_s"]
    busy = sum(timer.seconds.get(phase, 0.0) for phase in ("external", "score"))
    timer.seconds["rollout"] = waited
    timer.seconds["update"] = max(0.0, time.perf_counter() - start - waited - busy)
    return batch, step_metrics(batch, update_metrics, timer.metrics(), dp)


def merge_groups(groups: list[StepBatch], pad_id: int) -> StepBatch:
    """The step's groups, each scored and trained on, as one batch for the step's metrics and samples: the
    prompts one after the other in prompt order, each source's rows concatenated (prompts re-indexed), with their
    rewards, advantages, weights and clip counts (the scoring state, per group, is left out); counts and seconds
    added up, the other metrics weighted by each group's on-policy rows."""
    real = [g for g in groups if not g.rows["on_policy"].inert]  # a rank's stand-ins (several ranks) left out
    if not real:  # this rank had no group at all this step: its stand-in is its batch
        return groups[0]
    groups = sorted(real, key=lambda g: g.prompt_ids)  # in prompt order, as the synchronous step has them
    first = groups[0]
    merged = StepBatch(first.step, [], [], [], [], [], template=first.template)
    sources: dict[str, list[Rows]] = {}
    for group in groups:
        offset = len(merged.examples)
        for source, rows in group.rows.items():
            if not rows.inert:
                sources.setdefault(source, []).append(dataclasses.replace(
                    rows, prompt_N=rows.prompt_N + offset, shard=None, mask_seeds=[], old_logp=[], ref_logp=[]))
        merged.examples += group.examples
        merged.prompt_texts += group.prompt_texts
        merged.prompt_ids += group.prompt_ids
        merged.group_sizes += group.group_sizes
        merged.example_ids += group.example_ids
        merged.visits += group.visits
    for source, parts in sources.items():
        merged.rows[source] = concatenated(parts, pad_id)
    merged.metrics = merged_metrics([g.metrics for g in groups], [len(g.rows["on_policy"]) for g in groups])
    return merged


def concatenated(parts: list[Rows], pad_id: int) -> Rows:
    """`concat_rows` of scored rows: a field some parts lack (a group without an update has no clip counts, one
    without a correction no weights) filled with what it means there."""
    fills = {"weight_N": lambda r: torch.ones(len(r), device=r.ids_NL.device),
             "adv_N": lambda r: torch.zeros(len(r), device=r.ids_NL.device),
             "clip_counts_N2": lambda r: torch.zeros(len(r), 2, device=r.ids_NL.device)}
    for name, fill in fills.items():
        if any(getattr(r, name) is not None for r in parts):
            parts = [r if getattr(r, name) is not None else dataclasses.replace(r, **{name: fill(r)}) for r in parts]
    rows = concat_rows(parts, pad_id)
    counts = [r.clip_counts_N2 for r in parts]
    rows.clip_counts_N2 = torch.cat(counts) if counts[0] is not None else None
    rows.version = min(r.version for r in parts)
    return rows


def merged_metrics(metrics: list[dict[str, float]], rows: list[int]) -> dict[str, float]:
    """The groups' own metrics as the step's: counts and seconds added up, maxima and minima over the groups,
    the rest weighted by rows."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in metrics for k in m):
        have = [(m[key], n) for m, n in zip(metrics, rows) if key in m]
        if key in COUNTS or key == "rollout/forwards" or key.endswith("_s"):
            out[key] = sum(v for v, _ in have)
        elif key.endswith(("_max", "_min")):
            out[key] = (max if key.endswith("_max") else min)(v for v, _ in have)
        else:
            total = sum(n for _, n in have)
            out[key] = sum(v * n for v, n in have) / total if total else sum(v for v, _ in have) / len(have)
    return out
