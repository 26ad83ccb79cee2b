"""Heterogeneous rollout-worker pools (`workers.pools`): how a synchronous step's groups are shared between workers
of different speeds, and what each pool is logged with.

A synchronous step (S = 0) hands each worker one contiguous share of the step's whole groups, sized by its pool's
`throughput` (rollouts/s of one worker, the figure `dllm-rl plan` chose the mix from; none given: an even split),
so that the shares finish together. The split depends on the config only, never on timings, so a synchronous run
is reproducible whatever the pools' speeds (and, with one sampler for every pool, equals in-process rollouts). The
asynchronous pipeline (S > 0, `workers.pipe`) needs no split: each group goes to the least busy worker, so a fast
worker simply takes more groups.

Per pool and step (`pool/<name>/...`, over the groups trained at the step): `rollouts`; `throughput`, the rollouts
one of its workers generates per second while generating (the planner's input); `utilisation`, its workers'
seconds generating over their seconds available since the previous step's rollouts were taken (over a run, the
share of time the pool was busy); `lag_mean`, the mean policy lag of its groups."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from dllm_rl.workers.config import PoolConfig


def worker_weights(pools: Sequence[PoolConfig]) -> list[float]:
    """Each worker's share of a synchronous step, in the pools' worker order: its pool's throughput, or 1."""
    return [p.throughput if p.throughput is not None else 1.0 for p in pools for _ in range(p.count)]


def assign_groups(keys: list[tuple[int, int, int]], weights: Sequence[float]) -> list[list[int]]:
    """The rollouts (indices into `keys`, grouped by key[0]) of each worker: whole groups, contiguous, worker w's
    share of the rollouts as close to weights[w] / sum(weights) as whole groups allow (a group goes to the worker
    whose share its middle rollout falls in); a worker may get none."""
    groups: dict[int, list[int]] = {}
    for i, (b, _, _) in enumerate(keys):
        groups.setdefault(b, []).append(i)
    total_w, total = float(sum(weights)), len(keys)
    bounds = [sum(weights[:w + 1]) / total_w for w in range(len(weights))]  # each share's end, as a fraction
    shares: list[list[int]] = [[] for _ in weights]
    done = 0
    for members in groups.values():
        middle = (done + len(members) / 2) / total
        shares[next((w for w, end in enumerate(bounds) if middle < end), len(weights) - 1)].extend(members)
        done += len(members)
    return shares


def pool_metrics(made: Sequence[tuple[object, int]], pools: Sequence[PoolConfig], period_s: float) -> dict[str, float]:
    """`pool/<name>/...` of the groups trained at a step: (Generated, lag) pairs, each stamped with its pool and
    its worker's generating seconds; `period_s` the seconds since the previous step's rollouts were taken."""
    out: dict[str, float] = {}
    for pool in pools:
        mine = [(g, lag) for g, lag in made if g.pool == pool.name]
        rollouts = sum(int(g.samples.sequences_BL.shape[0]) for g, _ in mine)
        busy = sum(g.seconds for g, _ in mine)
        out[f"pool/{pool.name}/rollouts"] = float(rollouts)
        out[f"pool/{pool.name}/utilisation"] = busy / (pool.count * period_s) if period_s > 0 else 0.0
        if mine:
            out[f"pool/{pool.name}/throughput"] = rollouts / busy if busy > 0 else 0.0
            out[f"pool/{pool.name}/lag_mean"] = sum(lag for _, lag in mine) / len(mine)
    return out


@dataclass
class PoolMeter:
    """`pool_metrics` with the period measured: from the previous call (the first: from `started`)."""

    pools: list[PoolConfig]
    last: float | None = field(default=None)

    def __call__(self, made: Sequence[tuple[object, int]], started: float) -> dict[str, float]:
        now = time.perf_counter()
        period = now - (self.last if self.last is not None else started)
        self.last = now
        return pool_metrics(made, self.pools, period)


def describe_pools(pools: Sequence[PoolConfig]) -> str:
    """The pools as the run header prints them: count, device, threads, decoding, throughput figure, price."""
    lines = []
    for p in pools:
        decoding = ", ".join(f"{k}={v}" for k, v in p.sampler.items()) or "the run's rollout sampler"
        figure = f"{p.throughput:g} rollouts/s each" if p.throughput is not None else "even share"
        lines.append(f"  pool {p.name}: {p.count} x (device {p.device}, {p.threads} threads, {p.cpus:g} CPUs, "
                     f"{p.gpus:g} GPUs), {decoding}; {figure}; {p.price:g}/h each")
    total = sum(p.count * p.price for p in pools)
    return "\n".join([f"rollout workers: {sum(p.count for p in pools)} in {len(pools)} pool(s), {total:g}/h", *lines])
