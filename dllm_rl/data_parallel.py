"""Data parallelism of the RL step, in one place: N ranks reproduce one process.

Every rank draws the same prompts, and every random draw keeps its single-process seed because it is a
function of a row's global index, never of its index on a rank. What that takes is here, and the training
loop calls it without naming a rank:

- whole prompt groups per rank (`local_prompts`): group statistics (advantages) never cross ranks;
- a `Shard` per source (`shard_sources`): where this rank's rows sit among all ranks' rows of the source, from
  one gather of the counts; estimator mask seeds and minibatch membership are functions of the global index;
- stand-in rows (`stand_in`): under ZeRO-3 every forward gathers parameters collectively, so a rank with no
  rows of a source that other ranks have scores one row that counts for nothing, and all ranks make the same
  calls; `pads` tells `buffer.loss_inputs` to do the same for a source missing from one rank's minibatch; and
  `lockstep` (dllm_rl/lockstep.py) makes every such call the same number of forwards on every rank;
- the minibatch plan (`minibatch_plan`): the single-process plan over all ranks' rows, cut to this rank's;
- the loss normaliser (`total`): `algo.losses.aggregate` divides a rank's loss by the units of every rank, so
  DeepSpeed's gradient average is the gradient of the loss over all rows;
- decisions every rank takes alike (`any`, `widest`) and metrics over ranks (`mean_metrics`).

With one process every call returns its input or a local count, and no collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dllm_rl.buffer import Rows, minibatch_plan, num_minibatches
from dllm_rl.engine import World, all_gather_objects, all_sum, any_rank, gather_tensor, mean_metrics
from dllm_rl.errors import require
from dllm_rl.likelihood.estimators import Estimator
from dllm_rl.lockstep import Lockstep


@dataclass(frozen=True)
class Shard:
    """Where one source's rows on this rank sit among all ranks' rows of that source."""

    start: int  # global index of this rank's first row
    count: int  # this rank's real rows (0 where it holds a stand-in)
    total: int  # the source's rows over all ranks


def stand_in(like: Rows, source: str, estimator: Estimator) -> Rows:
    """One row of `source` that goes through every forward and backward but counts for nothing (mask 0,
    weight 0, advantage 0): what a rank scores for a source only other ranks have rows of."""
    return Rows(source, like.ids_NL[:1], like.attention_mask_NL[:1], like.prompt_length,
                torch.zeros_like(like.mask_NC[:1]), None, like.prompt_N[:1], like.rewards[:1], like.texts[:1],
                like.version, estimator, adv_N=like.mask_NC.new_zeros(1), weight_N=like.mask_NC.new_zeros(1), inert=True)


def rank_plan(global_sizes: Sequence[int], starts: Sequence[int], local_sizes: Sequence[int], num_minibatches: int,
              mix: str, generator: torch.Generator) -> list[list[torch.Tensor]]:
    """`buffer.minibatch_plan` over all ranks' rows, restricted to this rank's: part p's rows here are its global
    rows [starts[p], starts[p] + local_sizes[p]). Every rank draws the single-process plan, so each minibatch
    holds the rows a single process would put in it; a rank may hold none of a part's rows in a minibatch."""
    plan = minibatch_plan(list(global_sizes), num_minibatches, mix, generator)
    return [[idx[(idx >= s) & (idx < s + n)] - s for idx, s, n in zip(picks, starts, local_sizes)] for picks in plan]


class DataParallel:
    """This rank's part of each step, for a world of `world.size` ranks (1 without a launcher)."""

    def __init__(self, world: World, prompts_per_step: int, group_size: int, minibatch_size: int, zero_stage: int = 0):
        require(prompts_per_step % world.size == 0, f"prompts_per_step={prompts_per_step} must be divisible by the "
                f"number of ranks ({world.size}): each rank takes whole prompt groups")
        self.world, self.group_size = world, group_size
        self.lockstep = Lockstep(world, enabled=zero_stage == 3)  # equal forward counts (dllm_rl/lockstep.py)
        self.prompts = prompts_per_step // world.size  # B, this rank's prompts per step
        self.num_minibatches = num_minibatches(prompts_per_step * group_size, minibatch_size)
        rows = self.prompts * group_size
        require(self.num_minibatches <= rows, f"minibatch_size={minibatch_size} makes {self.num_minibatches} "
                f"minibatches per inner iteration, but a rank holds {rows} rollouts; use minibatch_size >= "
                f"{math.ceil(prompts_per_step * group_size / rows)}")

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def pads(self) -> bool:
        """Whether a source missing from this rank's share of a minibatch is scored as a stand-in row."""
        return self.world.size > 1

    # ------------------------------------------------------------------------------------ rows

    def local_prompts(self, examples: Sequence[Any]) -> tuple[list[Any], int]:
        """(this rank's whole prompt groups of the step's `examples`, the global index of the first)."""
        first = self.world.rank * self.prompts
        return list(examples[first:first + self.prompts]), first

    def shard_sources(self, rows: dict[str, Rows], estimators: dict[str, Estimator]) -> None:
        """Give every source's rows their `Shard`; a source that only other ranks have gets a stand-in row here.
        `estimators` names the sources this run can have (on_policy first) and scores them; every rank calls
        this with the same names (one gather of row counts per source other than on_policy)."""
        for source, estimator in estimators.items():
            mine = rows.get(source)
            if source == "on_policy":
                start, count = self.world.rank * len(mine), len(mine)
                mine.shard = Shard(start, count, count * self.world.size)  # equal shares of whole groups
                continue
            counts = all_gather_objects(0 if mine is None else len(mine), self.world)
            if mine is None and self.pads and any(counts):
                rows[source] = mine = stand_in(rows["on_policy"], source, estimator)
            if mine is not None:
                mine.shard = Shard(sum(counts[:self.world.rank]), counts[self.world.rank], sum(counts))

    def minibatch_plan(self, parts: Sequence[Rows], mix: str, generator: torch.Generator) -> list[list[torch.Tensor]]:
        """For each minibatch of an inner iteration, the rows of each part (by local index) this rank trains on."""
        return rank_plan([p.shard.total for p in parts], [p.shard.start for p in parts],
                         [p.shard.count for p in parts], self.num_minibatches, mix, generator)

    # ------------------------------------------------------------------------------------ collectives

    def total(self, value: float) -> float:
        """`value` summed over ranks (a loss normaliser, a count)."""
        return all_sum([value], self.world)[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any (e.g. whether a step has a learning signal)."""
        return any_rank(flag, self.world)

    def widest(self, width: int) -> int:
        """The largest `width` over ranks (external rows' window under length_rule=none)."""
        return max(all_gather_objects(width, self.world))

    def gather(self, t: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(every rank's `t` concatenated in rank order, where this rank's rows start in it)."""
        return gather_tensor(t, self.world)

    def mean_metrics(self, metrics: dict[str, float], summed: tuple[str, ...] = ()) -> dict[str, float]:
        """Each metric averaged over the ranks that report it; `summed` keys (counts) added up."""
        return mean_metrics(metrics, self.world, summed=summed)
