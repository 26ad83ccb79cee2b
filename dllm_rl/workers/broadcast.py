"""`workers.transport=broadcast` (gloo) or `nccl`: each snapshot reaches every worker by collective broadcasts over a
process group of the learner (rank 0) and the workers (ranks 1..W), instead of through Ray's object store.

The group is built apart from the learners' own process group (which holds only the learner ranks), on a `TCPStore`
that the learner hosts on a free port of its node's address: `ProcessGroupGloo` over TCP from host memory
(`broadcast`), or `ProcessGroupNCCL` from GPU memory to GPU memory (`nccl`: a GPU learner and GPU workers, the
snapshot never staged on the host). One code path serves both: the snapshot's layout (every tensor's name, dtype
and shape, in name order) travels with the snapshot through the actor call, then every tensor is broadcast in that
order from where it lies on the group's device (rank 0's tensors sent as they are, the others received into fresh
tensors), so no flat copy of the model is ever made (an 8B model in bf16 would need 16 GB more on the learner's
GPU). The checksum is checked on arrival as with the object store (it reads the bytes on the host: an O(model) cost
per snapshot). A broadcast needs every worker in it at once, so these transports serve the synchronous workers
only (every worker loads each snapshot at the same time); the config refuses them with `max_staleness` > 0 or
`pipe`, where each worker loads when its queue reaches the load.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

from dllm_rl.workers.errors import WorkersError


@dataclass(frozen=True)
class Layout:
    """What a receiver needs to rebuild a snapshot: every tensor's name, dtype and shape, in name order."""

    entries: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]


def layout_of(state: dict[str, torch.Tensor]) -> Layout:
    return Layout(tuple((name, state[name].dtype, tuple(state[name].shape)) for name in sorted(state)))


BACKENDS = {"broadcast": "gloo", "nccl": "nccl"}  # workers.transport -> the group's torch.distributed backend


class BroadcastGroup:
    """One member of the group: rank 0 is the learner (it hosts the store), 1..W the workers; `backend` gloo (the
    tensors in host memory) or nccl (on `device`, a GPU: this process's current device becomes it). Constructing it
    waits (at most `timeout_s`) until every member has joined (nccl forms its communicator at the first broadcast)."""

    def __init__(self, host: str, port: int, rank: int, size: int, timeout_s: float, backend: str = "gloo",
                 device: torch.device | str = "cpu"):
        import torch.distributed as dist

        self.device = torch.device(device)
        if backend not in BACKENDS.values():
            raise WorkersError(f"broadcast backend {backend!r}: expected one of {sorted(set(BACKENDS.values()))}")
        if (backend == "nccl") != (self.device.type == "cuda"):
            raise WorkersError(f"a {backend} broadcast group on {self.device}: nccl moves GPU memory (a cuda device), "
                               f"gloo host memory (cpu)")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, size, rank == 0, timeout, wait_for_workers=False)
            if backend == "nccl":
                if not dist.is_nccl_available():
                    raise RuntimeError("this torch has no NCCL")
                torch.cuda.set_device(self.device)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.group = dist.ProcessGroupNCCL(store, rank, size, options)
            else:
                self.group = dist.ProcessGroupGloo(store, rank, size, timeout)
        except Exception as error:  # RuntimeError or DistStoreError, with the port and the rank
            raise WorkersError(f"the {backend} broadcast group at {host}:{port} did not form (rank {rank} of {size}, "
                               f"{timeout_s:g} s): {type(error).__name__}: {error}") from None
        self.port = store.port
        self.rank, self.backend = rank, backend

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Every tensor from rank 0 to the others, in order (rank 0's are sent, the others filled in place)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        try:
            for tensor in tensors:
                if tensor.numel():
                    self.group.broadcast([tensor], options).wait()
            if self.device.type == "cuda":  # the received tensors are read next, on the host or another stream
                torch.cuda.synchronize(self.device)
        except RuntimeError as error:  # the backend's timeout or a member gone
            raise WorkersError(f"the snapshot broadcast failed on rank {self.rank}: {str(error).splitlines()[0]}") \
                from None


class BroadcastSender:
    """The learner's transport: `put` keeps the state's tensors (on the group's device, contiguous: no copy where
    they already are) and returns its layout (the snapshot's reference); `send` broadcasts them while the workers
    are in `BroadcastReceiver.get`. Nothing outlives the next `send`."""

    def __init__(self, group: BroadcastGroup):
        self.group = group
        self.pending: tuple[Layout, list[torch.Tensor]] | None = None

    def put(self, state: dict[str, torch.Tensor]) -> Layout:
        layout = layout_of(state)
        # cpu or the learner's GPU: the group's device (gloo sends host memory, nccl GPU memory)
        self.pending = (layout, [state[name].detach().to(self.group.device).contiguous()
                                 for name, _, _ in layout.entries])
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
    """A worker's transport: `get(layout)` receives the snapshot the learner is broadcasting, on the group's
    device."""

    def __init__(self, group: BroadcastGroup):
        self.group = group

    def put(self, state: dict[str, torch.Tensor]) -> Any:
        raise WorkersError("a worker's side of the broadcast group receives; it does not publish")

    def get(self, ref: Layout) -> dict[str, torch.Tensor]:
        # cpu or the worker's GPU: the group's device; the worker's model copies them in when loading
        out = {name: torch.empty(shape, dtype=dtype, device=self.group.device) for name, dtype, shape in ref.entries}
        self.group.broadcast(list(out.values()))
        return out

    def drop(self, ref: Any) -> None:
        pass
