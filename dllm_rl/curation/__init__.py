"""Rollout curation: which prompts get rollouts, how many, and which rollouts stay (`curation=<strategy>`).

Strategies, each a small module of pure decision functions plus its state here (`strategies.py`):

| strategy           | paper                      | decides                                     | when                 |
|--------------------|----------------------------|---------------------------------------------|----------------------|
| `greso`            | GRESO, arXiv 2506.02177    | skip prompts whose recent groups were flat  | before generating    |
| `sera`             | SERA, arXiv 2609.36552     | each prompt's group size, its loss weight   | before generating    |
| `darts`            | DARTS, arXiv 2605.30859    | G + delta rollouts, keep the best G         | before / after       |
|                    |                            |                                             | generating           |
| `dynamic_sampling` | DAPO, arXiv 2503.14476     | drop flat groups, draw more prompts         | after verifying      |
| `grpo_dropout`     | GRPODropout, arXiv 2610.11854 | drop entropy-lowering positive rollouts  | after advantages     |
| `echo`             | EchoRL                     | all-correct groups -> auxiliary SFT clips   | after advantages     |
| `hindsight`        | hindsight relabelling      | failed rollouts -> SFT rows of the problem  | after advantages     |
|                    |                            | they solve                                  |                      |
| `bandit`           | CBS (contextual bandit)    | which rows (this step's, replayed) reach    | after advantages,    |
|                    |                            | the loss                                    | after the update     |

They compose where their decisions do: `greso` with any other (it only removes prompts), `darts` with
`dynamic_sampling`, `grpo_dropout` with any (it acts on the advantages, after the others have chosen the rows), `echo`
with any but `dynamic_sampling` (which drops the all-correct groups echo learns from, refused by name), `hindsight` with
any. `sera` decides the group sizes itself, so `sera` with `darts` (which sets them too) or with `dynamic_sampling`
(which refills the step with groups of G) is refused by name. Choose one with `curation=greso`, several with
`curation=[greso,dynamic_sampling]`; options as `curation.greso.p_start=0.3`. Chosen strategies act in the order of
`STRATEGIES` (greso, dynamic_sampling, sera, darts, grpo_dropout, echo, hindsight, bandit) whatever order they are
listed in: GRESO's skips before SERA's sizes, GRPODropout's drops before the bandit's picks.

Every decision is the same on every rank: allocations are functions of the drawn prompts, the strategy's state
and seeds; the state moves only by `observe`, from the groups of all ranks (gathered). The state goes into every
checkpoint (`state_dict`), so a resumed run takes the decisions the uninterrupted one takes.
"""

from __future__ import annotations

from typing import Any

from dllm_rl.curation.base import GroupRecord
from dllm_rl.curation.strategies import (Bandit, Curation, Darts, DynamicSampling, Echo, Greso, GrpoDropout,
                                         Hindsight, Sera, STRATEGIES)
from dllm_rl.errors import ConfigError, require

# pairs that decide the same thing
EXCLUSIVE = {frozenset(("sera", "darts")): "both set each prompt's group size",
             frozenset(("sera", "dynamic_sampling")): "dynamic sampling refills the step with groups of group_size, "
                                                      "which undoes SERA's allocation",
             frozenset(("echo", "dynamic_sampling")): "dynamic sampling drops the all-correct groups echo learns from"}


def check_curation(options: dict[str, Any] | None) -> list[str]:
    """The strategy names `options` (the `curation` config group) chooses, checked: known names, options of the
    right names and ranges, and a combination that composes."""
    options = dict(options or {})
    names = list(options)
    for name in names:
        require(name in STRATEGIES, f"curation={name!r}: expected none or any of {', '.join(STRATEGIES)}")
        STRATEGIES[name].check(options[name] or {})
    for pair, why in EXCLUSIVE.items():
        if pair <= set(names):
            a, b = sorted(pair)
            raise ConfigError(f"curation=[{a},{b}] do not compose: {why}; choose one")
    return names


def build_curation(options: dict[str, Any] | None, *, group_size: int, prompts_per_step: int, seed: int,
                   pool_size: int, external: bool = False, **context) -> Curation:
    """The run's `Curation` (no strategy: every prompt gets group_size rollouts, as without curation). `context`
    holds what some strategies need and take by name: `task` and `tokenizer` (hindsight), `dp`, `probe`,
    `estimator` and `pad_id` (bandit)."""
    names = sorted(check_curation(options), key=list(STRATEGIES).index)  # one order, however they are listed
    strategies = [STRATEGIES[n].build(dict((options or {})[n] or {}), group_size=group_size, seed=seed,
                                      pool_size=pool_size, external=external, **context) for n in names]
    return Curation(strategies, group_size=group_size, prompts_per_step=prompts_per_step)


__all__ = ["Bandit", "Curation", "Darts", "DynamicSampling", "Echo", "Greso", "GroupRecord", "GrpoDropout", "Hindsight",
           "Sera", "STRATEGIES", "build_curation", "check_curation"]
