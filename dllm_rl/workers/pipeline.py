"""The asynchronous rollout pipeline: keeps rollout workers busy under bounded staleness and hands the learner each
step's groups (ECHO-2's overlap of generation and training), over any backend that can queue work on workers.

The learner drives it from one thread: `publish(snapshot)` after an update, `take(step)` before the next (or
`stream(step)`, each of the step's groups as it finishes: complete-group pipelining). `take`
starts as many groups as `Admission` allows (each on the least busy worker, after a load of the newest snapshot
where that worker's queue does not hold it yet), then waits for finished groups until the step's B groups, in start
order, are in. Work queued on a worker runs in order, so a group's version is the snapshot last queued on its
worker before it: stamped when it is started, never when it finishes. The workers keep generating what was
queued while the learner trains: that is the overlap. At S = 0 only the step's own groups can start, after its
snapshot: the synchronous loop.

A group whose worker fails (raises, or dies: its queued groups fail with it) is started again from the front of
the queue, with the same seeds, up to `Admission.max_failures` tries in all; a dead worker is restarted and loads the
newest snapshot before its next group. Every wait is bounded by `timeout_s`, then a named `WorkersError`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from dllm_rl.workers.admission import Admission, Taken, Ticket
from dllm_rl.workers.errors import WorkerDied, WorkersError
from dllm_rl.workers.versions import ChecksumMismatch, Snapshot


@dataclass(frozen=True)
class Job:
    """One group to generate: its key (the prompt id), the step it was drawn for (its seeds use it), and what a
    worker needs to generate it."""

    key: int
    drawn_step: int
    payload: Any


class Backend(Protocol):
    """Workers that run queued calls in order: `load` and `submit` queue and return at once."""

    size: int

    def load(self, worker: int, snapshot: Snapshot) -> None: ...

    def submit(self, worker: int, job: Job) -> Any: ...  # a handle

    def wait(self, handles: list, timeout_s: float) -> list: ...  # the finished ones (at least one), or [] at timeout

    def result(self, handle: Any) -> Any: ...  # the group's result, or raises (WorkerDied where the worker died)

    def restart(self, worker: int) -> None: ...


@dataclass
class Running:
    worker: int
    ticket: Ticket
    job: Job
    load: int = 0  # which of its worker's loads the group runs after (`Pipeline.loads`)


@dataclass
class Pipeline:
    backend: Backend
    admission: Admission
    draw: Callable[[], list[Job]]  # the next step's groups, in order (called when the queue runs dry)
    timeout_s: float = 600.0
    sync_every: int = 1  # the learner publishes a snapshot every this many updates
    queue_steps: int = 2  # groups started on the workers and not finished: at most this many steps' (B each)
    snapshot: Snapshot | None = None
    pending: deque = field(default_factory=deque)  # drawn or to regenerate, not started
    running: dict[Any, Running] = field(default_factory=dict)  # handle -> what it runs
    finished: dict[int, tuple[Job, Any]] = field(default_factory=dict)  # ticket index -> (job, result)
    queued_version: list[int | None] = field(default_factory=list)  # per worker: the last snapshot queued on it
    loads: list[int] = field(default_factory=list)  # per worker: how many loads were queued on it
    counters: dict[str, int] = field(default_factory=lambda: {"regenerated": 0, "restarts": 0})

    def __post_init__(self) -> None:
        self.queued_version = [None] * self.backend.size
        self.loads = [0] * self.backend.size

    def publish(self, snapshot: Snapshot) -> None:
        """The newest snapshot: workers load it before the next group each of them starts."""
        self.snapshot = snapshot

    def take(self, step: int) -> tuple[list[tuple[Job, Any]], Taken]:
        """The learner's step `step` (its version: `step` updates made): its B groups and their results, in
        prompt (key) order."""
        self.check_published(step)
        while True:
            self.fill()
            if self.admission.can_take():
                break
            self.wait(step)
        taken = self.admission.take(step)
        # within the step, in prompt order (a regenerated group started later than its neighbours)
        order = sorted(range(len(taken.tickets)), key=lambda i: taken.tickets[i].key)
        taken = Taken(step, [taken.tickets[i] for i in order], [taken.lags[i] for i in order])
        return [self.finished.pop(t.index) for t in taken.tickets], taken

    def stream(self, step: int) -> Iterator[tuple[Job, Any, int]]:
        """Complete-group pipelining: the groups of step `step`, each as soon as it has finished (in the order
        they finish), with its lag; the same B groups as `take`. Between two groups the learner trains on the
        first while the workers go on generating."""
        self.check_published(step)
        remaining = self.admission.batch
        while remaining:
            self.fill()
            taken = self.admission.take_finished(step, remaining)
            for ticket, lag in zip(taken.tickets, taken.lags):
                remaining -= 1
                yield (*self.finished.pop(ticket.index), lag)
            if remaining and not taken.tickets:
                self.wait(step)

    def check_published(self, step: int) -> None:
        """The newest snapshot is at most `sync_every` - 1 updates old at step `step`."""
        if self.snapshot is None or not step - self.sync_every < self.snapshot.step <= step:
            raise WorkersError(f"step {step}: the learner's snapshot of this step was not published (the newest is "
                               f"of step {None if self.snapshot is None else self.snapshot.step}, and a snapshot is "
                               f"published every {self.sync_every} update(s)); staleness is counted in updates")

    def wait(self, step: int) -> None:
        """Wait for at least one running group to finish (bounded by `timeout_s`), and collect what finished."""
        done = self.backend.wait(list(self.running), self.timeout_s)
        if not done:
            raise WorkersError(f"step {step}: no rollout group finished within {self.timeout_s:g} s "
                               f"({len(self.running)} running on {self.backend.size} workers)")
        for handle in done:
            if handle in self.running:  # not already failed with its dead worker's queue
                self.collect(handle)

    def fill(self) -> None:
        """Start groups while admission allows, each on the worker with the fewest queued. The admission bound
        is counted from the newest snapshot's update count (the version the groups are generated from), so with a
        snapshot every `sync_every` updates no group lags more than S either; the learner's next groups can then
        start only if S >= sync_every - 1 (the config requires it). What the workers hold unfinished is bounded
        too, by `queue_steps` steps' groups: enough to keep every worker busy while the learner trains, so a large
        S lets finished groups wait for the learner (up to S steps) but never queues (S + 1) B groups at once (at
        S = 10^6 that would be a loop that starts groups forever before the first step)."""
        while self.admission.free(self.snapshot.step) > 0 and len(self.running) < self.queue_steps * self.admission.batch:
            if not self.pending:
                self.pending.extend(self.draw())
            job = self.pending.popleft()
            worker = min(range(self.backend.size), key=lambda w: (self.queued_on(w), w))
            if self.queued_version[worker] != self.snapshot.version:
                self.backend.load(worker, self.snapshot)
                self.queued_version[worker] = self.snapshot.version
                self.loads[worker] += 1
            ticket = self.admission.start(job.key, self.snapshot.step)
            self.running[self.backend.submit(worker, job)] = Running(worker, ticket, job, self.loads[worker])

    def queued_on(self, worker: int) -> int:
        return sum(r.worker == worker for r in self.running.values())

    def collect(self, handle: Any) -> None:
        """A finished handle: accepted with its result, or failed and queued again (front), its slot released."""
        run = self.running.pop(handle)
        try:
            result = self.backend.result(handle)
        except WorkerDied:
            self.lost_worker(run)
            return
        except (WorkersError, ChecksumMismatch):
            raise  # not a group's failure: the run cannot go on as it is
        except Exception:  # the group failed on a live worker: try it again
            self.admission.finish(run.ticket, "failed")
            self.regenerate([run.job])
            # the error may be the load queued before the group (a snapshot not fetched): load it again before the
            # worker's next group (once: not for the other groups queued after that load), or every later group
            # there would read the same failed load
            if run.load == self.loads[run.worker]:
                self.queued_version[run.worker] = None
            return
        made = getattr(result, "step", run.ticket.version)
        if made != run.ticket.version:
            raise WorkersError(f"group {run.job.key!r} was started at policy step {run.ticket.version} but generated "
                               f"from step {made}: a worker did not load the snapshot queued for it")
        self.admission.finish(run.ticket, "accepted")
        self.finished[run.ticket.index] = (run.job, result)

    def lost_worker(self, run: Running) -> None:
        """A worker died: every group queued on it failed (started again, in their order); it restarts once."""
        lost = [run] + [self.running.pop(h) for h, r in list(self.running.items()) if r.worker == run.worker]
        lost.sort(key=lambda r: r.ticket.index)
        for r in lost:
            self.admission.finish(r.ticket, "failed")
        self.regenerate([r.job for r in lost])
        self.backend.restart(run.worker)
        self.queued_version[run.worker] = None
        self.counters["restarts"] += 1

    def regenerate(self, jobs: list[Job]) -> None:
        """`jobs` at the front of the queue, in their order."""
        self.counters["regenerated"] += len(jobs)
        self.pending.extendleft(reversed(jobs))

    def close(self) -> list[Job]:
        """Stop: every running group cancelled; the jobs not trained on (running, finished, pending), in order."""
        cancelled = {t.index for t in self.admission.cancel_all()}
        left = sorted([(r.ticket.index, r.job) for r in self.running.values() if r.ticket.index in cancelled]
                      + [(i, job) for i, (job, _) in self.finished.items()], key=lambda x: x[0])
        self.running.clear()
        self.finished.clear()
        return [job for _, job in left] + list(self.pending)
