"""The step's rollout buffer: rows from each source, scored and cut into minibatches.

A step holds one `Rows` per source: the dLLM's own denoising rollouts ("on_policy") and, with ERILS, the external
policy's rollouts ("external"). Every row carries its source, the policy version that made it, its key (the global
id of its prompt, its index among that prompt's rollouts of the source: what its seeds and its place among all
ranks' rows are functions of, never its position), its prompt, reward and advantage, a loss weight, the mask seed
of each inner iteration, and its old and reference log-probs once scored. Rows of one source share a prompt length
P and a window C; sources may differ (external rows have their own prompt padding, and a longer window under
`length_rule=none`), so each source is scored by its own forward passes and the per-token log-probs are padded to
a common width before the loss. Where the rows sit among all data-parallel ranks' rows is
`dllm_rl.data_parallel`'s business.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dllm_rl.data.task import Reward
from dllm_rl.errors import pick, require
from dllm_rl.likelihood.estimators import Estimator
from dllm_rl.lockstep import Lockstep

if TYPE_CHECKING:
    from dllm_rl.data_parallel import Shard

MINIBATCH_MIXES = ("stratified", "mixed")


@dataclass
class Rows:
    """One step's rollouts from one source."""

    source: str  # "on_policy" or "external"
    ids_NL: torch.Tensor  # left-padded prompt (P) + completion window (C)
    attention_mask_NL: torch.Tensor
    prompt_length: int
    mask_NC: torch.Tensor  # 1 on the scored completion tokens (up to and including the first EOS)
    order_NC: torch.Tensor | None  # the step each token was unmasked at; None = no denoising trajectory
    prompt_N: torch.Tensor  # index of each row's prompt among this rank's prompts of the step (StepBatch.examples)
    rewards: list[Reward]  # one per row (empty until the verify stage scores the texts)
    texts: list[str]
    version: int  # policy version (step) that made the rows; -1 for an external policy
    estimator: Estimator  # what these rows are scored with
    behaviour_logp_N: torch.Tensor | None = None  # log mu(y|x) of the policy that wrote them, where known
    sampler_logp_NC: torch.Tensor | None = None  # the sampler's log-prob of each token as it committed it (dLLM)
    entropy_NC: torch.Tensor | None = None  # the entropy of the distribution it committed each token from (dLLM)
    clip_counts_N2: torch.Tensor | None = None  # per row: (clipped, counted) tokens over the step's updates
    adv_N: torch.Tensor | None = None
    weight_N: torch.Tensor | None = None  # loss weight per row (None = 1): the product of `factors` once one is set
    factors: dict[str, torch.Tensor] = field(default_factory=dict)  # the named loss-weight factors (`weigh`)
    shaped: bool = False  # LUFFY policy shaping instead of the clipped surrogate
    inert: bool = False  # a stand-in row that is scored but counts for nothing (data_parallel.stand_in)
    shard: Shard | None = None  # where the rows sit among all ranks' rows of the source (data_parallel)
    mask_seeds: list[list[int]] = field(default_factory=list)  # [inner iteration][row]
    old_logp: list[torch.Tensor | None] = field(default_factory=list)  # [inner iteration] -> (N, C) or (N, 1)
    ref_logp: list[torch.Tensor | None] = field(default_factory=list)
    # the rows' keys: the global id of each row's prompt (StepBatch.prompt_ids) and its index among that
    # prompt's rollouts of this source. Hand-made rows without them are keyed by prompt_N and their order.
    prompt_id_N: torch.Tensor | None = None
    rollout_N: torch.Tensor | None = None
    version_N: torch.Tensor | None = None  # each row's policy version where rows differ (replayed rows); else `version`

    def __post_init__(self) -> None:
        if self.prompt_id_N is None:
            self.prompt_id_N = self.prompt_N.clone()
        if self.rollout_N is None:
            self.rollout_N = order_within_groups(self.prompt_id_N)

    def __len__(self) -> int:
        return self.ids_NL.shape[0]

    def weigh(self, name: str, factor_N: torch.Tensor) -> None:
        """Multiply the loss-weight factor `name` (SERA's multiplicity, GRPODropout's keep, the bandit's pick, the
        sampler correction, ERILS's mixing weight and importance weight, ...) by `factor_N`. `weight_N`, what the
        loss reads, is the product of the factors taken in name order, so the order in which the stages write
        them does not change a bit of it; a weight set directly before any factor (a stand-in row's 0) is the
        factor `base`."""
        if self.weight_N is not None and not self.factors:
            self.factors["base"] = self.weight_N
        factor_N = factor_N.to(self.ids_NL.device, torch.float32)
        self.factors[name] = factor_N if name not in self.factors else self.factors[name] * factor_N
        self.weight_N = weight_product(self.factors)

    @property
    def keys(self) -> list[tuple[int, int]]:
        """(prompt id, rollout index) of every row."""
        return list(zip(self.prompt_id_N.tolist(), self.rollout_N.tolist()))

    def select(self, keep_N: torch.Tensor) -> Rows:
        """The rows where the bool `keep_N` is true (in their order), with everything known about them; before
        sharding and scoring (a filter's job: a `Shard` and mask seeds belong to the rows as they were)."""
        require(self.shard is None and not self.mask_seeds, "rows are selected before they are sharded and scored")
        idx = keep_N.nonzero().squeeze(-1).to(self.ids_NL.device)
        picked = idx.tolist()
        take = lambda t: None if t is None else t[idx.to(t.device)]  # noqa: E731
        return dataclasses.replace(
            self, ids_NL=self.ids_NL[idx], attention_mask_NL=self.attention_mask_NL[idx], mask_NC=self.mask_NC[idx],
            order_NC=take(self.order_NC), prompt_N=take(self.prompt_N),
            rewards=[self.rewards[i] for i in picked] if self.rewards else [], texts=[self.texts[i] for i in picked],
            behaviour_logp_N=take(self.behaviour_logp_N), sampler_logp_NC=take(self.sampler_logp_NC),
            entropy_NC=take(self.entropy_NC),
            adv_N=take(self.adv_N), weight_N=take(self.weight_N), factors={k: take(v) for k, v in self.factors.items()},
            prompt_id_N=take(self.prompt_id_N), rollout_N=take(self.rollout_N), version_N=take(self.version_N))

    @property
    def rewards_N(self) -> torch.Tensor:
        return torch.tensor([r.score for r in self.rewards], dtype=torch.float32, device=self.ids_NL.device)

    @property
    def lengths_N(self) -> torch.Tensor:
        return self.mask_NC.sum(-1)

    def score(self, policy, rows: torch.Tensor, iteration: int, lockstep: Lockstep | None = None, span=None):
        """(logp, level_mask) of `rows` under `policy`, with the stored mask seeds of `iteration`; with a
        `lockstep` (ZeRO-3 on several ranks), in as many forwards as every other rank makes; with `span`, only
        those forwards of a spanned estimator (`Estimator.score`)."""
        seeds = [self.mask_seeds[iteration][r] for r in rows.tolist()]
        order = None if self.order_NC is None else self.order_NC[rows]
        args = (policy, self.ids_NL[rows], self.attention_mask_NL[rows], self.prompt_length, seeds, order,
                self.mask_NC[rows], None if self.adv_N is None else self.adv_N[rows.to(self.adv_N.device)], span)
        return self.estimator.score(*args) if lockstep is None else lockstep.score(self.estimator, *args)

    def score_all(self, policy, iteration: int, lockstep: Lockstep | None = None, calls: int = 1) -> torch.Tensor:
        """The log-probs of every row, scored in `calls` calls of about equal rows (a call with no row scores row
        0 and drops it: every rank of a ZeRO-3 run makes the agreed number of calls)."""
        every = torch.arange(len(self), device=self.ids_NL.device)
        parts = []
        for rows in torch.tensor_split(every, calls):
            logp = self.score(policy, rows if len(rows) else every[:1], iteration, lockstep)[0]
            parts.append(logp if len(rows) else logp[:0])
        return torch.cat(parts)


def concat_rows(parts: list[Rows], pad_id: int) -> Rows:
    """One source's rows of several generation rounds as one `Rows`, in order: prompts left-padded (with
    `pad_id`, attention 0) to the widest round's, windows equal. `prompt_N` is kept as given (the caller
    re-indexes it to the merged prompts); rows not sharded or scored yet."""
    first = parts[0]
    require(all(p.source == first.source and p.shard is None and not p.mask_seeds for p in parts),
            "rows are concatenated before they are sharded and scored, one source at a time")
    require(len({p.mask_NC.shape[1] for p in parts}) == 1, "rows of one source share a completion window")
    P = max(p.prompt_length for p in parts)

    def widen(t: torch.Tensor, rows: Rows, fill: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (P - rows.prompt_length, 0), value=fill)

    def cat(name: str) -> torch.Tensor | None:
        values = [getattr(p, name) for p in parts]
        if all(v is None for v in values):
            return None
        require(all(v is not None for v in values), f"rows of one source all have {name} or none do")
        return torch.cat(values)

    return dataclasses.replace(
        first, ids_NL=torch.cat([widen(p.ids_NL, p, pad_id) for p in parts]),
        attention_mask_NL=torch.cat([widen(p.attention_mask_NL, p, 0) for p in parts]), prompt_length=P,
        mask_NC=cat("mask_NC"), order_NC=cat("order_NC"), prompt_N=cat("prompt_N"),
        rewards=[r for p in parts for r in p.rewards], texts=[t for p in parts for t in p.texts],
        behaviour_logp_N=cat("behaviour_logp_N"), sampler_logp_NC=cat("sampler_logp_NC"), entropy_NC=cat("entropy_NC"),
        adv_N=cat("adv_N"), weight_N=cat("weight_N"), factors=concat_factors(parts),
        prompt_id_N=cat("prompt_id_N"), rollout_N=cat("rollout_N"), version_N=cat("version_N"))


def weight_product(factors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """weight_N: the product of the named factors in name order (None without any)."""
    out = None
    for name in sorted(factors):
        out = factors[name] if out is None else out * factors[name]
    return out


def concat_factors(parts: list[Rows]) -> dict[str, torch.Tensor]:
    """The parts' weight factors, row after row: a factor a part lacks is 1 on its rows (a part with a weight set
    directly and no factor has it as `base`). None at all where no part has a factor."""
    if not any(p.factors for p in parts):
        return {}
    own = [p.factors or ({"base": p.weight_N} if p.weight_N is not None else {}) for p in parts]
    names = sorted({name for factors in own for name in factors})
    return {name: torch.cat([f[name] if name in f else torch.ones(len(p), device=p.ids_NL.device)
                             for f, p in zip(own, parts)]) for name in names}


def order_within_groups(group_N: torch.Tensor) -> torch.Tensor:
    """rank_N: each row's index among the rows of its group that come before it (0, 1, ... per group)."""
    same_NN = group_N[:, None] == group_N[None, :]
    return torch.tril(same_NN, diagonal=-1).sum(-1)


def minibatch_plan(sizes: list[int], num_minibatches: int, mix: str,
                   generator: torch.Generator) -> list[list[torch.Tensor]]:
    """For each minibatch, the row indices it takes from each part (parts of `sizes` rows).

    "stratified": every part is shuffled and split evenly over the minibatches, so each minibatch holds the
    same share of every source. "mixed": all rows are shuffled together and split, so shares vary."""
    pick({m: m for m in MINIBATCH_MIXES}, mix, "mixing.minibatch_mix")
    if mix == "stratified":
        chunks = [torch.tensor_split(torch.randperm(n, generator=generator, device=generator.device), num_minibatches)
                  for n in sizes]
        return [[chunks[p][k] for p in range(len(sizes))] for k in range(num_minibatches)]
    offsets = torch.tensor([0] + sizes, device=generator.device).cumsum(0)
    plan = []
    for chunk in torch.tensor_split(torch.randperm(sum(sizes), generator=generator, device=generator.device),
                                    num_minibatches):
        plan.append([chunk[(chunk >= offsets[p]) & (chunk < offsets[p + 1])] - offsets[p] for p in range(len(sizes))])
    return plan


@dataclass(frozen=True)
class Piece:
    """One backward pass of a minibatch (`DataParallel.pieces`): rows of some of the step's parts (`parts` indexes
    them; rows by local index, none = a stand-in row where the run pads) and, for each, the span of its
    estimator's forwards it makes (None = all of them)."""

    parts: tuple[int, ...]
    rows: tuple[torch.Tensor, ...]
    spans: tuple[tuple[int, int] | None, ...]
    share: float = 1.0  # 1 / the number of spans its rows are cut into (so per-row metrics count a row once)


def piece_spans(calls: int, forwards: int) -> list[tuple[int, int]]:
    """The spans of at most `forwards` forwards that cover `calls` of them (at least one span)."""
    return [(a, a + forwards) for a in range(0, max(calls, 1), forwards)]


def num_minibatches(on_policy_rows: int, minibatch_size: int) -> int:
    """Minibatches per inner iteration: set by the on-policy rows; external rows are spread over them."""
    return math.ceil(on_policy_rows / minibatch_size)


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def loss_inputs(parts: list[Rows], picks: list[torch.Tensor], policy, iteration: int, reuse_current: bool,
                pad_empty: bool = False, lockstep: Lockstep | None = None,
                spans: list[tuple[int, int] | None] | None = None) -> dict[str, torch.Tensor | None]:
    """The arguments of `grpo_loss` for one minibatch (or one `Piece` of it): each part scored on its picked rows
    (with `spans`, only those forwards of each part's estimator, and the tokens they score), padded to one width.
    With `pad_empty` (several ranks) a part with no rows in this minibatch is scored on its row 0 with mask and
    weight 0, so every rank scores every part (ZeRO-3's forwards are collective; `lockstep` evens out how many
    each score makes) and a rank never has an empty minibatch; such a row adds nothing to the loss or to its
    normaliser (`aggregation_units`). A part whose span holds none of its forwards here makes one stand-in
    forward, so every rank's backward reaches every parameter."""
    pieces = []
    for part, rows, span in zip(parts, picks, spans or [None] * len(parts)):
        device = part.adv_N.device
        inert = len(rows) == 0
        if inert and not pad_empty:
            continue
        rows = torch.zeros(1, dtype=torch.long, device=device) if inert else rows.to(device)
        logp, level_mask = part.score(policy, rows, iteration, lockstep, span)
        if span is not None and torch.is_grad_enabled() and not logp.requires_grad:
            logp = logp + Lockstep.stand_in_forwards(policy, part.ids_NL, 1)
        if inert:
            level_mask = torch.zeros_like(level_mask)
        old = logp.detach() if reuse_current else part.old_logp[iteration][rows]
        ref = part.ref_logp[iteration][rows] if part.ref_logp and part.ref_logp[iteration] is not None else None
        weight = part.weight_N[rows] if part.weight_N is not None else torch.ones(len(rows), device=device)
        weight = weight * (0.0 if inert else 1.0)
        pieces.append((logp.float(), old.float(), None if ref is None else ref.float(), part.adv_N[rows],
                       level_mask, weight, torch.full((len(rows),), part.shaped, device=device)))
    width = max(p[0].shape[1] for p in pieces)
    logp, old, ref, adv, mask, weight, shaped = zip(*pieces)
    has_ref = all(r is not None for r in ref)
    return {
        "logp_NC": torch.cat([_pad_to(t, width) for t in logp]),
        "old_logp_NC": torch.cat([_pad_to(t, width) for t in old]),
        "ref_logp_NC": torch.cat([_pad_to(t, width) for t in ref]) if has_ref else None,
        "adv_N": torch.cat(adv),
        "mask_NC": torch.cat([_pad_to(t, width) for t in mask]),
        "weights_N": torch.cat(weight),
        "shaped_N": torch.cat(shaped),
    }
