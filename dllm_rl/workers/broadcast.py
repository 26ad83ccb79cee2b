"""`workers.transport=broadcast`: each snapshot reaches every worker by one collective broadcast over a process group
of the learner (rank 0) and the workers (ranks 1..W), instead of through Ray's object store.

The group is torch.distributed's gloo backend over TCP, built apart from the learners' own process group (which
holds only the learner ranks): a `ProcessGroupGloo` on a `TCPStore` that the learner hosts on a free port of its
node's address. The wire format: the snapshot's layout (every tensor's name, dtype and shape, in name order) travels
with the snapshot through the actor call; the bytes travel as one flat buffer per dtype. The checksum is checked
on arrival as with the object store. A broadcast needs every worker in it at once, so this transport serves the
synchronous workers only (every worker loads each snapshot at the same time); the config refuses it with
`max_staleness` > 0 or `pipe`, where each worker loads when its queue reaches the load. NCCL groups (GPU to GPU
without the host) are not built: gloo sends host memory, as the object store does.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch

from dllm_rl.workers.errors import WorkersError

@dataclass(frozen=True)
class Layout:
    """What a receiver needs to rebuild a snapshot: every tensor's name, dtype and shape, in name order."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]

    def sizes(self) -> dict[torch.dtype, int]:
        """Elements per dtype."""
        out: dict[torch.dtype, int] = {}
        for _, dtype, shape in self.entries:
            out[dtype] = out.get(dtype, 0) + math.prod(shape)
        return out


def layout_of(state: dict[str, torch.Tensor]) -> Layout:
    return Layout(tuple((name, state[name].dtype, tuple(state[name].shape)) for name in sorted(state)))


def flat_buffers(state: dict[str, torch.Tensor], layout: Layout) -> dict[torch.dtype, torch.Tensor]:
    """One flat host buffer per dtype, the tensors in the layout's order."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for name, dtype, _ in layout.entries:
        # cpu: gloo sends host memory
        groups.setdefault(dtype, []).append(state[name].detach().to("cpu").reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in groups.items()}


def unflatten(buffers: dict[torch.dtype, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """The state dict back from `flat_buffers`' buffers."""
    offsets = dict.fromkeys(buffers, 0)
    out = {}
    for name, dtype, shape in layout.entries:
        count = math.prod(shape)
        out[name] = buffers[dtype][offsets[dtype]:offsets[dtype] + count].view(shape)
        offsets[dtype] += count
    return out


class BroadcastGroup:
    """One member of the group: rank 0 is the learner (it hosts the store), 1..W the workers. Constructing it
    waits (at most `timeout_s`) until every member has joined."""

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_s: float):
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, size, rank == 0, timeout, wait_for_workers=False)
            self.group = dist.ProcessGroupGloo(store, rank, size, timeout)
        except Exception as error:  # RuntimeError or DistStoreError, with the port and the rank
            raise WorkersError(f"the broadcast group at {host}:{port} did not form (rank {rank} of {size}, "
                               f"{timeout_s:g} s): {type(error).__name__}: {error}") from None
        self.port = store.port
        self.rank = rank

    def broadcast(self, buffers: dict[torch.dtype, torch.Tensor]) -> None:
        """Every buffer from rank 0 to the others, in dtype-name order (rank 0's are sent, the others filled)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            for dtype in sorted(buffers, key=str):
                self.group.broadcast([buffers[dtype]], options).wait()
        except RuntimeError as error:  # gloo's timeout or a member gone
            raise WorkersError(f"the snapshot broadcast failed on rank {self.rank}: {str(error).splitlines()[0]}") \
                from None


class BroadcastSender:
    """The learner's transport: `put` keeps the state and returns its layout (the snapshot's reference); `send`
    broadcasts it while the workers are in `BroadcastReceiver.get`. Nothing outlives the next `put`."""

    def __init__(self, group: BroadcastGroup):
        self.group = group
        self.pending: tuple[Layout, dict[torch.dtype, torch.Tensor]] | None = None

    def put(self, state: dict[str, torch.Tensor]) -> Layout:
        layout = layout_of(state)
        self.pending = (layout, flat_buffers(state, layout))
        return layout

    def send(self) -> None:
        if self.pending is None:
            raise WorkersError("nothing was published to broadcast")
        self.group.broadcast(self.pending[1])
        self.pending = None

    def get(self, ref: Any) -> dict[str, torch.Tensor]:
        raise WorkersError("the learner's side of the broadcast group sends; it does not load")

    def drop(self, ref: Any) -> None:
        pass


class BroadcastReceiver:
    """A worker's transport: `get(layout)` receives the snapshot the learner is broadcasting."""

    def __init__(self, group: BroadcastGroup):
        self.group = group

    def put(self, state: dict[str, torch.Tensor]) -> Any:
        raise WorkersError("a worker's side of the broadcast group receives; it does not publish")

    def get(self, ref: Layout) -> dict[str, torch.Tensor]:
        # cpu: gloo receives into host memory; the worker moves the state to its device when loading
        buffers = {dtype: torch.empty(n, dtype=dtype, device="cpu") for dtype, n in ref.sizes().items()}
        self.group.broadcast(buffers)
        return unflatten(buffers, ref)

    def drop(self, ref: Any) -> None:
        pass
