"""Data parallelism of the RL step, in one place: N ranks reproduce one process.

Every rank draws the same prompts and takes the same curation decisions, and every random draw keeps its
single-process seed because it is a function of a row's key (its prompt's global id, its index among that
prompt's rollouts), never of its index on a rank. What that takes is here, and the training loop calls it
without naming a rank:

- whole prompt groups per rank (`assign`): a contiguous run of the step's prompts, balanced by how many
  rollouts each gets (groups may differ in size), so group statistics (advantages) never cross ranks;
- a `Shard` per source (`shard_sources`): where this rank's rows sit among all ranks' rows of the source in
  key order, from one gather of the keys; minibatch membership is a function of that global position, so
  ranks holding uneven numbers of rows (a filter dropped more of one's) still train on the single-process
  minibatches;
- stand-in rows (`stand_in`): under ZeRO-3 every forward gathers parameters collectively, so a rank with no
  rows of a source that other ranks have scores one row that counts for nothing, and all ranks make the same
  calls; `pads` tells `buffer.loss_inputs` to do the same for a source missing from one rank's minibatch; and
  `lockstep` (dllm_rl/lockstep.py) makes every such call the same number of forwards on every rank;
- the minibatch plan (`minibatch_plan`): the single-process plan over all ranks' rows, cut to this rank's;
- a minibatch's backward passes (`pieces`): as many on every rank, each a run of one part's rows and of its
  estimator's forwards, so the gradient accumulates over them and the optimizer steps once;
- the loss normaliser (`total`): `algo.losses.aggregate` divides a rank's loss by the units of every rank, so
  DeepSpeed's gradient average is the gradient of the loss over all rows;
- decisions every rank takes alike (`any`, `widest`, `gather_objects`) and metrics over ranks (`mean_metrics`,
  row means weighted by each rank's rows).

With one process every call returns its input or a local count, and no collective runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dllm_rl.buffer import Piece, Rows, minibatch_plan, num_minibatches, piece_spans
from dllm_rl.engine import (World, all_gather_objects, all_max, all_sum, any_rank, gather_tensor, mean_metrics,
                            scatter_objects)
from dllm_rl.errors import require
from dllm_rl.likelihood.estimators import Estimator
from dllm_rl.lockstep import Lockstep


@dataclass(frozen=True)
class Shard:
    """Where one source's rows on this rank sit among all ranks' rows of that source, in key order."""

    index_N: tuple[int, ...]  # the global position of each of this rank's real rows (none for a stand-in)
    total: int  # the source's rows over all ranks

    @property
    def count(self) -> int:
        return len(self.index_N)


def global_positions(keys_by_rank: Sequence[Sequence[tuple[int, int]]], rank: int, source: str) -> Shard:
    """This rank's `Shard` from every rank's row keys: a row's position is its key's rank among all keys."""
    every = sorted(k for keys in keys_by_rank for k in keys)
    require(len(set(every)) == len(every), f"the {source} rows of the step have duplicate keys (prompt id, rollout "
            f"index): {sorted({k for k in every if every.count(k) > 1})[:5]}")
    position = {k: i for i, k in enumerate(every)}
    return Shard(tuple(position[tuple(k)] for k in keys_by_rank[rank]), len(every))


def balanced_runs(counts: Sequence[int], ranks: int) -> list[range]:
    """Each rank's contiguous run of prompts (indices into `counts`, rollouts per prompt): a prompt goes to the
    rank whose equal share of all rollouts holds the middle of its group, so equal groups split evenly and
    uneven ones by rollouts, not by prompts. Prompts with no rollouts go with their neighbours."""
    total = sum(counts)
    if total == 0:
        return [range(0) for _ in range(ranks)]
    owner, before = [], 0
    for n in counts:
        owner.append(min(ranks - 1, (2 * before + n) * ranks // (2 * total)))
        before += n
    return [range(owner.index(r), len(owner) - owner[::-1].index(r)) if r in owner else range(0)
            for r in range(ranks)]


def stand_in(like: Rows, source: str, estimator: Estimator) -> Rows:
    """One row of `source` that goes through every forward and backward but counts for nothing (mask 0,
    weight 0, advantage 0): what a rank scores for a source only other ranks have rows of. Made from the first
    row of `like` (any rows of the step: the on-policy ones, themselves a stand-in where this rank has none)."""
    order = torch.zeros_like(like.mask_NC[:1], dtype=torch.long) if estimator.needs_trajectory else None
    return Rows(source, like.ids_NL[:1], like.attention_mask_NL[:1], like.prompt_length,
                torch.zeros_like(like.mask_NC[:1]), order, like.prompt_N[:1], like.rewards[:1], like.texts[:1],
                like.version, estimator, adv_N=like.mask_NC.new_zeros(1), weight_N=like.mask_NC.new_zeros(1),
                inert=True, prompt_id_N=like.prompt_id_N[:1], rollout_N=like.rollout_N[:1])


def rank_plan(global_sizes: Sequence[int], positions: Sequence[Sequence[int]], num_minibatches: int, mix: str,
              generator: torch.Generator) -> list[list[torch.Tensor]]:
    """`buffer.minibatch_plan` over all ranks' rows, restricted to this rank's: part p's row i here is its
    global row positions[p][i]. Every rank draws the single-process plan, so each minibatch holds the rows a
    single process would put in it, in its order; a rank may hold none of a part's rows in a minibatch."""
    plan = minibatch_plan(list(global_sizes), num_minibatches, mix, generator)
    local_of = []
    for total, index in zip(global_sizes, positions):
        # cpu: with the plan's indices, which are drawn on the CPU (every device draws the same plan)
        local = torch.full((total,), -1, dtype=torch.long)
        local[list(index)] = torch.arange(len(index))  # cpu: beside the plan above
        local_of.append(local)
    out = []
    for picks in plan:
        mine = [local[idx.cpu()] for idx, local in zip(picks, local_of)]
        out.append([m[m >= 0].to(idx.device) for m, idx in zip(mine, picks)])
    return out


class DataParallel:
    """This rank's part of each step, for a world of `world.size` ranks (1 without a launcher)."""

    def __init__(self, world: World, prompts_per_step: int, group_size: int, minibatch_size: int, zero_stage: int = 0):
        self.world, self.group_size, self.minibatch_size = world, group_size, minibatch_size
        self.lockstep = Lockstep(world, enabled=zero_stage == 3)  # equal forward counts (dllm_rl/lockstep.py)
        # the most minibatches of a step: no strategy gives a step more on-policy rows than B * G
        self.num_minibatches = num_minibatches(prompts_per_step * group_size, minibatch_size)

    @property
    def size(self) -> int:
        return self.world.size

    @property
    def pads(self) -> bool:
        """Whether a source missing from this rank's share of a minibatch is scored as a stand-in row."""
        return self.world.size > 1

    # ------------------------------------------------------------------------------------ rows

    def assign(self, counts: Sequence[int]) -> range:
        """This rank's prompts among the step's (each with `counts` rollouts): see `balanced_runs`."""
        return balanced_runs(counts, self.world.size)[self.world.rank]

    def shard_sources(self, rows: dict[str, Rows], estimators: dict[str, Estimator]) -> None:
        """Give every source's rows their `Shard` (one gather of row keys per source); a source that only other
        ranks have gets a stand-in row here. `estimators` names the sources this run can have (on_policy first:
        every rank has its rows, a stand-in where it has none) and scores them; every rank calls this with the
        same names."""
        for source, estimator in estimators.items():
            mine = rows.get(source)
            keys = [] if mine is None or mine.inert else mine.keys
            every = all_gather_objects(keys, self.world)
            if mine is None and self.pads and any(every):
                rows[source] = mine = stand_in(rows["on_policy"], source, estimator)
            if mine is not None:
                mine.shard = global_positions(every, self.world.rank, source)
        ordered = {source: rows[source] for source in estimators if source in rows}  # one part order on every rank
        rows.clear()
        rows.update(ordered)

    def minibatch_plan(self, parts: Sequence[Rows], mix: str, generator: torch.Generator) -> list[list[torch.Tensor]]:
        """For each minibatch of an inner iteration, the rows of each part (by local index) this rank trains on.
        The step's on-policy rows (all ranks') set how many minibatches there are."""
        count = num_minibatches(parts[0].shard.total, self.minibatch_size)
        require(count <= self.num_minibatches, f"the step holds {parts[0].shard.total} on-policy rows, more than "
                f"prompts_per_step * group_size: a rollout allocator must stay within the step's budget")
        return rank_plan([p.shard.total for p in parts], [p.shard.index_N for p in parts], count, mix, generator)

    def pieces(self, parts: Sequence[Rows], picks: Sequence[torch.Tensor], rows: int = 0,
               forwards: int = 0) -> list[Piece]:
        """The backward passes of one minibatch (`picks`: this rank's rows of each part), whose gradients the
        engine accumulates before its one optimizer step. With `rows` = `forwards` = 0, one pass over every part
        (the whole minibatch at once). Else each pass holds one part's rows, at most `rows` of them (0 = all this
        rank has), and with `forwards` > 0 and a spanned estimator (`Estimator.spanned`: `ordered`,
        `left_to_right`) at most `forwards` of its forwards, a span, so a pass holds the activations of that
        many forwards, not of all of them. Every rank makes the same passes: the counts are the largest over
        ranks (a rank short of rows scores a stand-in row, one short of forwards makes stand-in forwards), since
        at ZeRO-2 and 3 each backward reduces gradients collectively."""
        if rows == 0 and forwards == 0:
            return [Piece(tuple(range(len(parts))), tuple(picks), (None,) * len(parts))]
        cuts = self.agreed([math.ceil(len(r) / (rows or len(r))) if len(r) else 0 for r in picks])
        chunks = [(p, chunk) for p, r in enumerate(picks) if cuts[p] for chunk in torch.tensor_split(r, cuts[p])]
        calls = self.agreed([parts[p].estimator.logits_calls(
            None if parts[p].order_NC is None else parts[p].order_NC[chunk.to(parts[p].order_NC.device)],
            parts[p].mask_NC.shape[1]) if len(chunk) and forwards and parts[p].estimator.spanned else 0
            for p, chunk in chunks])
        out = []
        for (p, chunk), n in zip(chunks, calls):
            spans = piece_spans(n, forwards) if forwards and parts[p].estimator.spanned else [None]
            out += [Piece((p,), (chunk,), (span,), 1.0 / len(spans)) for span in spans]
        return out

    # ------------------------------------------------------------------------------------ collectives

    def agreed(self, counts: list[int]) -> list[int]:
        """Each count's largest value over ranks (every rank passes as many)."""
        return [int(c) for c in all_max([float(c) for c in counts], self.world)] if counts else []

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

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (what a decision every rank takes alike is made from)."""
        return all_gather_objects(obj, self.world)

    def scatter_objects(self, objs: list[Any] | None) -> Any:
        """Rank 0's `objs[r]` on each rank r (the other ranks pass None): what rank 0 made for every rank."""
        return scatter_objects(objs, self.world)

    def mean_metrics(self, metrics: dict[str, float], summed: tuple[str, ...] = (),
                     weights: dict[str, float] | None = None) -> dict[str, float]:
        """Each metric averaged over the ranks that report it; `summed` keys (counts) added up; `weights` keys
        (row means) weighted by this rank's rows."""
        return mean_metrics(metrics, self.world, summed=summed, weights=weights)
