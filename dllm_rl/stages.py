"""The stages of one RL step, each testable alone, with a `StepBatch` of plain data flowing between them.

    choose prompts -> (allocate) -> generate -> verify -> external rollouts -> advantages -> (reweight)
    -> old/ref log-probs -> (sampler correction) -> update -> (after update) -> metrics (the checkpoint is the loop's)

The stages up to "verify" are in `dllm_rl/collect.py` (with the `StepBatch`), the rest here.

| stage              | here                        | reads                          | writes                              |
|--------------------|-----------------------------|--------------------------------|-------------------------------------|
| choose prompts     | `PromptSource`              | the train split, the step      | the step's prompts (`Drawn`, global)|
| allocate           | `Curation.allocate`, `PromptSource.batch` | curation state   | a new batch: this rank's prompts    |
| generate           | `InProcessRollouts`         | prompts, their group sizes     | rows["on_policy"]: tokens, texts    |
| select             | `Curation.select`           | fresh rows                     | rows kept, loss weights             |
| verify             | `verify`                    | every source's texts           | their rewards                       |
| external rollouts  | `ExternalRollouts` (ERILS)  | prompts, on-policy correctness | rows["external"], external/* metrics|
| advantages         | `assign_advantages`         | rewards                        | adv_N (and external weights)        |
| reweight           | `Curation.reweight`         | groups, the sampler's record   | adv_N, weights, auxiliary SFT rows  |
| old/ref log-probs  | `score_old_and_reference`   | rows, the sampler's record     | mask seeds, old_logp, ref_logp      |
| sampler correction | `SamplerCorrectionStage`    | on-policy rows, sampler logp   | their loss weights, correction/*    |
| update             | `Learner.update`            | every row, the auxiliary rows  | the weights; loss and policy metrics|
| after update       | `Curation.after_update`     | the step's rows, a probe       | the bandit's scorer, replay buffer  |
| metrics            | `step_metrics`              | the batch                      | the step's metrics (over ranks)     |

`CollectRollouts` runs choose prompts through verify, in rounds where dynamic sampling asks for more, and
`observe_curation` gives the strategies every rank's groups after the external rows (dllm_rl/curation/). Rows are
keyed by (the global id of their prompt, their index among its rollouts), never by position: a prompt may get any
number of rollouts (0 leaves it out of the step), a filter may drop any rows (`Rows.select`), and every later
stage works on the groups as they are. Where later capabilities go, without editing the other stages: a prompt
filter or a rollout allocator decides the rollouts per prompt between "choose prompts" and "generate" (the same
decision on every rank), a row filter runs after "verify"; rollouts from workers replace `InProcessRollouts` with
any callable that returns on-policy `Rows` whose `version` is the policy that made them; a cached or parallel
sampler is another `TextGenerator`-like object inside `InProcessRollouts` (anything with `sample(prompts, seeds)
-> Samples`).

Which rows are this rank's and where they sit among all ranks' rows is `dllm_rl.data_parallel`'s business;
a stage that needs a global index reads it from `Rows.shard` or asks the `DataParallel` object it is given.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from dllm_rl.algo import auxiliary
from dllm_rl.algo.advantages import group_advantages
from dllm_rl.algo.auxiliary import AuxRows
from dllm_rl.algo.correction import SamplerCorrection, correction_weights, rollout_log_ratio
from dllm_rl.algo.losses import aggregation_units, grpo_loss
from dllm_rl.buffer import Piece, Rows, loss_inputs
from dllm_rl.collect import StepBatch, eval_mode
from dllm_rl.data.task import Task, draw_examples, render_prompt
from dllm_rl.data_parallel import DataParallel
from dllm_rl.engine import Engine
from dllm_rl.errors import RunStopped, require
from dllm_rl.evaluate import evaluate_task
from dllm_rl.external.mixer import local_only
from dllm_rl.external.provenance import split_pass1
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.lockstep import Lockstep
from dllm_rl.seeds import derive_seed

# Metrics that count rows or prompts: added up over data-parallel ranks (every other metric is averaged).
COUNTS = tuple(f"external/{k}" for k in ("candidates", "too_long", "truncated", "unrepresentable", "incorrect",
                                         "prompts", "rows")) + ("rollouts/on_policy", "curation/dropout_dropped",
                                                                "curation/dropout_positive") + tuple(
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
                                            max_length=self.max_length, prompt_ids=[batch.prompt_ids[b] for b in active],
                                            widest=self.dp.widest, device=self.device)
        if rows is not None:
            rows.prompt_N = torch.tensor(active, device=rows.prompt_N.device)[rows.prompt_N]
            batch.rows["external"] = rows
        batch.metrics.update(metrics)


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
            on.weight_N = weight_N if on.weight_N is None else on.weight_N * weight_N
            if source == "on_policy":
                batch.metrics.update(metrics)


ORDERED = build_estimator({"name": "ordered", "group": 1})
CLEAN_PROMPT = build_estimator({"name": "mean_field", "prompt_mask_prob": 0.0})  # deterministic: the whole window masked


@dataclass
class HeldOutProbe:
    """A cheap held-out metric (the contextual bandit's reward, dllm_rl/curation/bandit.py): the policy's mean
    per-token log-likelihood of verified-correct completions of held-out prompts, by the mean-field estimator (one
    forward over the rows, the whole window masked, the prompt clean), in the rollouts' inference context. The same rows and value on every rank."""

    policy: Any
    ids_NL: torch.Tensor
    attention_mask_NL: torch.Tensor
    prompt_length: int
    mask_NC: torch.Tensor
    inference: Callable[[], ContextManager]

    def __call__(self) -> float:
        with torch.no_grad(), self.inference():
            logp_NC = CLEAN_PROMPT.logp(self.policy, self.ids_NL, self.attention_mask_NL, self.prompt_length,
                                        seeds_N=[0] * len(self.ids_NL))
        return float((logp_NC.double() * self.mask_NC).sum() / self.mask_NC.sum())


def build_probe(task: Task, tokenizer, policy, window: int, count: int, seed: int,
                inference: Callable[[], ContextManager]) -> HeldOutProbe:
    """The probe over the first `count` held-out prompts with a worked solution (the task's solver, or a file
    task's reference) that fits the window with its EOS: with its steps, or else the answer alone."""
    from dllm_rl.data.task import render_completion
    from dllm_rl.sft import SFTExample, completion_tokens, diffusion_batch, worked_solution

    pairs = []
    for ex in draw_examples(task, "test", count, seed, "curation.bandit.probe_prompts"):
        solution = worked_solution(task, ex)
        for written in [] if solution is None else [solution, type(solution)(solution.answer)]:
            pair = SFTExample(render_prompt(task.prompt(ex), tokenizer), render_completion(written, task.prompt_style))
            if completion_tokens(tokenizer, pair) < window:
                pairs.append(pair)
                break
    require(pairs, f"curation=bandit: none of {count} held-out {task.name} prompts has a worked solution that fits "
            f"the window of {window} tokens (the probe, its reward, needs some)")
    ids_NL, attention_NL, P = diffusion_batch(tokenizer, pairs, window, device=policy.device)
    lengths_N1 = torch.tensor([[completion_tokens(tokenizer, p) + 1] for p in pairs], device=policy.device)
    mask_NC = (torch.arange(window, device=policy.device)[None] < lengths_N1).double()
    return HeldOutProbe(policy, ids_NL, attention_NL, P, mask_NC, inference)


# ------------------------------------------------------------------------------------------ update


@dataclass
class Learner:
    """mu inner iterations over minibatches of the step's rows (the single-process plan, cut to this rank's
    rows), the clipped surrogate (+ beta * KL) per minibatch, one engine update each, its gradient accumulated over
    the minibatch's backward passes (`DataParallel.pieces`: one, or passes of `micro_rows` rows and
    `micro_forwards` forwards); then the LR schedule and the reference sync. A step without a learning signal (no row on any rank with both a non-zero advantage
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
    micro_rows: int = 0  # rows per backward pass (0 = a rank's whole minibatch; see DataParallel.pieces)
    micro_forwards: int = 0  # forwards per backward pass of a spanned estimator (0 = all of a row's)

    def update(self, batch: StepBatch) -> dict[str, float]:
        parts = list(batch.rows.values())
        informative = self.dp.any(any(bool(has_signal(p).any()) for p in parts))
        aggregation = self.loss_options.get("aggregation", "token")
        losses: list[dict[str, float]] = []
        # the auxiliary SFT rows (echo clips) join the step's first update, or make one alone
        aux_parts = self.auxiliary_parts(batch)
        aux_measured = {f"loss/{name}": 0.0 for name, _, _ in aux_parts}
        aux = [functools.partial(self.aux_loss, rows, units, parts[0].ids_NL, aux_measured)
               for _, rows, units in aux_parts]
        for it in range(self.iterations) if informative else []:
            # cpu: the minibatch plan is the same on every device (see dllm_rl/device.py)
            shuffle = torch.Generator(device="cpu").manual_seed(derive_seed(self.seed, "minibatch", batch.step, it))
            for picks in self.dp.minibatch_plan(parts, self.minibatch_mix, shuffle):
                units = self.dp.total(sum(aggregation_units(*unit_inputs(part, rows, aggregation))
                                          for part, rows in zip(parts, picks)))
                pieces = self.dp.pieces(parts, picks, self.micro_rows, self.micro_forwards)
                measured: list[tuple[dict[str, float], float, float]] = []
                makers = [functools.partial(self.piece_loss, parts, piece, it, units, measured) for piece in pieces]
                grad_norm = self.apply(makers + aux, parts[0].ids_NL, batch.step)
                aux = []
                if grad_norm is not None:
                    losses.append({**merge_piece_metrics(measured), "policy/grad_norm": grad_norm})
        if aux:
            grad_norm = self.apply(aux, parts[0].ids_NL, batch.step)
            if grad_norm is not None:
                losses.append({"policy/grad_norm": grad_norm})
        with warnings.catch_warnings():  # a step without an update still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        if self.reference is not None and self.ref_sync_every > 0 and (batch.step + 1) % self.ref_sync_every == 0:
            self.engine.sync_reference(self.reference.model)
        out = {"policy/updates": float(len(losses)), "policy/lr": self.scheduler.get_last_lr()[0],
               "policy/no_signal": float(not informative and not aux_parts), **aux_measured}
        return {**out, **{k: sum(m[k] for m in losses) / len(losses) for k in (losses[0] if losses else {})}}

    def apply(self, makers: list, template_NL: torch.Tensor, step: int) -> float | None:
        """One engine update from the makers of its backward passes: its gradient norm, or None if it was skipped."""
        update = self.engine.update(makers, poison=lambda: Lockstep.stand_in_forwards(
            self.policy, template_NL, 1, scale=float("nan")))
        if not update.applied:
            self.bad_update(step, update.skipped)
            return None
        self.bad_steps = 0
        return update.grad_norm

    def auxiliary_parts(self, batch: StepBatch) -> list[tuple[str, AuxRows | None, float]]:
        """Each kind of auxiliary rows that some rank has, with its normaliser over ranks (the same kinds, in the
        same order, on every rank: every rank makes their backward passes)."""
        out = []
        for name in sorted(batch.auxiliary):
            rows = batch.auxiliary[name]
            local = 0.0 if rows is None else auxiliary.units(rows, auxiliary.noised(rows, self.policy.mask_id)[1])
            total = self.dp.total(local)
            if total > 0:
                out.append((name, rows, total))
        return out

    def aux_loss(self, rows: AuxRows | None, units: float, template_NL: torch.Tensor,
                 measured: dict[str, float]) -> torch.Tensor:
        """One kind of auxiliary rows' backward pass: its weighted SFT loss, this rank's share (`units` over every
        rank's rows); a rank without rows of the kind makes a stand-in forward (ZeRO-3's forwards are collective).
        Its unweighted loss is logged as loss/<name> (ranks without rows report 0: the mean over ranks is the loss)."""
        if rows is None:
            return Lockstep.stand_in_forwards(self.policy, template_NL, 1, scale=0.0)
        with self.autocast:
            loss = auxiliary.auxiliary_loss(self.policy, rows, units, self.dp.size)
        measured[f"loss/{rows.name}"] = float(loss.detach())
        return loss * rows.weight

    def bad_update(self, step: int, why: str) -> None:
        self.bad_steps += 1
        warnings.warn(f"step {step}: non-finite loss or gradient; update skipped ({self.bad_steps} in a row: {why})")
        if self.bad_steps >= self.max_bad_steps:
            raise RunStopped(f"stopping: {self.bad_steps} non-finite updates in a row (max_bad_steps="
                             f"{self.max_bad_steps}); lower lr, or resume from the last checkpoint")


    def piece_loss(self, parts: list[Rows], piece: Piece, iteration: int, units: float,
                   measured: list[tuple[dict[str, float], float, float]]) -> torch.Tensor:
        """The loss of one backward pass of a minibatch, its share of the minibatch's (`units` is the whole
        minibatch's normaliser, over ranks, so the pieces' losses add up to the minibatch's); its metrics, with
        their weights (counted tokens, rows), go to `measured`."""
        with self.autocast:
            inputs = loss_inputs([parts[p] for p in piece.parts], list(piece.rows), self.policy, iteration,
                                 self.reuse_current, pad_empty=self.dp.pads, lockstep=self.dp.lockstep,
                                 spans=list(piece.spans))
        if self.loss_options.get("aggregation", "token") == "sequence" and piece.spans != (None,) * len(piece.spans):
            # a row's mean over its tokens, of which this span holds some: its terms here over all its tokens
            (part,), (rows,) = [parts[p] for p in piece.parts], piece.rows
            whole_N = level_mask_and_weights(part, rows)[0].sum(-1) if len(rows) else inputs["mask_NC"].sum(-1)
            inputs["weights_N"] = inputs["weights_N"] * inputs["mask_NC"].sum(-1) / whole_N.clamp(min=1)
        per_row: dict[str, torch.Tensor] = {}
        loss, metrics = grpo_loss(**inputs, **self.loss_options, global_units=units, ranks=self.dp.size,
                                  per_row=per_row)
        measured.append((metrics, float((inputs["mask_NC"] != 0).sum()), len(inputs["adv_N"]) * piece.share))
        add_clip_counts([parts[p] for p in piece.parts], list(piece.rows), per_row["clip_counts_N2"], self.dp.pads)
        return loss

def add_clip_counts(parts: list[Rows], picks: list[torch.Tensor], counts_N2: torch.Tensor, pads: bool) -> None:
    """Each row's clipped and counted tokens of one backward pass into its part's `clip_counts_N2` (the rows of
    `buffer.loss_inputs`, in its order: a part without rows there counts one stand-in row where the run pads)."""
    start = 0
    for part, rows in zip(parts, picks):
        taken = len(rows) or (1 if pads else 0)
        if len(rows):
            if part.clip_counts_N2 is None:
                part.clip_counts_N2 = torch.zeros(len(part), 2, device=counts_N2.device)
            part.clip_counts_N2[rows.to(counts_N2.device)] += counts_N2[start:start + taken].float()
        start += taken


def level_mask_and_weights(part: Rows, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(level_mask, weights_N) of `rows` of `part` as the loss will see them, before any forward: the tokens it
    counts (one unit per row for a sequence-level estimator) and the rows' loss weights."""
    rows = rows.to(part.mask_NC.device)
    mask = part.mask_NC[rows] if part.estimator.level == "token" else torch.ones_like(part.mask_NC[rows, :1])
    weights = part.weight_N[rows] if part.weight_N is not None else torch.ones(len(rows), device=mask.device)
    return mask, weights


def unit_inputs(part: Rows, rows: torch.Tensor, aggregation: str) -> tuple[torch.Tensor, str, torch.Tensor]:
    """`aggregation_units`'s arguments for `rows` of `part`."""
    mask, weights = level_mask_and_weights(part, rows)
    return mask, aggregation, weights


def merge_piece_metrics(measured: list[tuple[dict[str, float], float, float]]) -> dict[str, float]:
    """One minibatch's loss metrics from its backward passes' (`Learner.piece_loss`): the losses added up (each is
    its share of the minibatch's), per-token means weighted by the tokens counted, the largest ratio, the mean
    advantage weighted by rows."""
    def mean(key: str, weight_of) -> float:
        weights = [weight_of(m) for m in measured]
        total = sum(weights)
        return sum(w * m[0][key] for w, m in zip(weights, measured)) / total if total else \
            sum(m[0][key] for m in measured) / len(measured)

    out = {k: sum(m[0][k] for m in measured) for k in ("loss/policy", "loss/kl")}
    out.update({k: mean(k, lambda m: m[1]) for k in ("policy/clip_frac", "policy/ratio_mean")})
    out["policy/ratio_max"] = max(m[0]["policy/ratio_max"] for m in measured)
    out["policy/adv_mean"] = mean("policy/adv_mean", lambda m: m[2])
    return out


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


@dataclass
class HeldOut:
    """Greedy pass@1 on held-out prompts; with `samples` = k, also k samples at the rollout temperature
    (sampled pass@1, best-of-k); with `external_solved` (uid -> whether the external policy solves it,
    dllm_rl/external/provenance.py), greedy pass@1 on each side too. Every rank evaluates the same prompts
    (identical results): ZeRO-3 needs all ranks in the parameter gather."""

    greedy: Any  # TextGenerator at temperature 0
    sampler: Any  # the rollout TextGenerator
    task: Task
    tokenizer: Any
    prompts: int
    samples: int
    seed: int
    inference: Callable[[], ContextManager]
    external_solved: dict[str, bool] | None = None

    def examples(self) -> list:
        """The held-out prompts, as `evaluate_task` draws them."""
        return draw_examples(self.task, "test", self.prompts, self.seed, "eval_prompts")

    def __call__(self) -> dict[str, float]:
        common = dict(num_prompts=self.prompts, prompts_key="eval_prompts", batch_size=64, seed=self.seed, tokenizer=self.tokenizer,
                      print_fn=lambda *_: None)
        with self.inference():
            summary, records = evaluate_task(self.greedy, self.task, **common)
            out = {"eval/pass@1": summary["pass@1"], "eval/reward": summary["reward_mean"],
                   "eval/format_rate": summary["format_rate"], "eval/len": summary["completion_tokens_mean"]}
            if self.external_solved is not None:
                out.update(split_pass1(records, self.external_solved))
            if self.samples > 0:
                sampled, _ = evaluate_task(self.sampler, self.task, num_samples=self.samples, **common)
                out.update({"eval/sampled_pass@1": sampled["pass@1"],
                            f"eval/best_of_{self.samples}": sampled[f"best_of_{self.samples}"]})
        return out
