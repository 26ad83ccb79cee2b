"""The stages of one RL step, each testable alone, with a `StepBatch` of plain data flowing between them.

    choose prompts -> (allocate) -> generate -> verify -> external rollouts -> advantages -> (reweight)
    -> (replayed rows) -> old/ref log-probs -> (sampler correction) -> update -> (after update) -> metrics
    (the checkpoint is the loop's)

The stages up to "verify" are in `dllm_rl/collect.py` (with the `StepBatch`), the update in `dllm_rl/learner.py`,
the held-out evaluation and the bandit's probe in `dllm_rl/held_out.py`, the rest here. Their order after the
rollouts is one list, `dllm_rl/step.py`, which the synchronous and the streamed step both run (a test checks that
each stage's reads are written before it), and `step.OWNERS` names the one stage that writes each field of the
`StepBatch`.

| stage              | here                        | reads                        | writes                             |
|--------------------|-----------------------------|------------------------------|------------------------------------|
| choose prompts     | `PromptSource`              | the train split, the step    | the step's prompts                 |
|                    |                             |                              | (`Drawn`, global)                  |
| allocate           | `Curation.allocate`,        | curation state               | a new batch: this rank's prompts   |
|                    | `PromptSource.batch`        |                              |                                    |
| generate           | `InProcessRollouts`         | prompts, their group sizes   | rows["on_policy"]: tokens, texts   |
| select             | `Curation.select`           | fresh rows                   | rows kept, loss weights            |
| verify             | `verify`                    | every source's texts         | their rewards                      |
| external rollouts  | `ExternalRollouts` (ERILS)  | prompts, on-policy           | rows["external"],                  |
|                    |                             | correctness                  | external/* metrics                 |
|   (its prefetch)   | `ExternalRollouts.prefetch` | the round's prompts, before  | a served source's requests         |
|                    |                             | "generate"                   | in flight                          |
| advantages         | `assign_advantages`         | rewards                      | adv_N (and external weights)       |
| reweight           | `Curation.reweight`         | groups, the sampler's record | adv_N, weights, auxiliary SFT rows |
|                    |                             |                              | (and the bandit's picks, its state)|
| replayed rows      | `ReplaySource` (curation/   | the bandit's picks           | rows["replay"] (provenance,        |
|                    | replay.py)                  |                              | version_N)                         |
| old/ref log-probs  | `score_old_and_reference`   | rows, the sampler's record   | mask seeds, old_logp, ref_logp     |
| sampler correction | `SamplerCorrectionStage`    | on-policy rows, sampler logp | their loss weights, correction/*   |
| update             | `Learner.update`            | every row, the auxiliary     | the weights; loss and policy       |
|                    |                             | rows                         | metrics                            |
| after update       | `Curation.after_update`     | the step's rows, a probe     | the bandit's scorer, replay buffer |
| metrics            | `step_metrics`              | the batch                    | the step's metrics (over ranks)    |

`CollectRollouts` runs choose prompts through verify, in rounds where dynamic sampling asks for more, and
`observe_curation` gives the strategies every rank's groups after the external rows (dllm_rl/curation/). Rows are
keyed by (the global id of their prompt, their index among its rollouts), never by position: a prompt may get any
number of rollouts (0 leaves it out of the step), a filter may drop any rows (`Rows.select`), and every later
stage works on the groups as they are. Where later capabilities go, without editing the other stages: a prompt
filter or a rollout allocator decides the rollouts per prompt between "choose prompts" and "generate" (the same
decision on every rank), a row filter runs after "verify"; rollouts from workers replace `InProcessRollouts`
(`workers.count`: `RemoteRollouts`; with `workers.max_staleness` > 0 or `workers.pipe`, `PipelinedRollouts`
replaces `CollectRollouts`, and with `workers.pipe` each group runs the stages from "external rollouts" to "update"
alone as it arrives, dllm_rl/workers/pipe.py); a cached or parallel sampler is another `TextGenerator`-like object
inside `InProcessRollouts` (anything with `sample(prompts, seeds) -> Samples`).

A row's loss weight is a product of named factors (`Rows.weigh`: `sera`, `dropout`, `bandit`,
`sampler_correction`, ERILS's `mixing` and `importance`), taken in name order, so the stages that write them may
run in any order without changing a bit of it; each factor's mean and share of zeros is logged
(`weight/<source>/<factor>`, `..._zeros`).

Which rows are this rank's and where they sit among all ranks' rows is `dllm_rl.data_parallel`'s business;
a stage that needs a global index reads it from `Rows.shard` or asks the `DataParallel` object it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from dllm_rl.algo.advantages import group_advantages
from dllm_rl.algo.correction import SamplerCorrection, correction_weights, rollout_log_ratio
from dllm_rl.buffer import Rows
from dllm_rl.collect import StepBatch, eval_mode
from dllm_rl.data.task import Task
from dllm_rl.data_parallel import DataParallel
from dllm_rl.external.mixer import local_only
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.seeds import derive_seed

# Metrics that count rows or prompts: added up over data-parallel ranks (every other metric is averaged).
COUNTS = tuple(f"external/{k}" for k in ("candidates", "too_long", "truncated", "unrepresentable", "incorrect",
                                         "prompts", "rows", "requests", "failed_requests", "retries",
                                         "prefetched", "empty", "length_stopped", "episodes", "no_move")) + (
    "rollouts/on_policy", "curation/dropout_dropped", "curation/rows_dropped", "curation/dropout_positive") + tuple(
    f"curation/{kind}_{what}" for kind in ("echo", "echo_external") for what in ("clips", "tokens")) + (
    "curation/hindsight_rows", "curation/hindsight_failed")


# ------------------------------------------------------------------------------------------ external, advantages


@dataclass
class ExternalRollouts:
    """ERILS: the external policy's rows for the triggered prompts (see `dllm_rl.external.mixer`)."""

    mixer: Any  # an ExternalMixer
    task: Task
    tokenizer: Any
    window: int  # the dLLM's generation window (length control is relative to it)
    eos_id: int
    max_length: int | None  # the dLLM's context
    seed: int
    dp: DataParallel
    autocast: ContextManager
    device: torch.device  # the policy's: where the external rows are made

    def __call__(self, batch: StepBatch) -> None:
        """External rows for the prompts that still have on-policy rows (a filter may have dropped a group)."""
        on = batch.real("on_policy")
        active = [] if on is None else sorted(set(on.prompt_N.tolist()))
        correct = [[r.correct for r, p in zip(on.rewards, on.prompt_N.tolist()) if p == b] for b in active]
        width = max(map(len, correct), default=0)
        # cpu: the trigger is decided in Python from these flags (padded with False) and seeded CPU uniforms
        correct_BG = torch.tensor([flags + [False] * (width - len(flags)) for flags in correct], dtype=torch.bool)
        with self.autocast:
            rows, metrics = self.mixer.rows(step=batch.step, seed=self.seed, task=self.task,
                                            examples=[batch.examples[b] for b in active],
                                            prompt_texts=[batch.prompt_texts[b] for b in active], correct_BG=correct_BG,
                                            tokenizer=self.tokenizer, window=self.window, eos_id=self.eos_id,
                                            max_length=self.max_length,
                                            prompt_ids=[batch.prompt_ids[b] for b in active],
                                            widest=self.dp.widest, device=self.device)
        if rows is not None:
            rows.prompt_N = torch.tensor(active, device=rows.prompt_N.device)[rows.prompt_N]
            batch.rows["external"] = rows
        batch.metrics.update(metrics)


    def prefetch(self, batch: StepBatch) -> None:
        """Before the dLLM generates: start the source's requests for these prompts (`ExternalMixer.prefetch`)."""
        self.mixer.prefetch(step=batch.step, seed=self.seed, task=self.task, examples=batch.examples,
                            prompt_ids=batch.prompt_ids)


def assign_advantages(batch: StepBatch, advantage: str, mixer, dp: DataParallel) -> None:
    """Every row's advantage: the on-policy group statistic over each prompt's rows, whatever their number
    (`group_advantages`), and with ERILS the external rows' own (the mixer's `processing` and `statistic`; its
    running baseline moves by the mean over all ranks)."""
    on = batch.rows["on_policy"]
    if mixer is not None:
        mixer.assign_advantages(on, batch.rows.get("external"), advantage, gather=dp.gather)
    elif not on.inert:
        on.adv_N = group_advantages(on.rewards_N, on.prompt_N, advantage)


# ------------------------------------------------------------------------------------------ old/ref log-probs


def score_old_and_reference(batch: StepBatch, policy, reference, iterations: int, reuse_current: bool, seed: int,
                            autocast: ContextManager, mixer=None, dp: DataParallel | None = None,
                            replay: bool = False, micro_rows: int = 0) -> None:
    """Each row's estimator mask seed per inner iteration (a function of seed, step, iteration, source and the
    row's key: old, reference and current policy share it), then its old and reference log-probs under those masks.
    With `reuse_current` (one iteration, one minibatch) the old log-probs are the current ones detached, as in
    d1. With `replay` (`likelihood.estimators.replays_rollout`: the sampler recorded the estimator's very values)
    the on-policy rows made by the current policy (their version is the step) take the sampler's log-probs as the
    old ones, with no forward; it is the same decision on every rank, so ZeRO-3's forwards stay in step. With the
    mixer's importance correction, the external rows' weights from their old log-probs. With `micro_rows`, at most
    about that many rows per forward (as many calls on every rank). Scored in eval mode:
    dropout (LoRA's) would make them noisy and draw from the global RNG."""
    for source, rows in batch.rows.items():
        if source == "replay" and rows.mask_seeds:  # replayed rows keep the seeds they were first scored with
            continue
        tag = () if source == "on_policy" else (source,)
        rows.mask_seeds = [[0] * len(rows) if rows.inert else
                           [derive_seed(seed, "mask", batch.step, it, *tag, q, g) for q, g in rows.keys]
                           for it in range(iterations)]
    lockstep = dp.lockstep if dp is not None else None
    with torch.no_grad(), autocast, eval_mode(policy.model):
        for rows in batch.rows.values():
            calls = 1 if not micro_rows else -(-len(rows) // micro_rows)
            calls = dp.agreed([calls])[0] if dp is not None and micro_rows else calls
            replayed = replay and rows.source == "on_policy" and rows.version == batch.step
            rows.old_logp = [None if reuse_current else rows.sampler_logp_NC.float() if replayed
                             else rows.score_all(policy, it, lockstep, calls) for it in range(iterations)]
            if rows.source == "on_policy":
                batch.metrics["likelihood/old_from_rollout"] = float(replayed and not reuse_current)
            rows.ref_logp = [None if reference is None else rows.score_all(reference, it, lockstep, calls)
                             for it in range(iterations)]
    if mixer is not None and mixer.config.correction == "is":
        batch.metrics.update(mixer.importance_weights(batch.real("external"), dp.gather if dp else local_only))


@dataclass
class SamplerCorrectionStage:
    """Sparse-RL's correction of the on-policy rollouts (`dllm_rl/algo/correction.py`): the learner's probability
    of each committed token at the state it was committed from (the `ordered` estimator, in the rollouts'
    inference context: eval mode and, at ZeRO-3, the gathered parameters, since the number of forwards follows
    the rank's own rollouts), against the sampler's; rejection and truncated weights into the rows' loss
    weights."""

    config: SamplerCorrection
    policy: Any
    inference: Callable[[], ContextManager]

    def __call__(self, batch: StepBatch) -> None:
        for source in ("on_policy", "replay"):  # replayed rows (the bandit's) were sampled by an older policy
            on = batch.rows.get(source) if source == "on_policy" else batch.real(source)
            if on is None:
                continue
            with torch.no_grad(), self.inference():
                learner_NC = ORDERED.logp(self.policy, on.ids_NL, on.attention_mask_NL, on.prompt_length,
                                          order_NC=on.order_NC)
            weight_N, metrics = correction_weights(rollout_log_ratio(learner_NC, on.sampler_logp_NC, on.mask_NC),
                                                   self.config)
            on.weigh("sampler_correction", weight_N)
            if source == "on_policy":
                batch.metrics.update(metrics)


ORDERED = build_estimator({"name": "ordered", "group": 1})


# ------------------------------------------------------------------------------------------ metrics


def source_metrics(rows: Rows) -> dict[str, float]:
    """reward/<source>, len/<source> and adv/<source> (mean advantage) for one source's rows; and for each named
    loss-weight factor its mean and share of zeros (weight/<source>/<factor>, weight/<source>/<factor>_zeros)."""
    out = {f"reward/{rows.source}": float(rows.rewards_N.mean()), f"len/{rows.source}": float(rows.lengths_N.mean()),
           f"adv/{rows.source}": float(rows.adv_N.mean())}
    for name, factor_N in rows.factors.items():
        out[f"weight/{rows.source}/{name}"] = float(factor_N.float().mean())
        out[f"weight/{rows.source}/{name}_zeros"] = float((factor_N == 0).float().mean())
    return out


def flat_groups(rows: Rows) -> list[bool]:
    """Per prompt with rows, in prompt order: whether its rewards are all equal (a group of one is flat)."""
    rewards, prompts = rows.rewards_N.tolist(), rows.prompt_N.tolist()
    groups: dict[int, list[float]] = {}
    for r, p in zip(rewards, prompts):
        groups.setdefault(p, []).append(r)
    return [len(set(groups[p])) == 1 for p in sorted(groups)]


def step_metrics(batch: StepBatch, learner_metrics: dict[str, float], perf: dict[str, float],
                 dp: DataParallel) -> dict[str, float]:
    """The step's metrics over all ranks: counts added up, row means weighted by each rank's rows (so N ranks
    holding uneven rows report what one process does), the rest averaged. `rollouts/on_policy` counts the
    step's on-policy rows."""
    on, ext = batch.real("on_policy"), batch.real("external")
    metrics, weights = {**batch.metrics, **learner_metrics, **perf}, {}
    metrics["rollouts/on_policy"] = float(len(on)) if on is not None else 0.0
    for rows in (on, ext, batch.real("replay")):
        if rows is not None:
            part = source_metrics(rows)
            metrics.update(part)
            weights.update(dict.fromkeys(part, float(len(rows))))
    if on is not None:
        rewards, flat = on.rewards, flat_groups(on)
        metrics.update({"reward/accuracy": sum(r.correct for r in rewards) / len(rewards),
                        "reward/format": sum(r.formatted for r in rewards) / len(rewards),
                        "reward/zero_std_groups": sum(flat) / len(flat),
                        "perf/tokens_per_s": float(on.lengths_N.sum()) / max(perf.get("perf/rollout_s", 0.0), 1e-9)})
        weights.update({"reward/accuracy": len(rewards), "reward/format": len(rewards),
                        "reward/zero_std_groups": len(flat)})
    if batch.episodes:  # a multi-turn step: its episode means weighted by episodes, the invalid share by turns
        weights.update(dict.fromkeys(("env/success", "env/turns", "env/truncated"), float(len(batch.episodes))))
        weights["env/invalid"] = float(sum(len(ep.turns) for ep in batch.episodes))
        groups = float(len({ep.prompt_id for ep in batch.episodes}))
        weights.update(dict.fromkeys(("env/anchors_shared", "external/anchors_shared"), groups))
        weights["external/success"] = batch.metrics.get("external/candidates", 0.0)
    out = dp.mean_metrics(metrics, summed=COUNTS, weights=weights)
    for kind in ("echo", "echo_external"):  # echo clips: their mean length over every rank's clips
        if out.get(f"curation/{kind}_clips"):
            out[f"curation/{kind}_clip_len"] = out[f"curation/{kind}_tokens"] / out[f"curation/{kind}_clips"]
    return out


def sample_rows(batch: StepBatch) -> list[dict[str, Any]]:
    """samples.jsonl records: the first rollout of every on-policy group and every external row."""
    out = []
    for rows in (batch.real("on_policy"), batch.real("external")):
        if rows is None:
            continue
        prompts = rows.prompt_N.tolist()
        picked = range(len(rows)) if rows.source != "on_policy" else \
            [n for n, p in enumerate(prompts) if p not in prompts[:n]]
        out += [{"source": rows.source, "version": rows.version, "prompt": batch.prompt_texts[prompts[n]],
                 "completion": rows.texts[n], "reward": rows.rewards[n].score, "reason": rows.rewards[n].reason,
                 "advantage": float(rows.adv_N[n])} for n in picked]
    return out
