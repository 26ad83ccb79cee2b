"""The update stage of one RL step: `Learner.update` turns the step's scored rows (and any auxiliary SFT rows)
into engine updates, and the small pure functions that count what each backward pass covers.

How the rows are cut into minibatches and backward passes over data-parallel ranks is `DataParallel`'s business
(`minibatch_plan`, `pieces`); the loss is `dllm_rl.algo.losses.grpo_loss`; the row tensors a pass needs come from
`dllm_rl.buffer.loss_inputs`. See `dllm_rl/stages.py` for where this stage sits in the step.
"""

from __future__ import annotations

import functools
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable

import torch

from dllm_rl.algo import auxiliary
from dllm_rl.algo.auxiliary import AuxRows
from dllm_rl.algo.losses import aggregation_units, grpo_loss
from dllm_rl.buffer import Piece, Rows, loss_inputs
from dllm_rl.collect import StepBatch
from dllm_rl.data_parallel import DataParallel
from dllm_rl.engine import Engine
from dllm_rl.errors import RunStopped
from dllm_rl.lockstep import Lockstep
from dllm_rl.seeds import derive_seed


@dataclass
class Learner:
    """mu inner iterations over minibatches of the step's rows (the single-process plan, cut to this rank's
    rows), the clipped surrogate (+ beta * KL) per minibatch, one engine update each, its gradient accumulated over
    the minibatch's backward passes (`DataParallel.pieces`: one, or passes of `micro_rows` rows and
    `micro_forwards` forwards); then the LR schedule and the reference sync. A step without a learning signal
    (no row on any rank with both a non-zero advantage and a non-zero loss weight) makes no update, so AdamW's
    moments cannot move the weights on zero gradients; it is logged as `policy/no_signal` = 1.
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
                units = self.dp.total(minibatch_units(parts, picks, aggregation))
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
        return self.end_step(batch.step, losses, informative or bool(aux_parts), aux_measured)

    def update_stream(self, groups: Iterable[StepBatch], prepare: Callable[[StepBatch], None]
                      ) -> tuple[dict[str, float], list[StepBatch]]:
        """Complete-group pipelining (RolloutPipe; ZeRO stage 0 or 3, one inner iteration, one minibatch):
        each group, as it arrives from `groups`, goes through `prepare` (external rows, advantages, scoring) and
        straight into its forward and backward passes while the next is still generating; one optimizer step
        when the last is in. The loss is the synchronous update's: each pass's sum over its units, the
        accumulated gradient divided by the step's units over all ranks once they are known
        (`Engine.stream_update`), so the update equals `update`'s up to float rounding (tested). Every row counts
        towards the units, as in `update` (`minibatch_units`). A group without signal (on every rank: with
        several ranks each takes one group a round, a stand-in where it has none, and the decision is the
        round's) makes no pass when beta = 0 (its gradient is zero); with beta > 0 its passes carry the KL term,
        and they are made once a group with signal has arrived (a step without signal makes no update, as in
        `update`). Returns the update's metrics and the groups, prepared and trained on."""
        aggregation = self.loss_options.get("aggregation", "token")
        with_kl = self.loss_options.get("beta", 0.0) > 0
        seen: list[StepBatch] = []
        measured: list[tuple[dict[str, float], float, float]] = []
        units = [0.0]

        def makers():
            held: list[Callable[[], torch.Tensor]] = []  # flat groups' KL passes, until a group with signal
            signal = False
            for group in groups:
                prepare(group)
                seen.append(group)
                parts = list(group.rows.values())
                picks = [torch.arange(len(p)) for p in parts]  # cpu: row indices, as the minibatch plan's
                units[0] += minibatch_units(parts, picks, aggregation)
                flat = not self.dp.any(any(bool(has_signal(p).any()) for p in parts))
                if flat and not with_kl:
                    continue
                passes = [functools.partial(self.piece_loss, parts, piece, 0, 1.0, measured)
                          for piece in self.dp.pieces(parts, picks, self.micro_rows, self.micro_forwards)]
                held.extend(passes)
                signal = signal or not flat
                if signal:
                    yield from held
                    held.clear()

        def scale() -> float:  # once every group is in: the step's units over all ranks
            units[0] = self.dp.total(units[0])
            return 1.0 / max(units[0], 1.0)

        update = self.engine.stream_update(makers(), scale=scale)
        losses = []
        if update is not None and not update.applied:
            self.bad_update(seen[0].step if seen else -1, update.skipped)
        elif update is not None:
            self.bad_steps = 0
            merged = merge_piece_metrics(measured)
            for key in ("loss/policy", "loss/kl"):  # each pass's sum over its units: the step's mean
                merged[key] /= max(units[0], 1.0)
            losses.append({**merged, "policy/grad_norm": update.grad_norm})
        return self.end_step(seen[0].step, losses, update is not None, {}), seen

    def end_step(self, step: int, losses: list[dict[str, float]], informative: bool,
                 aux_measured: dict[str, float]) -> dict[str, float]:
        """After the step's updates: the LR schedule, the reference sync, and the update metrics."""
        with warnings.catch_warnings():  # a step without an update still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()
        if self.reference is not None and self.ref_sync_every > 0 and (step + 1) % self.ref_sync_every == 0:
            self.engine.sync_reference(self.reference.model)
        out = {"policy/updates": float(len(losses)), "policy/lr": self.scheduler.get_last_lr()[0],
               "policy/no_signal": float(not informative), **aux_measured}
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


def minibatch_units(parts: list[Rows], picks: list[torch.Tensor], aggregation: str) -> float:
    """The loss normaliser of `picks` rows of `parts` on this rank (sum it over ranks): every row counts, with
    or without signal, so the synchronous and the streamed update divide by the same number."""
    return sum(aggregation_units(*unit_inputs(part, rows, aggregation)) for part, rows in zip(parts, picks))


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
