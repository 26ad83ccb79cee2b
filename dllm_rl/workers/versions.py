"""Versioned policy weights for rollout workers: the learner publishes snapshots, workers load one and say which.

`policy_version` is one integer owned by the learner: bumped once per published snapshot, saved with checkpoints,
never going back. A snapshot also records `step`, the learner's update count when it was taken: staleness is
measured in updates (`step - snapshot.step`), so it means the same with `rollout.sync_every` > 1 (then versions
and steps differ).

Each snapshot carries a checksum of what was published (names, shapes, dtypes and bytes of every tensor; CRC-32,
which detects a corrupted or mismatched snapshot, not tampering) and a worker checks what it loaded against it
(`load_verified`): a mismatch is a `ChecksumMismatch` naming both. Only the last `keep` snapshots (2) stay alive
in the transport: older references are dropped when a new one is published.

The transport is one small interface (`put`, `get`, `drop`); `InMemory` is the in-process one (tests, one
process), the Ray object store is the default for workers (its object manager pulls chunks from any node that
already holds a copy: peer-assisted dissemination without a home-made protocol).
"""

from __future__ import annotations

import zlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class ChecksumMismatch(RuntimeError):
    """A worker loaded weights that are not the snapshot the learner published."""


@dataclass(frozen=True)
class Snapshot:
    """A published policy: its version, the learner's update count then, where it is, and its checksum."""

    version: int
    step: int
    ref: Any  # the transport's handle
    checksum: str


class Transport(Protocol):
    def put(self, state: dict[str, torch.Tensor]) -> Any: ...

    def get(self, ref: Any) -> dict[str, torch.Tensor]: ...

    def drop(self, ref: Any) -> None: ...


class InMemory:
    """The in-process transport: snapshots in a dict (what one process, and the unit tests, need)."""

    def __init__(self) -> None:
        self.store: dict[int, dict[str, torch.Tensor]] = {}
        self.next = 0

    def put(self, state: dict[str, torch.Tensor]) -> int:
        self.next += 1
        self.store[self.next] = state
        return self.next

    def get(self, ref: int) -> dict[str, torch.Tensor]:
        if ref not in self.store:
            raise KeyError(f"snapshot {ref} is no longer published (only the last ones are kept)")
        return self.store[ref]

    def drop(self, ref: int) -> None:
        self.store.pop(ref, None)


def checksum(state: dict[str, torch.Tensor]) -> str:
    """CRC-32 over every tensor's name, dtype, shape and bytes, in name order: 8 hex digits."""
    crc = 0
    for name in sorted(state):
        tensor = state[name].detach()
        crc = zlib.crc32(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode(), crc)
        # cpu: the bytes are read on the host (a snapshot travels from host memory anyway)
        data = tensor.to("cpu").contiguous().reshape(-1)
        crc = zlib.crc32(data.view(torch.uint8).numpy().data if data.numel() else b"", crc)
    return f"{crc:08x}"


class Publisher:
    """The learner's side: `publish` a state dict as the next version; the last `keep` snapshots stay alive."""

    def __init__(self, transport: Transport, version: int = 0, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep={keep}: at least the newest snapshot must stay published")
        self.transport, self.version, self.keep = transport, version, keep
        self.last_mb = 0.0  # the newest snapshot's size in MiB (bf16 weights: half of fp32's)
        self.alive: deque[Snapshot] = deque()

    def publish(self, state: dict[str, torch.Tensor], step: int) -> Snapshot:
        if self.alive and step < self.alive[-1].step:
            raise ValueError(f"publishing step {step} after step {self.alive[-1].step}: versions never go back")
        self.version += 1
        self.last_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        snapshot = Snapshot(self.version, step, self.transport.put(state), checksum(state))
        self.alive.append(snapshot)
        while len(self.alive) > self.keep:
            self.transport.drop(self.alive.popleft().ref)
        return snapshot

    @property
    def latest(self) -> Snapshot | None:
        return self.alive[-1] if self.alive else None

    def state_dict(self) -> dict[str, int]:
        return {"policy_version": self.version}


def load_verified(transport: Transport, snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """A worker's side: the snapshot's state dict, checked against its published checksum."""
    state = transport.get(snapshot.ref)
    found = checksum(state)
    if found != snapshot.checksum:
        raise ChecksumMismatch(f"policy version {snapshot.version} (step {snapshot.step}): the loaded weights have "
                               f"checksum {found}, the learner published {snapshot.checksum}")
    return state
