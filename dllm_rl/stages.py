"""The stages of one RL step, each testable alone, with a `StepBatch` of plain data flowing between them.

    choose prompts -> generate -> verify -> external rollouts -> advantages -> old/ref log-probs
    -> (sampler correction) -> update -> metrics (the checkpoint is the loop's)

| stage              | here                        | reads                          | writes                              |
|--------------------|-----------------------------|--------------------------------|-------------------------------------|
| choose prompts     | `PromptSource`              | the train split, the step      | a new batch: this rank's prompts    |
| generate           | `InProcessRollouts`         | prompts                        | rows["on_policy"]: tokens, texts    |
| verify             | `verify`                    | every source's texts           | their rewards                       |
| external rollouts  | `ExternalRollouts` (ERILS)  | prompts, on-policy correctness | rows["external"], external/* metrics|
| advantages         | `assign_advantages`         | rewards                        | adv_N (and external weights)        |
| old/ref log-probs  | `score_old_and_reference`   | rows, their shards             | mask seeds, old_logp, ref_logp      |
| sampler correction | `SamplerCorrectionStage`    | on-policy rows, sampler logp   | their loss weights, correction/*    |
| update             | `Learner.update`            | every row                      | the weights; loss and policy metrics|
| metrics            | `step_metrics`              | the batch                      | the step's metrics (over ranks)     |

Where later capabilities go, without editing the other stages: a prompt filter or a rollout allocator is a
function of the batch between "choose prompts" and "generate" (it may drop prompts) or after "verify" (it may
drop rows); rollouts from workers replace `InProcessRollouts` with any callable that returns on-policy `Rows`
whose `version` is the policy that made them; a cached or parallel sampler is another `TextGenerator`-like
object inside `InProcessRollouts` (anything with `sample(prompts, seeds) -> Samples`).

Which rows are this rank's and where they sit among all ranks' rows is `dllm_rl.data_parallel`'s business;
a stage that needs a global index reads it from `Rows.shard` or asks the `DataParallel` object it is given.
"""

from __future__ import annotations

import contextlib
import random
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager

import torch

from dllm_rl.algo.advantages import compute_advantages
from dllm_rl.algo.correction import SamplerCorrection, correction_weights, rollout_log_ratio
from dllm_rl.algo.losses import aggregation_units, grpo_loss
from dllm_rl.buffer import Rows, loss_inputs
from dllm_rl.data.task import Example, Task, render_prompt, train_examples_up_to
from dllm_rl.data_parallel import DataParallel
from dllm_rl.engine import Engine
from dllm_rl.errors import RunStopped, require
from dllm_rl.evaluate import evaluate_task
from dllm_rl.external.mixer import local_only
from dllm_rl.likelihood.estimators import Estimator, build_estimator
from dllm_rl.rollout.diversity import distinct_share, pairwise_agreement
from dllm_rl.rollout.sampler import completion_mask, completion_texts
from dllm_rl.seeds import derive_seed

# Metrics that count rows or prompts: added up over data-parallel ranks (every other metric is averaged).
COUNTS = tuple(f"external/{k}" for k in ("candidates", "too_long", "truncated", "unrepresentable", "incorrect",
                                         "prompts", "rows"))


@dataclass
class StepBatch:
    """What flows between the stages of one step, on one rank."""

    step: int
    examples: list[Example]  # this rank's prompts
    prompt_texts: list[str]  # as the dLLM reads them (chat template applied)
    prompt_offset: int  # global index of examples[0] among the step's prompts
    rows: dict[str, Rows] = field(default_factory=dict)  # per source: "on_policy" first, then "external"
    metrics: dict[str, float] = field(default_factory=dict)  # what the stages measured (external/*, ...)

    def real(self, source: str) -> Rows | None:
        """A source's rows, or None where this rank has none (or only a data-parallel stand-in)."""
        rows = self.rows.get(source)
        return None if rows is None or rows.inert else rows


# ------------------------------------------------------------------------------------------ choose prompts


class PromptSource:
    """The step's prompts: the train split's first `pool` examples (all of a smaller split) in a fresh seeded
    order every epoch, and this rank's whole groups of them. `position` (prompts consumed) is all its state (saved with checkpoints)."""

    def __init__(self, task: Task, tokenizer, dp: DataParallel, per_step: int, pool: int, seed: int,
                 position: int = 0):
        self.examples = train_examples_up_to(task, pool, seed)  # a small train file: all of it
        self.task, self.tokenizer, self.dp, self.per_step = task, tokenizer, dp, per_step
        self.seed, self.position = seed, position

    def next(self, count: int) -> list[Example]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.examples))
            order = list(range(len(self.examples)))
            random.Random(f"{self.seed}|epoch{epoch}").shuffle(order)
            out.append(self.examples[order[index]])
            self.position += 1
        return out

    def __call__(self, step: int) -> StepBatch:
        examples, first = self.dp.local_prompts(self.next(self.per_step))
        texts = [render_prompt(self.task.prompt(ex), self.tokenizer) for ex in examples]
        return StepBatch(step, examples, texts, first)


# ------------------------------------------------------------------------------------------ generate, verify


@contextlib.contextmanager
def eval_mode(network: torch.nn.Module):
    """`network` in eval mode for the duration (no dropout), back in the mode it was in after."""
    was_training = network.training
    network.eval()
    try:
        yield
    finally:
        network.train(was_training)


@contextlib.contextmanager
def inference(net: torch.nn.Module, engine: Engine, autocast: ContextManager):
    """Eval mode, autocast and (ZeRO-3) the full parameters for the duration: how the policy generates."""
    net.eval()
    try:
        with autocast, engine.gathered():
            yield
    finally:
        net.train()


@dataclass
class InProcessRollouts:
    """G denoising rollouts per prompt from the current policy, sampled in this process. Row n of the step
    (global numbering) draws from seed (seed, "rollout", step, n), so it does not depend on the rank or batch."""

    generator: Any  # a TextGenerator over the policy: sample(prompts, seeds) -> Samples
    estimator: Estimator
    group_size: int
    seed: int
    inference: Callable[[], ContextManager]

    def __call__(self, batch: StepBatch) -> Rows:
        G, tokenizer, eos_id = self.group_size, self.generator.tokenizer, self.generator.eos_id
        first = batch.prompt_offset * G
        prompts = [text for text in batch.prompt_texts for _ in range(G)]
        with self.inference():
            samples = self.generator.sample(prompts, [derive_seed(self.seed, "rollout", batch.step, first + n)
                                                      for n in range(len(prompts))])
        batch.metrics.update({"rollout/forwards": float(samples.forwards),
                              "rollout/distinct": distinct_share(samples.completion_BC, G),
                              "rollout/agreement": pairwise_agreement(samples.completion_BC, G)})
        return Rows("on_policy", samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length,
                    completion_mask(samples.completion_BC, eos_id), samples.unmask_step_BC,
                    torch.arange(len(batch.examples), device=samples.sequences_BL.device).repeat_interleave(G), [],
                    completion_texts(tokenizer, samples.completion_BC, eos_id), version=batch.step,
                    estimator=self.estimator, sampler_logp_NC=samples.confidence_BC.clamp(min=1e-30).log())


def verify(batch: StepBatch, task: Task) -> None:
    """The task's verifiable reward of every row that has none yet."""
    for rows in batch.rows.values():
        if not rows.rewards:
            rows.rewards = [task.reward(text, batch.examples[int(p)]) for text, p in zip(rows.texts, rows.prompt_N)]


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
        on = batch.rows["on_policy"]
        # cpu: the trigger is decided in Python from these flags and seeded CPU uniforms
        correct_BG = torch.tensor([r.correct for r in on.rewards]).view(len(batch.examples), -1)
        with self.autocast:
            rows, metrics = self.mixer.rows(step=batch.step, seed=self.seed, task=self.task, examples=batch.examples,
                                            prompt_texts=batch.prompt_texts, correct_BG=correct_BG,
                                            tokenizer=self.tokenizer, window=self.window, eos_id=self.eos_id,
                                            max_length=self.max_length, prompt_offset=batch.prompt_offset,
                                            widest=self.dp.widest, device=self.device)
        if rows is not None:
            batch.rows["external"] = rows
        batch.metrics.update(metrics)


def assign_advantages(batch: StepBatch, advantage: str, mixer, dp: DataParallel) -> None:
    """Every row's advantage: the on-policy group statistic, and with ERILS the external rows' own (the mixer's
    `processing` and `statistic`; its running baseline moves by the mean over all ranks)."""
    on = batch.rows["on_policy"]
    rewards_BG = on.rewards_N.view(len(batch.examples), -1)
    if mixer is None:
        on.adv_N = compute_advantages(rewards_BG, advantage).reshape(-1)
    else:
        mixer.assign_advantages(on, batch.rows.get("external"), rewards_BG, advantage, gather=dp.gather)


# ------------------------------------------------------------------------------------------ old/ref log-probs


def score_old_and_reference(batch: StepBatch, policy, reference, iterations: int, reuse_current: bool, seed: int,
                            autocast: ContextManager, mixer=None, dp: DataParallel | None = None) -> None:
    """Each row's estimator mask seed per inner iteration (a function of seed, step, iteration, source and global
    row: old, reference and current policy share it), then its old and reference log-probs under those masks.
    With `reuse_current` (one iteration, one minibatch) the old log-probs are the current ones detached, as in
    d1. With the mixer's importance correction, the external rows' weights from their old log-probs. Scored in
    eval mode: dropout (LoRA's) would make them noisy and draw from the global RNG."""
    for source, rows in batch.rows.items():
        tag = () if source == "on_policy" else (source,)
        start = rows.shard.start if rows.shard is not None else 0
        rows.mask_seeds = [[0] * len(rows) if rows.inert else
                           [derive_seed(seed, "mask", batch.step, it, *tag, start + n) for n in range(len(rows))]
                           for it in range(iterations)]
    lockstep = dp.lockstep if dp is not None else None
    with torch.no_grad(), autocast, eval_mode(policy.model):
        for rows in batch.rows.values():
            rows.old_logp = [None if reuse_current else rows.score_all(policy, it, lockstep)
                             for it in range(iterations)]
            rows.ref_logp = [None if reference is None else rows.score_all(reference, it, lockstep)
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
        on = batch.rows["on_policy"]
        with torch.no_grad(), self.inference():
            learner_NC = ORDERED.logp(self.policy, on.ids_NL, on.attention_mask_NL, on.prompt_length,
                                      order_NC=on.order_NC)
        weight_N, metrics = correction_weights(rollout_log_ratio(learner_NC, on.sampler_logp_NC, on.mask_NC),
                                               self.config)
        on.weight_N = weight_N if on.weight_N is None else on.weight_N * weight_N
        batch.metrics.update(metrics)


ORDERED = build_estimator({"name": "ordered", "group": 1})


# ------------------------------------------------------------------------------------------ update


@dataclass
class Learner:
    """mu inner iterations over minibatches of the step's rows (the single-process plan, cut to this rank's
    rows), the clipped surrogate (+ beta * KL) per minibatch, one engine update each; then the LR schedule and
    the reference sync. A step without a learning signal (no row on any rank with both a non-zero advantage
    and a non-zero loss weight) makes no update, so AdamW's moments cannot move the weights on zero gradients;
    it is logged as `policy/no_signal` = 1.
    A non-finite loss or gradient skips its update; `max_bad_steps` of them in a row stop the run."""

    engine: Engine
    policy: Any  # the DiffusionPolicy over the engine
    reference: Any  # the frozen reference DiffusionPolicy, or None (beta = 0)
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loss_options: dict[str, Any]  # grpo_loss's keyword options (eps, beta, kl, aggregation, ...)
    iterations: int
    reuse_current: bool
    minibatch_mix: str
    seed: int
    dp: DataParallel
    autocast: ContextManager
    ref_sync_every: int = 0
    max_bad_steps: int = 5
    bad_steps: int = 0  # non-finite updates in a row (saved with checkpoints)

    def update(self, batch: StepBatch) -> dict[str, float]:
        parts = list(batch.rows.values())
        informative = self.dp.any(any(bool(has_signal(p).any()) for p in parts))
        aggregation = self.loss_options.get("aggregation", "token")
        losses: list[dict[str, float]] = []
        for it in range(self.iterations) if informative else []:
            # cpu: the minibatch plan is the same on every device (see dllm_rl/device.py)
            shuffle = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, "minibatch", batch.step, it))
            for picks in self.dp.minibatch_plan(parts, self.minibatch_mix, shuffle):
                with self.autocast:
                    inputs = loss_inputs(parts, picks, self.policy, it, self.reuse_current, pad_empty=self.dp.pads,
                                         lockstep=self.dp.lockstep)
                units = self.dp.total(aggregation_units(inputs["mask_NC"], aggregation, inputs["weights_N"]))
                loss, metrics = grpo_loss(**inputs, **self.loss_options, global_units=units, ranks=self.dp.size)
                update = self.engine.update(loss)
                if not update.applied:
                    self.bad_update(batch.step, update.skipped)
                    continue
                self.bad_steps = 0
                losses.append({**metrics, "policy/grad_norm": update.grad_norm})
        with warnings.catch_warnings():  # a step without an update still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        if self.reference is not None and self.ref_sync_every > 0 and (batch.step + 1) % self.ref_sync_every == 0:
            self.engine.sync_reference(self.reference.model)
        out = {"policy/updates": float(len(losses)), "policy/lr": self.scheduler.get_last_lr()[0],
               "policy/no_signal": float(not informative)}
        return {**out, **{k: sum(m[k] for m in losses) / len(losses) for k in (losses[0] if losses else {})}}

    def bad_update(self, step: int, why: str) -> None:
        self.bad_steps += 1
        warnings.warn(f"step {step}: non-finite loss or gradient; update skipped ({self.bad_steps} in a row: {why})")
        if self.bad_steps >= self.max_bad_steps:
            raise RunStopped(f"stopping: {self.bad_steps} non-finite updates in a row (max_bad_steps="
                             f"{self.max_bad_steps}); lower lr, or resume from the last checkpoint")


def has_signal(rows: Rows) -> torch.Tensor:
    """signal_N: the rows that can move the weights: a non-zero advantage and a non-zero loss weight (a row
    rejected by the sampler correction, or dropped by a filter, has weight 0)."""
    signal_N = rows.adv_N != 0
    return signal_N if rows.weight_N is None else signal_N & (rows.weight_N != 0)


# ------------------------------------------------------------------------------------------ metrics


def source_metrics(rows: Rows) -> dict[str, float]:
    """reward/<source>, len/<source> and adv/<source> (mean advantage) for one source's rows."""
    return {f"reward/{rows.source}": float(rows.rewards_N.mean()), f"len/{rows.source}": float(rows.lengths_N.mean()),
            f"adv/{rows.source}": float(rows.adv_N.mean())}


def step_metrics(batch: StepBatch, learner_metrics: dict[str, float], perf: dict[str, float],
                 dp: DataParallel) -> dict[str, float]:
    """The step's metrics, averaged over ranks (counts added up)."""
    on, ext = batch.rows["on_policy"], batch.real("external")
    rewards = on.rewards
    metrics = {
        **source_metrics(on), **(source_metrics(ext) if ext is not None else {}), **batch.metrics,
        "reward/accuracy": sum(r.correct for r in rewards) / len(rewards),
        "reward/format": sum(r.formatted for r in rewards) / len(rewards),
        "reward/zero_std_groups": float((on.rewards_N.view(len(batch.examples), -1).std(-1) == 0).float().mean()),
        **learner_metrics, **perf,
        "perf/tokens_per_s": float(on.lengths_N.sum()) / max(perf.get("perf/rollout_s", 0.0), 1e-9),
    }
    return dp.mean_metrics(metrics, summed=COUNTS)


def sample_rows(batch: StepBatch, group_size: int) -> list[dict[str, Any]]:
    """samples.jsonl records: the first rollout of every on-policy group and every external row."""
    out = []
    for rows, every in ((batch.real("on_policy"), group_size), (batch.real("external"), 1)):
        if rows is None:
            continue
        out += [{"source": rows.source, "version": rows.version, "prompt": batch.prompt_texts[int(rows.prompt_N[n])],
                 "completion": rows.texts[n], "reward": rows.rewards[n].score, "reason": rows.rewards[n].reason,
                 "advantage": float(rows.adv_N[n])} for n in range(0, len(rows), every)]
    return out


@dataclass
class HeldOut:
    """Greedy pass@1 on held-out prompts; with `samples` = k, also k samples at the rollout temperature
    (sampled pass@1, best-of-k). Every rank evaluates the same prompts (identical results): ZeRO-3 needs all
    ranks in the parameter gather."""

    greedy: Any  # TextGenerator at temperature 0
    sampler: Any  # the rollout TextGenerator
    task: Task
    tokenizer: Any
    prompts: int
    samples: int
    seed: int
    inference: Callable[[], ContextManager]

    def __call__(self) -> dict[str, float]:
        common = dict(num_prompts=self.prompts, prompts_key="eval_prompts", batch_size=64, seed=self.seed, tokenizer=self.tokenizer,
                      print_fn=lambda *_: None)
        with self.inference():
            summary, _ = evaluate_task(self.greedy, self.task, **common)
            out = {"eval/pass@1": summary["pass@1"], "eval/reward": summary["reward_mean"],
                   "eval/format_rate": summary["format_rate"], "eval/len": summary["completion_tokens_mean"]}
            if self.samples > 0:
                sampled, _ = evaluate_task(self.sampler, self.task, num_samples=self.samples, **common)
                out.update({"eval/sampled_pass@1": sampled["pass@1"],
                            f"eval/best_of_{self.samples}": sampled[f"best_of_{self.samples}"]})
        return out
