"""Ranks and collectives: the process group every run has, launched or not.

`init_distributed` is the one way in. Under a launcher (`deepspeed`, `torchrun`) the environment already names
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a plain `dllm-rl train` gets them set here (rank 0
of 1, a free port), so one process and many take the same code path. Collectives time out after
`timeout_s` (DeepSpeed's own groups too), so a rank that dies makes the others fail with an error instead of
hanging, and `rendezvous.py` makes that error name the rank and its reason.

On CPU the backend is gloo. DeepSpeed would JIT-compile its shared-memory all-reduce on first use (about a
minute per fresh machine); gloo is enough for the CPU case, so that op is switched off unless
DLLM_RL_DS_SHM=1.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dllm_rl.device import gpu_usable
from dllm_rl.engine import rendezvous
from dllm_rl.engine.rendezvous import RollCall, apply_group_timeout, open_store


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MARKER = "DLLM_RL_SINGLE_PROCESS"  # "<pid>:<port>" of the process that set up a world of 1 by itself


def launched() -> bool:
    """Whether a launcher set up this process's world. Variables that an earlier `dllm-rl` process set for a
    world of 1 (inherited by a child it started, which then sees its parent's port) do not count."""
    if "WORLD_SIZE" not in os.environ:
        return False
    pid, _, port = os.environ.get(MARKER, "").partition(":")
    inherited = pid not in ("", str(os.getpid())) and port == os.environ.get("MASTER_PORT")
    return not inherited


def single_process_environment() -> dict[str, str]:
    """The variables a launcher would set, for rank 0 of a world of 1 on a free port."""
    port = str(free_port())
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            MARKER: f"{os.getpid()}:{port}"}


def init_distributed(timeout_s: float = 600.0) -> World:
    """Join (or create) the default process group; returns this process's place in it. Every rank checks in
    at the rendezvous first, so one that never comes is named after `timeout_s` (see rendezvous.py)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    if not launched():
        os.environ.update(single_process_environment())
    else:  # a launcher set the world; fill in what some launchers leave out
        os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    quiet_deepspeed()
    if os.environ.get("DLLM_RL_DS_SHM") != "1":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    rank, size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    apply_group_timeout(timeout)
    store = open_store(rank, size, timeout)
    global GENERATION
    GENERATION += 1
    roll = rendezvous.ROLL = RollCall(store, rank, size, timeout_s, GENERATION)
    roll("the rendezvous", absent="not started, or failed before joining")
    if size > 1:
        roll.heartbeat = rendezvous.Heartbeat(rank, GENERATION, timeout)
    gpu = gpu_usable()
    options = {}
    if gpu:
        torch.cuda.set_device(local_rank)
        if size > 1:  # binds the group to this rank's GPU, as DeepSpeed itself does
            options["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group("nccl" if gpu else "gloo", store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=size, timeout=timeout, **options)
    deepspeed.init_distributed(dist_backend="nccl" if gpu else "gloo", timeout=timeout, auto_mpi_discovery=False)
    return World(rank, size, local_rank)


GENERATION = 0  # process groups formed by this process; the ranks' counts agree


def quiet_deepspeed() -> None:
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)


def shutdown(clean: bool = True) -> None:
    """End the process group at the end of a program: after a barrier when all went well (a rank leaving
    early can abort its peers), at once after an error (the peers then fail on their next collective's
    timeout). A second `train()` in one process reuses the group; DeepSpeed's own destroy also drops the
    sub-groups it caches, so a group made after this one works too."""
    if dist.is_available() and dist.is_initialized():
        import deepspeed.comm

        if clean:
            dist.barrier()
        deepspeed.comm.destroy_process_group()
    if rendezvous.ROLL is not None and rendezvous.ROLL.heartbeat is not None:
        rendezvous.ROLL.heartbeat.stop()
    rendezvous.ROLL = None


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()


def collective_device() -> torch.device:
    """Where a tensor handed to a collective must live: this rank's GPU under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_sum(values: list[float], world: World) -> list[float]:
    """Elementwise sum over ranks (float64)."""
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t)
    return t.tolist()


def all_max(values: list[float], world: World) -> list[float]:
    """Elementwise maximum over ranks (float64)."""
    if world.size == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def any_rank(flag: bool, world: World) -> bool:
    return all_sum([float(flag)], world)[0] > 0


def all_gather_objects(obj: Any, world: World) -> list[Any]:
    if world.size == 1:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def mean_metrics(metrics: dict[str, float], world: World, summed: tuple[str, ...] = (),
                 weights: dict[str, float] | None = None) -> dict[str, float]:
    """Each key averaged over the ranks that report it (ranks may lack a key, e.g. no external rows); keys
    in `summed` (counts) are added up instead; keys in `weights` (a mean over this rank's rows, weighted by
    how many) are averaged with those weights, so they are the mean over all ranks' rows."""
    if world.size == 1:
        return metrics
    gathered = all_gather_objects((metrics, weights or {}), world)
    keys = list(dict.fromkeys(k for m, _ in gathered for k in m))
    out = {}
    for k in keys:
        pairs = [(m[k], w.get(k, 1.0)) for m, w in gathered if k in m]
        if k in summed:
            out[k] = sum(v for v, _ in pairs)
        elif weights is not None and k in weights:
            total = sum(w for _, w in pairs)
            out[k] = sum(v * w for v, w in pairs) / total if total > 0 else sum(v for v, _ in pairs) / len(pairs)
        else:
            out[k] = sum(v for v, _ in pairs) / len(pairs)
    return out


def gather_tensor(t: torch.Tensor, world: World) -> tuple[torch.Tensor, int]:
    """(the concatenation of every rank's `t` in rank order, where this rank's rows start in it), on `t`'s
    device. The parts travel pickled, from the CPU: a pickled CUDA tensor would unpickle onto its sender's GPU."""
    if world.size == 1:
        return t, 0
    parts = all_gather_objects(t.cpu(), world)
    return torch.cat(parts).to(t.device), sum(len(p) for p in parts[: world.rank])


def broadcast_object(obj: Any, world: World, src: int = 0) -> Any:
    if world.size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def scatter_objects(objs: list[Any] | None, world: World, src: int = 0) -> Any:
    """Rank `src`'s `objs[r]` on rank r (the other ranks pass None). Tensors travel pickled, from the CPU."""
    if world.size == 1:
        return objs[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, objs if world.rank == src else None, src=src)
    return box[0]
