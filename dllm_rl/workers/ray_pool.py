"""Rollout workers as Ray actors: each holds its own copy of the policy at a published version and runs the same
sampler, with the same seed contract, as the learner's in-process rollouts.

Ray runs beside the learner (which stays a DeepSpeed engine under the `deepspeed` launcher or `torchrun`): on one
machine the run starts a local Ray (`start_ray()`); across machines it joins a cluster started by hand:

    ray start --head --port=6379 --num-cpus=<cores for workers>          # on the head node
    ray start --address=<head ip>:6379 --num-cpus=<cores>                # on each other node

and the run's `address` is `<head ip>:6379`. Snapshots travel through Ray's object store (`RayStore`): a worker
on another node pulls the chunks from any node that already holds a copy.

A worker is stateless apart from its loaded snapshot: `load` checks the checksum of what it received against what
the learner published (dllm_rl/workers/versions.py), `generate` returns plain CPU tensors stamped with the
version and update count they were generated from. Ray is imported only here, and only when used.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import time
from typing import Any, Sequence

import torch

from dllm_rl.workers.config import PoolConfig
from dllm_rl.workers.errors import WorkerDied, WorkersError
from dllm_rl.workers.versions import Snapshot, load_verified


# the local Rays this process started: (session directory, the write end of its reaper's pipe); `stop_ray` removes them
SESSIONS: list[tuple[str, int]] = []


def start_ray(address: str | None = None, num_cpus: int | None = None, object_store_mb: int = 256,
              temp_dir: str | None = None) -> None:
    """A local Ray (address None: this machine only, `num_cpus` logical CPUs, the object store capped at
    `object_store_mb` MiB in /dev/shm, no dashboard, its session under `temp_dir`, which `stop_ray` removes, and
    which a reaper removes with what is left of Ray if this process is killed: dllm_rl/workers/reaper.py), or a
    running cluster joined at `address`."""
    import ray

    if address is not None and address != "auto":
        reachable(address)  # ray.init retries an absent cluster for minutes, then aborts the process
    options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
    if address is None:
        options.update(num_cpus=num_cpus, object_store_memory=object_store_mb * 2**20, _temp_dir=temp_dir)
    # Ray turns token authentication on for a new local cluster (good) and warns that it did on every start; the
    # warning is held back (RAY_AUTH_MODE=disabled in the environment still opts out, and other warnings show)
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    if address is None and temp_dir is not None:
        from dllm_rl.workers.reaper import start_reaper

        SESSIONS.append((temp_dir, start_reaper(temp_dir)))
    try:
        ray.init(address=address, **options)
    except Exception as error:  # ray raises ConnectionError, RuntimeError, ValueError, TimeoutError...
        stop_ray()
        where = f"the cluster at address={address!r}" if address else "a local Ray"
        raise WorkersError(f"Ray did not start ({where}): {type(error).__name__}: {error}") from None


def reachable(address: str, timeout_s: float = 10.0) -> None:
    """A named error unless something accepts TCP connections at `address` (host:port, the head's GCS port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise WorkersError(f"address={address!r}: expected host:port of a Ray head (ray start --head --port=6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise WorkersError(f"Ray did not start (the cluster at address={address!r}): nothing answers there "
                           f"({error.strerror or error}); "
                           f"start its head with `ray start --head --port={port}`") from None


def stop_ray() -> None:
    """Shut Ray down (its processes end with it), and remove the session directories of the local Rays this
    process started (their logs and sockets); a no-op where it is not running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    while SESSIONS:
        session_dir, reaper = SESSIONS.pop()
        shutil.rmtree(session_dir, ignore_errors=True)
        os.close(reaper)  # its reaper finds nothing left, and exits


class RayStore:
    """The transport over Ray's object store: an object lives while some reference to it does (the publisher
    keeps the last two; a worker holds the one it is loading)."""

    def put(self, state: dict[str, torch.Tensor]) -> Any:
        import ray

        # cpu: the object store holds host memory; a GPU worker copies the state to its device when loading
        return ray.put({name: tensor.detach().to("cpu") for name, tensor in state.items()})

    def get(self, ref: Any) -> dict[str, torch.Tensor]:
        import ray

        return ray.get(ref)

    def drop(self, ref: Any) -> None:
        pass  # the publisher forgets the reference; Ray frees the object once no worker holds it


@dataclasses.dataclass
class Generated:
    """A worker's samples of some prompts, with the snapshot they came from."""

    version: int
    step: int  # the learner's update count when the snapshot was published: a row's lag is (step trained - step)
    checksum: str
    samples: Any  # Samples, on the CPU
    pool: str = "default"  # the name of the worker's pool
    seconds: float = 0.0  # the worker's seconds generating them


class RolloutWorker:
    """The body of a rollout actor (`ray.remote(RolloutWorker)`): a policy loaded from a local checkpoint path, the
    rollout sampler's settings (its pool's), the learner's autocast choice; `threads` torch threads (so workers
    beside the learner do not oversubscribe the cores), on `device` (auto: the GPU Ray gave it, else the CPU)."""

    def __init__(self, model: str, sampler: dict[str, Any], bf16: bool, threads: int = 1,
                 trust_remote_code: bool = False, device: str = "auto", pool: str = "default"):
        from dllm_rl.device import autocast
        from dllm_rl.policy.adapters import load_policy
        from dllm_rl.rollout.generate import TextGenerator

        torch.set_num_threads(threads)
        here = worker_device(device, pool)
        self.policy, tokenizer = load_policy(model, device=here, trust_remote_code=trust_remote_code)
        self.policy.model.eval()
        self.generator = TextGenerator(self.policy, tokenizer, **sampler)
        self.autocast = lambda: autocast(here, bf16)
        self.snapshot: Snapshot | None = None
        self.transport: Any = RayStore()
        self.pool = pool

    def join_broadcast(self, host: str, port: int, rank: int, size: int, timeout_s: float,
                       backend: str = "gloo") -> int:
        """Receive snapshots by the learner's broadcasts from now on (`workers.transport=broadcast` or `nccl`: into
        host memory, or into this worker's GPU)."""
        from dllm_rl.workers.broadcast import BroadcastGroup, BroadcastReceiver

        device = self.policy.device if backend == "nccl" else "cpu"
        self.transport = BroadcastReceiver(BroadcastGroup(host, port, rank, size, timeout_s, backend, device))
        return rank

    def load(self, snapshot: Snapshot) -> int:
        """Load a published snapshot (checked against its checksum); its version. The worker holds the weights
        in the snapshot's dtype: a bf16 learner (`deepspeed.bf16=true`) publishes bf16 weights, and the worker's
        model is cast to bf16 before loading them, so it samples with the learner's numbers."""
        state = load_verified(self.transport, snapshot)
        dtype = snapshot_dtype(state)
        if dtype is not None and dtype != next(self.policy.model.parameters()).dtype:
            self.policy.model.to(dtype)
        self.policy.model.load_state_dict(state)
        self.snapshot = snapshot
        return snapshot.version

    def generate(self, prompts: Sequence[str], seeds: Sequence[int]) -> Generated:
        """The loaded policy's rollouts of `prompts`, rollout i drawing from `seeds[i]`."""
        if self.snapshot is None:
            raise WorkersError("a rollout worker was asked to generate before any snapshot was loaded")
        start = time.perf_counter()
        with torch.no_grad(), self.autocast():
            samples = self.generator.sample(list(prompts), list(seeds))
        # cpu: results travel back through the object store in host memory
        host = {f.name: getattr(samples, f.name) for f in dataclasses.fields(samples)}
        host = {k: v.to("cpu") if isinstance(v, torch.Tensor) else v for k, v in host.items()}
        return Generated(self.snapshot.version, self.snapshot.step, self.snapshot.checksum, type(samples)(**host),
                         self.pool, time.perf_counter() - start)

    def version(self) -> int | None:
        return None if self.snapshot is None else self.snapshot.version

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The id of the Ray node this worker runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()


def snapshot_dtype(state: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The one floating dtype of a state dict's tensors (None where they mix dtypes, or hold none)."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def worker_device(option: str, pool: str) -> torch.device:
    """A worker's device: `cuda` the GPU Ray gave it (named error where it has none), `cpu`, or `auto` (the GPU
    where it has one). Ray shows an actor only its own GPUs, so it is always device 0 of them."""
    from dllm_rl.device import gpu_usable

    if option == "cpu" or (option == "auto" and not gpu_usable()):
        return torch.device("cpu")
    if not gpu_usable():
        raise WorkersError(f"workers.pools.{pool}.device=cuda, but its worker on node {socket.gethostname()} "
                           f"sees no usable CUDA GPU (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return torch.device("cuda", 0)


class WorkerPool:
    """Rollout actors of one or more pools (`pools`: a count of alike workers, or `PoolConfig`s), each reserving
    its pool's logical CPUs and GPUs; worker i of the flat list belongs to pool `kinds[i]`. Every call waits at most
    `timeout_s` (a worker that does not answer in time is a named error, never a hang)."""

    def __init__(self, pools: int | Sequence[PoolConfig], model: str, sampler: dict[str, Any], bf16: bool,
                 threads: int = 1, cpus: float = 1.0, timeout_s: float = 600.0, trust_remote_code: bool = False):
        import ray

        if isinstance(pools, int):
            pools = [PoolConfig("default", pools, threads, cpus)] if pools >= 1 else []
        if not pools:
            raise ValueError("a worker pool has at least one worker")
        self.pools = list(pools)
        self.kinds = [p for p in self.pools for _ in range(p.count)]

        def start(pool: PoolConfig):
            actor = ray.remote(num_cpus=pool.cpus, num_gpus=pool.gpus)(RolloutWorker)
            return actor.remote(model, pool.settings(sampler), bf16, pool.threads, trust_remote_code, pool.device,
                                pool.name)

        self.start = lambda worker: start(self.kinds[worker])
        self.timeout_s = timeout_s
        self.actors = [self.start(i) for i in range(len(self.kinds))]
        self.sender = None  # the learner's side of a broadcast group (`join_broadcast`), or None: the object store
        self.ready()

    def ready(self) -> None:
        """Wait (at most `timeout_s` in all) for every worker to have loaded its model; one that failed to, or did
        not in time, is named with its pool, and every worker is stopped."""
        import ray

        refs = [actor.pid.remote() for actor in self.actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        for pool, ref in sorted(zip(self.kinds, refs), key=lambda x: x[1] in pending):  # failures first
            try:
                if ref in pending:
                    raise TimeoutError(f"it did not start within {self.timeout_s:g} s (does the cluster have its "
                                       f"resources: {pool.cpus:g} CPUs, {pool.gpus:g} GPUs per worker?)")
                ray.get(ref)
            except Exception as error:  # RayActorError holding the constructor's
                self.close()
                # Ray's message is the remote traceback: its last line names the constructor's error
                cause = [line for line in str(error).splitlines() if line.strip()][-1].strip()
                raise WorkersError(f"a rollout worker of pool {pool.name!r} failed to start: {cause}") from None

    def join_broadcast(self, backend: str = "gloo") -> None:
        """Form the broadcast group of this process (rank 0) and the workers; snapshots then travel by it (gloo:
        from host memory; nccl: from this process's current GPU to each worker's)."""
        import ray

        from dllm_rl.engine.dist import free_port
        from dllm_rl.workers.broadcast import BroadcastGroup, BroadcastSender

        host, port, size = ray.util.get_node_ip_address(), free_port(), len(self.actors) + 1
        refs = [a.join_broadcast.remote(host, port, i + 1, size, self.timeout_s, backend)
                for i, a in enumerate(self.actors)]
        # cpu: gloo's side of the learner is host memory; nccl's is the learner's GPU
        gpu = backend == "nccl" and torch.cuda.is_available()  # else the group names the mismatch
        device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
        self.sender = BroadcastSender(BroadcastGroup(host, port, 0, size, self.timeout_s, backend, device))
        self.wait(refs, "joining the broadcast group")

    def wait(self, refs: list, what: str) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkersError(f"rollout workers did not finish {what} within {self.timeout_s:g} s") from None

    def load(self, snapshot: Snapshot) -> None:
        """Every worker loads `snapshot` (each checks its checksum); by broadcast, all at once."""
        refs = [a.load.remote(snapshot) for a in self.actors]
        if self.sender is not None:
            self.sender.send()
        self.wait(refs, f"loading policy version {snapshot.version}")

    def generate(self, chunks: list[tuple[Sequence[str], Sequence[int]]],
                 workers: Sequence[int] | None = None) -> list[Generated]:
        """Chunk i (prompts, seeds) on worker `workers[i]` (default: i mod count), all at once; the results in
        chunk order."""
        workers = workers if workers is not None else [i % len(self.actors) for i in range(len(chunks))]
        refs = [self.actors[w].generate.remote(p, s) for w, (p, s) in zip(workers, chunks)]
        return self.wait(refs, f"{len(chunks)} rollout chunks")

    def restart(self, worker: int) -> None:
        """A fresh actor in place of worker `worker` (dead, or to be replaced); it has no snapshot loaded."""
        import ray

        ray.kill(self.actors[worker], no_restart=True)
        self.actors[worker] = self.start(worker)

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


class RayBackend:
    """The asynchronous pipeline's backend (dllm_rl/workers/pipeline.py) over a pool's actors: a load and a group
    are actor calls, which an actor runs in the order they were made; a group's result is read after the load
    queued before it, so a snapshot that failed its checksum is named (`ChecksumMismatch`), and a dead actor's
    calls fail as `WorkerDied`. A job's payload is (prompts, seeds)."""

    def __init__(self, pool: WorkerPool):
        self.pool = pool
        self.size = len(pool.actors)
        self.last_load: list[Any] = [None] * self.size
        self.load_before: dict[Any, Any] = {}  # group handle -> the load call queued before it

    def load(self, worker: int, snapshot: Snapshot) -> None:
        self.last_load[worker] = self.pool.actors[worker].load.remote(snapshot)

    def submit(self, worker: int, job) -> Any:
        prompts, seeds = job.payload
        handle = self.pool.actors[worker].generate.remote(prompts, seeds)
        self.load_before[handle] = self.last_load[worker]
        return handle

    def wait(self, handles: list, timeout_s: float) -> list:
        import ray

        ready, _ = ray.wait(handles, num_returns=1, timeout=timeout_s)
        if not ready:
            return []
        return ray.wait(handles, num_returns=len(handles), timeout=0)[0]

    def result(self, handle: Any) -> Generated:
        import ray

        load = self.load_before.pop(handle, None)
        try:
            if load is not None:
                ray.get(load)
            return ray.get(handle)
        except ray.exceptions.RayActorError as error:
            raise WorkerDied(f"a rollout worker died: {type(error).__name__}") from None

    def restart(self, worker: int) -> None:
        self.pool.restart(worker)
        self.last_load[worker] = None
