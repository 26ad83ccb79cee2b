"""Forming the process group, and stopping together: which rank failed, and which never came.

Ranks meet over a key-value store (torch's `TCPStore` at MASTER_ADDR:MASTER_PORT: rank 0 hosts it, or the
launcher's agent does under torchrun). Everything here is bounded by `deepspeed.timeout_s`:

- **Joining.** Every rank checks in; a rank that has not come within the timeout is named ("rank 1 did not
  join"). A rank that cannot reach the store at all says that rank 0, which hosts it, never started.
- **Roll calls.** `RollCall(point)` waits until every rank has reached a point of start-up (its models loaded,
  its run directory checked) before the collectives that follow, so a rank that failed before it is known at
  once instead of after a collective's timeout.
- **Failures.** `stop_together()` wraps a run: a rank that raises posts its error to the store; a peer that
  is waiting at a roll call stops at once, and a peer inside a collective stops when that collective times
  out; either way it says which rank failed and why ("rank 1 failed: model='/x': no such directory"). A
  rank whose own error came after a peer's failure (a collective that timed out because the peer left) reports
  the peer's error, the cause. Rank 0 hosts the store, so when it stops it waits (at most the timeout) until
  every rank has read the news.
- **Peers lost mid-run.** Every rank's `Heartbeat` thread counts up a key of its own in the store. When a
  collective fails (gloo's "Connection reset by peer", or its timeout when a peer is stopped or stuck), the
  survivor looks at whose count stands still (`RollCall.silent`) and the run stops with a sentence naming that
  rank, where it was, and the checkpoint to resume from, instead of the backend's traceback. A peer whose
  store went with it (rank 0 hosts it) is named the same way.

Every process group is made with the timeout too. DeepSpeed creates its own groups with `new_group(ranks)`,
which takes torch's module default (30 minutes), not the default group's timeout; `init_distributed` sets that
default to `timeout_s` for this process (`apply_group_timeout`), the smallest change that bounds them all.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from typing import Callable, Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dllm_rl.errors import Interrupted, RunStopped

POLL_S = (0.01, 0.5)  # first and longest wait between two looks at the store
BEAT_S = 0.5  # between two heartbeats; a peer whose count stands still for SILENT_BEATS of them is lost
SILENT_BEATS = 4


class RankFailed(RunStopped):
    """Another rank failed or never came; this rank stops too (the message names that rank)."""


def apply_group_timeout(timeout: datetime.timedelta) -> None:
    """Make `timeout` the default of every process group created from now on in this process (DeepSpeed's
    `new_group(ranks)` passes none, so torch would use its 30-minute default)."""
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout


def hosts_store(rank: int) -> bool:
    """Whether this rank hosts the rendezvous store (rank 0, unless torchrun's agent does)."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def open_store(rank: int, size: int, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store at MASTER_ADDR:MASTER_PORT: hosted by rank 0, or by torchrun's agent."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosting = hosts_store(rank)
    try:
        return dist.TCPStore(host, port, size, is_master=hosting, timeout=timeout, wait_for_workers=False,
                             multi_tenant=True)
    except (RuntimeError, dist.DistError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        if hosting:
            raise RunStopped(f"rank 0 cannot host the rendezvous at {host}:{port} ({reason}); is MASTER_PORT "
                             f"taken by another run?") from None
        raise RankFailed(f"rank {rank}: no rendezvous at {host}:{port} within deepspeed.timeout_s="
                         f"{timeout.total_seconds():g}s: rank 0, which hosts it, did not start (it failed before "
                         f"joining, or was not launched), or MASTER_ADDR/MASTER_PORT differ between ranks "
                         f"({reason})") from None


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class RollCall:
    """Ranks agreeing, over the store, that each reached a point; or learning which rank failed or never came.

    Keys (under the prefix `dllm_rl/<generation>/`): `<n>/<rank>` and the counter `<n>/count` for the n-th roll call,
    `failed/<rank>` (the error as JSON) and the counter `failed`, and the counter `stopped`. Every rank makes
    the same calls in the same order, so their n agree (a second run in one process continues the count)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout_s: float, generation: int = 0):
        self.store = dist.PrefixStore(f"dllm_rl/{generation}", store)  # one namespace per group formed
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        self.hosting = hosts_store(rank)
        self.calls = 0
        self.heartbeat: Heartbeat | None = None

    def __call__(self, point: str, absent: str = "stopped without a word: killed, out of memory, or busy") -> None:
        """Return when every rank has reached `point`; raise `RankFailed` naming the ranks that failed, or
        that have not come within the timeout (`absent`: what that may mean)."""
        if self.size == 1:
            return
        n, self.calls = self.calls, self.calls + 1
        self.store.set(f"{n}/{self.rank}", point)
        arrived = self.store.add(f"{n}/count", 1)
        deadline, wait = time.monotonic() + self.timeout_s, POLL_S[0]
        while arrived < self.size:
            self.raise_failures()
            if time.monotonic() > deadline:
                missing = [r for r in range(self.size) if not self.store.check([f"{n}/{r}"])]
                self.stopped(expected=self.size - len(missing))  # the missing ones will not say so
                raise RankFailed(f"{ranks(missing)} did not reach {point} within deepspeed.timeout_s="
                                 f"{self.timeout_s:g}s ({absent}); rank {self.rank} stops too")
            time.sleep(wait)
            wait = min(2 * wait, POLL_S[1])
            arrived = self.store.add(f"{n}/count", 0)
        self.raise_failures()

    def failures(self) -> dict[int, str]:
        """The ranks that posted a failure, with their errors."""
        if self.store.add("failed", 0) == 0:
            return {}
        posted = [r for r in range(self.size) if self.store.check([f"failed/{r}"])]
        return {r: json.loads(self.store.get(f"failed/{r}"))["error"] for r in posted}

    def raise_failures(self) -> None:
        failed = {r: e for r, e in self.failures().items() if r != self.rank}
        if failed:
            self.stopped()
            raise RankFailed(describe(failed) + f"; rank {self.rank} stops too")

    def fail(self, error: BaseException) -> RankFailed | None:
        """This rank stops with `error`. Returns the error to raise instead when a peer failed first (this
        rank's own error then most likely follows from it); otherwise posts `error` for the peers."""
        earlier = {r: e for r, e in self.failures().items() if r != self.rank}
        if earlier:
            self.stopped()
            return RankFailed(describe(earlier) + f"; rank {self.rank} stops too ({one_line(error)})")
        self.store.set(f"failed/{self.rank}", json.dumps({"error": one_line(error)}))
        self.store.add("failed", 1)
        self.stopped()
        return None

    def silent(self) -> list[int]:
        """The peers whose heartbeat stands still over SILENT_BEATS beats: killed, stopped or cut off. Takes
        SILENT_BEATS * BEAT_S seconds; raises the store's error when the store is gone."""
        peers = [r for r in range(self.size) if r != self.rank]
        before = {r: self.store.add(f"beat/{r}", 0) for r in peers}
        time.sleep(SILENT_BEATS * BEAT_S)
        after = {r: self.store.add(f"beat/{r}", 0) for r in peers}
        return [r for r in peers if after[r] == before[r]]

    def lost(self, error: BaseException, where: str, resume: str) -> RankFailed | None:
        """After `error` in a collective: `RankFailed` naming the peers that stopped answering (rank 0 when the
        store it hosts is gone too), `where` this rank was, and `resume` (what to do next); None when a peer
        posted its own failure (`stop_together` reports that one) or every peer still answers (the error is
        this rank's own)."""
        if self.size == 1:
            return None
        try:
            if self.failures():
                return None
            silent = self.silent()
            if not silent or self.failures():
                return None
            self.stopped(expected=self.size - len(silent))  # the silent ones will not say so
        except (RuntimeError, dist.DistError):  # the store went with the rank that hosts it
            if self.hosting:
                return None
            silent = [0]
        return RankFailed(f"{ranks(silent)} stopped answering during {where} ({one_line(error)[:200]}); {resume}")

    def stopped(self, expected: int | None = None) -> None:
        """Count this rank as stopped; rank 0, which hosts the store, waits (bounded) until the `expected` ranks
        (all by default) have, so none loses the store before it has read why."""
        count = self.store.add("stopped", 1)
        expected = self.size if expected is None else expected
        deadline, wait = time.monotonic() + self.timeout_s, POLL_S[0]
        while self.hosting and count < expected and time.monotonic() < deadline:
            time.sleep(wait)
            wait = min(2 * wait, POLL_S[1])
            count = self.store.add("stopped", 0)


def ranks(numbers: list[int]) -> str:
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(map(str, numbers))}"


def describe(failed: dict[int, str]) -> str:
    return "; ".join(f"rank {r} failed: {error}" for r, error in sorted(failed.items()))


class Heartbeat:
    """A daemon thread that adds 1 to this rank's `beat/<rank>` key every BEAT_S seconds, over a store connection
    of its own (a store client is not shared between threads); it ends quietly when the store goes."""

    def __init__(self, rank: int, generation: int, timeout: datetime.timedelta):
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        client = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        self.store = dist.PrefixStore(f"dllm_rl/{generation}", client)
        self.key, self.done = f"beat/{rank}", threading.Event()
        self.store.add(self.key, 1)
        self.thread = threading.Thread(target=self.beat, name="dllm_rl-heartbeat", daemon=True)
        self.thread.start()

    def beat(self) -> None:
        while not self.done.wait(BEAT_S):
            try:
                self.store.add(self.key, 1)
            except (RuntimeError, dist.DistError):
                return

    def stop(self) -> None:
        self.done.set()
        self.thread.join(timeout=2 * BEAT_S)


ROLL: RollCall | None = None  # this process's, once it has joined a process group


def roll_call(point: str) -> None:
    """Every rank reaches `point` before any goes on (nothing without a process group of several ranks)."""
    if ROLL is not None:
        ROLL(point)


@contextlib.contextmanager
def peers_answering(where: Callable[[], str], resume: Callable[[], str]) -> Iterator[None]:
    """Around work with collectives: a RuntimeError (what gloo and NCCL raise when a peer is gone or stuck; also as
    the cause of a `RunStopped`, such as a checkpoint that could not be written) that comes with a peer's
    heartbeat standing still becomes `RankFailed` naming that peer, `where()` this rank was, and `resume()`. Any
    other error passes through unchanged."""
    try:
        yield
    except RuntimeError as error:
        cause = error.__cause__ if isinstance(error, RunStopped) else error  # e.g. a checkpoint that could not be
        collective = isinstance(cause, RuntimeError) and not isinstance(cause, RunStopped)  # written: a peer gone?
        lost = ROLL.lost(cause, where(), resume()) if ROLL is not None and collective else None
        if lost is None:
            raise
        raise lost from error


@contextlib.contextmanager
def stop_together() -> Iterator[None]:
    """Around a run: an error here is posted for the other ranks; a peer's earlier failure is raised instead
    of the error it caused here. Ctrl-C is no failure: every rank stops after the same step (the ranks decide
    it together) with its own `Interrupted`, and a second Ctrl-C (KeyboardInterrupt) is each rank's own."""
    try:
        yield
    except Exception as error:
        if ROLL is None or ROLL.size == 1 or isinstance(error, (RankFailed, Interrupted)):
            raise
        try:
            cause = ROLL.fail(error)
        except (RuntimeError, dist.DistError):  # the store is gone: rank 0 stopped already
            raise RankFailed(f"rank {ROLL.rank} stopped with {one_line(error)}; the rendezvous store on rank 0 "
                             f"is gone too, so rank 0 stopped first (see its output)") from error
        if cause is not None:
            raise cause from error
        raise
