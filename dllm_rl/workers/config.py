"""The `workers` group of configs/train.yaml: where a run's rollouts are generated (dllm_rl/workers/remote.py)."""

from __future__ import annotations

from dataclasses import dataclass

from dllm_rl.errors import require


TRANSPORTS = ("object_store", "broadcast")


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
    transport: str = "object_store"  # how snapshots travel: object_store (Ray's) | broadcast (a gloo group)

    def __post_init__(self) -> None:
        for key, ok, expected in (("count", self.count >= 0, ">= 0 (0 = in-process rollouts)"),
                                  ("threads", self.threads >= 1, ">= 1"), ("cpus", self.cpus > 0, "> 0"),
                                  ("timeout_s", self.timeout_s > 0, "> 0"),
                                  ("max_staleness", self.max_staleness >= 0, ">= 0 (0 = synchronous)"),
                                  ("sync_every", self.sync_every >= 1, ">= 1"),
                                  ("object_store_mb", self.object_store_mb >= 80, ">= 80 (Ray's minimum is 75 MiB)")):
            require(ok, f"workers.{key} must be {expected}, got {getattr(self, key)!r}")
        require(self.transport in TRANSPORTS, f"workers.transport={self.transport!r}: expected one of {TRANSPORTS}")
        require(self.transport != "broadcast" or (self.max_staleness == 0 and not self.pipe),
                f"workers.transport=broadcast with workers.max_staleness={self.max_staleness}, workers.pipe="
                f"{self.pipe}: a broadcast needs every worker at once, which only synchronous workers are; use "
                f"workers.transport=object_store")
        require(self.max_staleness >= self.sync_every - 1,
                f"workers.sync_every={self.sync_every} with workers.max_staleness={self.max_staleness}: between two "
                f"snapshots the workers generate from weights up to {self.sync_every - 1} updates old, more than the "
                f"bound allows; set workers.max_staleness>={self.sync_every - 1} (and sampler_correction.mode=weight)")
