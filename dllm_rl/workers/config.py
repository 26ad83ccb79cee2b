"""The `workers` group of configs/train.yaml: where a run's rollouts are generated (dllm_rl/workers/remote.py), by
one pool of alike workers (`workers.count`) or by heterogeneous pools (`workers.pools`, docs/workers.md)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dllm_rl.errors import check_kwargs, check_ranges, check_types, require


TRANSPORTS = ("object_store", "broadcast", "nccl")
DEVICES = ("auto", "cpu", "cuda")
# the sampler settings a pool may set for itself: how fast a rollout is decoded, never the window it fills or the
# distribution it samples from (gen_length, steps, temperature... stay the run's `rollout` group)
POOL_SAMPLER_KEYS = ("threshold", "factor", "random_first", "cache", "cache_refresh")


@dataclass(frozen=True)
class PoolConfig:
    """One pool of alike rollout workers (`workers.pools.<name>`)."""

    name: str
    count: int = 1  # workers in the pool
    threads: int = 1  # torch threads per worker
    cpus: float = 1.0  # logical CPUs Ray reserves per worker
    gpus: float = 0.0  # GPUs Ray reserves per worker (a fraction shares one)
    device: str = "auto"  # auto (the worker's GPU where Ray gave it one, else the CPU) | cpu | cuda
    sampler: dict[str, Any] = field(default_factory=dict)  # POOL_SAMPLER_KEYS over the run's rollout group
    throughput: float | None = None  # rollouts/s of one worker (the planner's figure): its share of a synchronous step
    price: float = 0.0  # per hour of one worker: reported with the pool

    def __post_init__(self) -> None:
        key = f"workers.pools.{self.name}"
        require(re.fullmatch(r"[A-Za-z0-9_-]+", self.name) is not None,
                f"workers.pools: pool name {self.name!r}: expected letters, digits, '_' or '-' (it names metrics)")
        check_ranges({"count": self.count, "threads": self.threads}, dict.fromkeys(("count", "threads"), "at_least_1"),
                     key)
        check_ranges({"cpus": self.cpus, "throughput": self.throughput}, dict.fromkeys(("cpus", "throughput"),
                                                                                       "positive"), key)
        check_ranges({"gpus": self.gpus, "price": self.price}, dict.fromkeys(("gpus", "price"), "non_negative"), key)
        require(self.device in DEVICES, f"{key}.device={self.device!r}: expected one of {DEVICES}")
        require(self.device != "cuda" or self.gpus > 0,
                f"{key}.device=cuda with {key}.gpus={self.gpus}: Ray gives a worker a GPU only where it reserves one; "
                f"set {key}.gpus (1, or a fraction to share one)")
        unknown = sorted(set(self.sampler) - set(POOL_SAMPLER_KEYS))
        require(not unknown, f"{key}.sampler: {unknown} cannot differ between pools; a pool sets only how fast it "
                f"decodes, {list(POOL_SAMPLER_KEYS)} (the window and the distribution are the run's `rollout` group)")

    def settings(self, sampler: dict[str, Any]) -> dict[str, Any]:
        """The run's rollout sampler with this pool's settings over it."""
        return {**sampler, **self.sampler}


@dataclass(frozen=True)
class WorkersConfig:
    """The `workers` group of configs/train.yaml."""

    count: int = 0  # rollout actors; 0 = rollouts in the learner's process
    address: str | None = None  # a running Ray cluster's head (host:port); None = start a local Ray
    threads: int = 1  # torch threads per worker
    cpus: float = 1.0  # logical CPUs Ray reserves per worker
    timeout_s: float = 600.0  # the longest wait for the workers (a load, a step's rollouts): then a named error
    object_store_mb: int = 256  # a local Ray's object store (shared memory), in MiB
    max_staleness: int = 0  # S: policy versions a group may lag the step that trains on it (0 = synchronous)
    pipe: bool = False  # complete-group pipelining: each finished group's backward while the others generate
    sync_every: int = 1  # publish the learner's weights to the workers every this many updates (needs S >= it - 1)
    transport: str = "object_store"  # how snapshots travel: object_store (Ray's) | broadcast (gloo) | nccl (GPU to GPU)
    pools: dict[str, Any] | None = None  # {name: pool settings}: heterogeneous pools in place of `count` alike workers

    def __post_init__(self) -> None:
        for key, ok, expected in (("count", self.count >= 0, ">= 0 (0 = in-process rollouts)"),
                                  ("threads", self.threads >= 1, ">= 1"), ("cpus", self.cpus > 0, "> 0"),
                                  ("timeout_s", self.timeout_s > 0, "> 0"),
                                  ("max_staleness", self.max_staleness >= 0, ">= 0 (0 = synchronous)"),
                                  ("sync_every", self.sync_every >= 1, ">= 1"),
                                  ("object_store_mb", self.object_store_mb >= 80, ">= 80 (Ray's minimum is 75 MiB)")):
            require(ok, f"workers.{key} must be {expected}, got {getattr(self, key)!r}")
        require(self.transport in TRANSPORTS, f"workers.transport={self.transport!r}: expected one of {TRANSPORTS}")
        require(self.transport == "object_store" or (self.max_staleness == 0 and not self.pipe),
                f"workers.transport={self.transport} with workers.max_staleness={self.max_staleness}, workers.pipe="
                f"{self.pipe}: a broadcast needs every worker at once, which only synchronous workers are; use "
                f"workers.transport=object_store")
        require(self.max_staleness >= self.sync_every - 1,
                f"workers.sync_every={self.sync_every} with workers.max_staleness={self.max_staleness}: between two "
                f"snapshots the workers generate from weights up to {self.sync_every - 1} updates old, more than the "
                f"bound allows; set workers.max_staleness>={self.sync_every - 1}")
        require(self.pools is None or self.count == 0,
                f"workers.count={self.count} with workers.pools: the pools say how many workers there are; set "
                f"workers.count=0 (or workers.pools=null for {self.count} alike workers)")
        pools = self.pool_list()  # every pool's settings checked here, before anything starts
        cpu = [p.name for p in pools if p.gpus == 0 or p.device == "cpu"]
        require(self.transport != "nccl" or not cpu,
                f"workers.transport=nccl with pool(s) {cpu} on the CPU: nccl broadcasts from the learner's GPU to GPU "
                f"workers; give every pool a GPU (workers.pools.<name>.gpus) or use "
                f"workers.transport=broadcast (gloo, host memory)")

    def pool_list(self) -> list[PoolConfig]:
        """The pools, in their config order: `pools`, each pool's threads and cpus defaulting to the group's; or
        one pool named `default` of `count` alike workers (none where count is 0)."""
        if self.pools is None:
            return [PoolConfig("default", self.count, self.threads, self.cpus)] if self.count else []
        require(isinstance(self.pools, dict) and self.pools, f"workers.pools={self.pools!r}: expected a mapping of "
                f"pool names to their settings, e.g. workers.pools='{{fast: {{count: 2, sampler: {{threshold: 0.9}}}}, "
                f"exact: {{count: 1}}}}'")
        out = []
        for name, spec in self.pools.items():
            require(isinstance(spec, dict), f"workers.pools.{name}={spec!r}: expected a mapping of pool settings")
            check_kwargs(PoolConfig, spec, f"workers.pools.{name}", exclude=("name",))
            spec = {"threads": self.threads, "cpus": self.cpus, **spec, "name": str(name)}
            check_types(PoolConfig, spec, f"workers.pools.{name}")
            out.append(PoolConfig(**spec))
        given = [p.throughput is not None for p in out]
        require(all(given) or not any(given),
                f"workers.pools: throughput given for {[p.name for p in out if p.throughput is not None]} but not for "
                f"{[p.name for p in out if p.throughput is None]}: a synchronous step splits its groups by these "
                f"figures, so give every pool one (or none: an even split)")
        return out

    @property
    def size(self) -> int:
        """Rollout workers in all (0 = rollouts in the learner's process)."""
        return sum(p.count for p in self.pool_list())
