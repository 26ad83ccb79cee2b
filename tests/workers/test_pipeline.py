"""The asynchronous rollout pipeline (dllm_rl/workers/pipeline.py) over simulated workers with a virtual clock:
S = 0 is the synchronous loop; at S > 0 every lag stays in [0, S] and reaches S; every prompt is trained on exactly
once and in order, through failed groups, a killed worker and its restart; what cannot go on is named."""

from dataclasses import dataclass

import pytest

from dllm_rl.workers.admission import Admission, AdmissionError
from dllm_rl.workers.errors import WorkerDied
from dllm_rl.workers.pipeline import Job, Pipeline
from dllm_rl.workers.ray_pool import WorkersError
from dllm_rl.workers.versions import ChecksumMismatch, Snapshot


@dataclass
class Made:
    key: int
    step: int  # the snapshot step the worker had loaded


class SimulatedWorkers:
    """Workers that run their queue in order on a virtual clock: a load takes `load_t`, a group `duration(w, job)`;
    the clock moves in `wait` (to the next finish) and `advance` (the learner training). `kill_at` = (time,
    worker): everything queued on it that finishes later is lost (WorkerDied)."""

    def __init__(self, size, duration, load_t=0.5, kill_at=None, failing=(), restart_t=2.0):
        self.size, self.duration, self.load_t, self.kill_at = size, duration, load_t, kill_at
        self.failing, self.restart_t = set(failing), restart_t
        self.clock, self.free_at, self.loaded = 0.0, [0.0] * size, [None] * size
        self.items, self.next_handle, self.submitted = {}, 0, []

    def _queue(self, worker, seconds):
        self.free_at[worker] = max(self.clock, self.free_at[worker]) + seconds
        return self.free_at[worker]

    def load(self, worker, snapshot):
        self._queue(worker, self.load_t)
        self.loaded[worker] = snapshot

    def submit(self, worker, job):
        self.next_handle += 1
        finish = self._queue(worker, self.duration(worker, job))
        self.items[self.next_handle] = (worker, job, finish, self.loaded[worker])
        self.submitted.append(job.key)
        return self.next_handle

    def wait(self, handles, timeout_s):
        first = min(self.items[h][2] for h in handles)
        if first > self.clock + timeout_s:
            self.clock += timeout_s
            return []
        self.clock = max(self.clock, first)
        dead = self.kill_at is not None and self.clock > self.kill_at[0]
        # as Ray does: every call of a dead worker is ready (failed) at once
        return [h for h in handles if self.items[h][2] <= self.clock or (dead and self.items[h][0] == self.kill_at[1])]

    def result(self, handle):
        worker, job, finish, snapshot = self.items.pop(handle)
        if self.kill_at is not None and worker == self.kill_at[1] and finish > self.kill_at[0]:
            raise WorkerDied(f"worker {worker} died")
        if job.key in self.failing:
            raise ValueError(f"group {job.key} always fails")
        return Made(job.key, snapshot.step)

    def restart(self, worker):
        if self.kill_at is not None and worker == self.kill_at[1]:
            self.kill_at = None  # the new process lives
        self.free_at[worker] = self.clock + self.restart_t
        self.loaded[worker] = None

    def advance(self, seconds):
        self.clock += seconds


def drawer(batch):
    """Each call: the next step's `batch` prompts (keys 0, 1, 2, ...)."""
    state = {"next": 0, "step": 0}

    def draw():
        jobs = [Job(state["next"] + i, state["step"], None) for i in range(batch)]
        state["next"] += batch
        state["step"] += 1
        return jobs

    return draw


def run(workers, S, steps, batch=4, train_t=3.0, max_failures=3, queue_steps=2):
    """The learner's loop: publish, take, train; returns the taken keys and lags per step, and the pipeline."""
    pipe = Pipeline(workers, Admission(batch, S, max_failures=max_failures), drawer(batch), timeout_s=100.0,
                    queue_steps=queue_steps)
    keys, lags = [], []
    for step in range(steps):
        pipe.publish(Snapshot(step + 1, step, ref=None, checksum="c"))
        groups, taken = pipe.take(step)
        assert [made.key for _, made in groups] == [job.key for job, _ in groups]
        assert [made.step for _, made in groups] == [t.version for t in taken.tickets]
        keys.append([job.key for job, _ in groups])
        lags.append(taken.lags)
        workers.advance(train_t)
    return keys, lags, pipe


def test_a_huge_s_queues_only_what_keeps_the_workers_busy_and_steps_at_once():
    """S = 10^6 admits (S + 1) B groups; the workers are handed at most `queue_steps` B unfinished at a time, so the
    first step comes after its own groups, not after a loop that starts groups forever; lags stay small."""
    workers = SimulatedWorkers(2, duration=lambda w, job: 1.0)
    keys, lags, pipe = run(workers, S=10**6, steps=4)
    assert [k for step in keys for k in step] == list(range(16))
    # the steps' own groups, the queue, and what the 2 workers finish beyond the 4 a step takes (6 per 3 s step)
    assert len(workers.submitted) <= 16 + 2 * 4 + 2 * 4 and max(lag for step in lags for lag in step) <= 2


def test_s0_is_the_synchronous_loop():
    workers = SimulatedWorkers(2, duration=lambda w, job: 1.0 + (job.key % 3))
    keys, lags, pipe = run(workers, S=0, steps=5)
    assert keys == [[4 * s + i for i in range(4)] for s in range(5)]
    assert all(lag == 0 for step in lags for lag in step)
    assert workers.submitted == list(range(20))  # nothing started ahead of its step


@pytest.mark.parametrize("S", [1, 2, 4])
def test_lags_stay_within_s_and_reach_it_while_every_prompt_is_trained_once_in_order(S):
    workers = SimulatedWorkers(3, duration=lambda w, job: 0.5 + (job.key * 7 % 5) * (1 + 2 * (w == 0)))
    keys, lags, pipe = run(workers, S=S, steps=12, train_t=6.0)
    flat = [lag for step in lags for lag in step]
    assert all(0 <= lag <= S for lag in flat) and max(flat) == S
    assert [k for step in keys for k in step] == list(range(48))
    assert pipe.admission.violations == 0


def test_a_killed_worker_loses_its_queue_which_is_regenerated_and_it_restarts():
    workers = SimulatedWorkers(2, duration=lambda w, job: 1.0, kill_at=(5.0, 1))
    keys, lags, pipe = run(workers, S=2, steps=6, queue_steps=3)  # all that S allows queued: the next steps' too
    assert sorted(k for step in keys for k in step) == list(range(24))  # each prompt once
    assert all(step == sorted(step) for step in keys)  # in prompt order within a step
    assert keys != [list(range(4 * s, 4 * s + 4)) for s in range(6)]  # a regenerated group moved to a later step
    assert pipe.counters["restarts"] == 1 and pipe.counters["regenerated"] >= 1
    assert all(0 <= lag <= 2 for step in lags for lag in step)
    assert pipe.admission.outcomes["failed"] == pipe.counters["regenerated"]


def test_at_s0_a_killed_worker_changes_nothing_but_the_time():
    plain = run(SimulatedWorkers(2, duration=lambda w, job: 1.0), S=0, steps=5)[0]
    killed, _, pipe = run(SimulatedWorkers(2, duration=lambda w, job: 1.0, kill_at=(2.5, 0)), S=0, steps=5)
    assert killed == plain and pipe.counters["restarts"] == 1


def test_a_group_that_always_fails_stops_the_run_by_name():
    workers = SimulatedWorkers(2, duration=lambda w, job: 1.0, failing={5})
    with pytest.raises(AdmissionError, match=r"group 5 failed 3 times"):
        run(workers, S=1, steps=4)


class FailedLoad(SimulatedWorkers):
    """The first load fails on a live worker (a snapshot not fetched, say): as with Ray, every group queued after it
    on that worker raises the load's error, until another load is queued there."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loads, self.broken = 0, set()

    def load(self, worker, snapshot):
        super().load(worker, snapshot)
        self.loads += 1
        (self.broken.add if self.loads == 1 else self.broken.discard)(worker)

    def submit(self, worker, job):
        handle = super().submit(worker, job)
        self.items[handle] += (worker in self.broken,)
        return handle

    def result(self, handle):
        worker, job, _, snapshot, broken = self.items.pop(handle)
        if broken:
            raise ValueError("the snapshot's object could not be fetched")
        return Made(job.key, snapshot.step)


def test_a_failed_load_is_queued_again_before_the_workers_next_group():
    workers = FailedLoad(1, duration=lambda w, job: 1.0)
    keys, _, pipe = run(workers, S=0, steps=3)
    assert keys == [[4 * s + i for i in range(4)] for s in range(3)]
    # the failed load and its groups; the load again, once, before them; one load for each later step
    assert pipe.counters["regenerated"] == 4 and workers.loads == 4


def test_workers_that_never_finish_are_a_named_timeout():
    workers = SimulatedWorkers(2, duration=lambda w, job: 1e9)
    with pytest.raises(WorkersError, match=r"step 0: no rollout group finished within 100 s \(4 running on 2"):
        run(workers, S=0, steps=1)


def test_a_worker_that_loaded_another_snapshot_or_a_corrupt_one_is_named():
    class Stale(SimulatedWorkers):
        def result(self, handle):
            made = super().result(handle)
            return Made(made.key, made.step - 1)

    with pytest.raises(WorkersError, match="did not load the snapshot queued for it"):
        run(Stale(1, duration=lambda w, job: 1.0), S=0, steps=2)

    class Corrupt(SimulatedWorkers):
        def result(self, handle):
            raise ChecksumMismatch("policy version 1 (step 0): the loaded weights have checksum x")

    with pytest.raises(ChecksumMismatch):
        run(Corrupt(1, duration=lambda w, job: 1.0), S=0, steps=1)


def test_a_step_without_its_snapshot_is_named():
    pipe = Pipeline(SimulatedWorkers(1, duration=lambda w, job: 1.0), Admission(2, 1), drawer(2))
    with pytest.raises(WorkersError, match="step 0: the learner's snapshot of this step was not published"):
        pipe.take(0)
    pipe.publish(Snapshot(1, 0, ref=None, checksum="c"))
    pipe.take(0)
    with pytest.raises(WorkersError, match=r"step 1: .* \(the newest is of step 0, and a snapshot is published ev"):
        pipe.take(1)


def test_close_cancels_and_returns_the_untrained_groups_in_order():
    workers = SimulatedWorkers(2, duration=lambda w, job: 1.0 + job.key % 2)
    keys, _, pipe = run(workers, S=2, steps=2)
    left = pipe.close()
    assert [job.key for job in left] == list(range(8, 8 + len(left))) and len(left) >= 8
    assert not pipe.admission.running and pipe.admission.free(2) > 0


def run_streamed(workers, S, steps, batch=4, train_t=3.0):
    """The pipelined learner's loop: publish, then train on each group as it arrives (train_t / batch each)."""
    pipe = Pipeline(workers, Admission(batch, S), drawer(batch), timeout_s=100.0)
    keys, lags, arrivals = [], [], []
    for step in range(steps):
        pipe.publish(Snapshot(step + 1, step, ref=None, checksum="c"))
        got = []
        for job, made, lag in pipe.stream(step):
            assert made.key == job.key and made.step == step - lag
            got.append((job.key, lag))
            arrivals.append((step, workers.clock))
            workers.advance(train_t / batch)
        keys.append(sorted(k for k, _ in got))
        lags.append([lag for _, lag in got])
    return keys, lags, arrivals, pipe


@pytest.mark.parametrize("S", [0, 1, 2])
def test_streamed_groups_are_the_groups_take_gives_and_the_same_work_ends_sooner(S):
    duration = lambda w, job: 0.5 + (job.key * 7 % 5) * (1 + 2 * (w == 0))  # noqa: E731
    whole, streamed = SimulatedWorkers(3, duration), SimulatedWorkers(3, duration)
    taken_keys, taken_lags, _ = run(whole, S=S, steps=8)
    keys, lags, arrivals, pipe = run_streamed(streamed, S=S, steps=8)
    assert keys == [sorted(k) for k in taken_keys]
    assert all(0 <= lag <= S for step in lags for lag in step) and pipe.admission.violations == 0
    # the learner trains on a step's first groups while its last is still generating: the same work ends sooner
    assert streamed.clock < whole.clock if S == 0 else streamed.clock <= whole.clock


def test_a_killed_worker_mid_stream_regenerates_its_groups_and_each_prompt_is_trained_once():
    keys, lags, _, pipe = run_streamed(SimulatedWorkers(2, duration=lambda w, job: 1.0, kill_at=(2.5, 0)),
                                       S=0, steps=5)
    assert keys == [list(range(4 * s, 4 * s + 4)) for s in range(5)]
    assert pipe.counters["restarts"] == 1 and pipe.counters["regenerated"] >= 1


@pytest.mark.parametrize("sync_every,S", [(2, 1), (3, 2), (2, 3)])
def test_a_snapshot_every_few_updates_keeps_lags_within_s_and_every_prompt_once(sync_every, S):
    """The learner publishes at steps 0, k, 2k, ...: groups come from the newest snapshot, the admission bound
    counts from its update count, so lags stay within S (reached) with S >= k - 1, and nothing deadlocks."""
    workers = SimulatedWorkers(2, duration=lambda w, job: 0.5 + (job.key % 3))
    pipe = Pipeline(workers, Admission(4, S), drawer(4), timeout_s=100.0, sync_every=sync_every)
    keys, lags, loaded = [], [], []
    for step in range(9):
        if step % sync_every == 0:
            pipe.publish(Snapshot(step // sync_every + 1, step, ref=None, checksum="c"))
        groups, taken = pipe.take(step)
        keys += [job.key for job, _ in groups]
        lags += taken.lags
        loaded += [made.step for _, made in groups]
        workers.advance(3.0)
    assert sorted(keys) == list(range(36)) and pipe.admission.violations == 0
    assert all(0 <= lag <= S for lag in lags) and max(lags) == S
    assert set(loaded) <= {0, sync_every, 2 * sync_every, 3 * sync_every, 4 * sync_every}


def test_a_snapshot_older_than_sync_every_allows_is_named():
    pipe = Pipeline(SimulatedWorkers(1, duration=lambda w, job: 1.0), Admission(2, 1), drawer(2), sync_every=2)
    pipe.publish(Snapshot(1, 0, ref=None, checksum="c"))
    pipe.take(0)
    pipe.take(1)  # one update after the snapshot: within sync_every
    with pytest.raises(WorkersError, match=r"step 2: .*newest is of step 0, and a snapshot is published every 2"):
        pipe.take(2)
