"""Bounded staleness by admission: which prompt groups may start generating, and which finished groups each learner
step takes (ECHO-2's bound S, AReaL's admission rule), as plain Python with no Ray and no torch.

The learner at policy version v (it has made v updates; its next step is step v) takes `batch` (B) groups a step.
A group may **start** only while

    accepted + running < (S + v + 1) * B

where `accepted` counts every group ever accepted (taken by the learner or waiting for it) and `running` the groups
started and not yet finished. Every finished group leaves `running` exactly once, by one of four outcomes:
accepted (its rows go to the learner), filtered (a curation filter dropped it), failed (a worker died or raised; the
caller regenerates it from its seed as a new start) or cancelled (the run is stopping). The three that are not
"accepted" release the admission slot; a ticket finished twice is an error, since a slot released twice would
admit more than the bound allows and one never released deadlocks the pipeline.

The learner's step k takes the first B accepted groups **in start order**, and waits while an earlier-started
group is still running. With that order every taken group satisfies 0 <= k - version <= S, where version is the
policy version the group started from: versions grow with start order; a group started at version v had fewer
than (S + v + 1) * B accepted-or-running groups before it, so at most (S + v + 1) * B accepted groups start at
version v or earlier, and they are all taken by the end of step S + v. Consequences: S = 0 is the synchronous
loop (a step's groups start only after the previous update); taking groups as they finish, out of start order,
would let a slow group fall behind without bound, so the head of the queue is waited for. The learner still
checks the bound for every group it takes and counts violations (expected 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("accepted", "filtered", "failed", "cancelled")


class AdmissionError(RuntimeError):
    """A ticket used out of its life cycle (finished twice, unknown), or a group that cannot be admitted."""


@dataclass(frozen=True)
class Ticket:
    """One started generation of a group: the order it started in, and the policy version it started from."""

    index: int  # start order over the run, from 0 (a regenerated group gets a new ticket)
    key: Any  # what the caller generates: a prompt id, (prompt id, attempt), ...
    version: int  # the policy version the worker generated from (stamped at the start, never at the end)


@dataclass
class Taken:
    """The groups of one learner step, each with its staleness `step - version`."""

    step: int
    tickets: list[Ticket]
    lags: list[int]

    @property
    def lag_max(self) -> int:
        return max(self.lags, default=0)

    @property
    def lag_mean(self) -> float:
        return sum(self.lags) / len(self.lags) if self.lags else 0.0


@dataclass
class Admission:
    """The admission controller and the queue of finished groups between rollout workers and the learner."""

    batch: int  # B: groups per learner step
    max_staleness: int  # S: how many policy versions a group may lag the step that trains on it
    max_failures: int = 3  # a key whose generation failed this often is not started again (a named error)
    started: int = 0  # tickets issued (the next ticket's index)
    accepted: int = 0  # groups accepted over the run (taken or waiting)
    taken: int = 0  # groups handed to the learner
    violations: int = 0  # taken groups with a lag outside [0, S] (expected 0)
    outcomes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    running: dict[int, Ticket] = field(default_factory=dict)  # ticket index -> ticket
    ready: dict[int, Ticket] = field(default_factory=dict)  # accepted, not yet taken: ticket index -> ticket
    failures: dict[Any, int] = field(default_factory=dict)  # key -> failed generations

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"batch={self.batch}: a learner step takes at least 1 group")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: expected an integer >= 0 (0 = synchronous)")

    # ---------------------------------------------------------------------------------------------- start

    def limit(self, version: int) -> int:
        """How many groups may be accepted or running while the learner is at `version`."""
        return (self.max_staleness + version + 1) * self.batch

    def free(self, version: int) -> int:
        """How many more groups may start now."""
        return max(0, self.limit(version) - self.accepted - len(self.running))

    def start(self, key: Any, version: int) -> Ticket:
        """A ticket for generating `key` from policy `version` (the version the worker has loaded)."""
        if self.failures.get(key, 0) >= self.max_failures:
            raise AdmissionError(f"group {key!r} failed {self.failures[key]} times (max_failures="
                                 f"{self.max_failures}); not started again")
        if self.free(version) < 1:
            raise AdmissionError(f"no admission slot at version {version}: {self.accepted} accepted + "
                                 f"{len(self.running)} running >= (S + v + 1) * B = {self.limit(version)}")
        ticket = Ticket(self.started, key, version)
        self.started += 1
        self.running[ticket.index] = ticket
        return ticket

    # ---------------------------------------------------------------------------------------------- finish

    def finish(self, ticket: Ticket, outcome: str) -> None:
        """The end of a started generation: exactly once per ticket, whatever happened to it."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome={outcome!r}: expected one of {OUTCOMES}")
        if self.running.pop(ticket.index, None) is None:
            raise AdmissionError(f"ticket {ticket.index} ({ticket.key!r}) finished twice or never started")
        self.outcomes[outcome] += 1
        if outcome == "failed":
            self.failures[ticket.key] = self.failures.get(ticket.key, 0) + 1
        if outcome == "accepted":
            self.accepted += 1
            self.ready[ticket.index] = ticket

    def cancel_all(self) -> list[Ticket]:
        """Stop: every running ticket cancelled (their slots released); the tickets, for regeneration later."""
        cancelled = list(self.running.values())
        for ticket in cancelled:
            self.finish(ticket, "cancelled")
        return cancelled

    # ---------------------------------------------------------------------------------------------- take

    def can_take(self) -> bool:
        """Whether the next B groups in start order are all finished: B accepted ones, no running one before them."""
        head = sorted(self.ready)[:self.batch]
        if len(head) < self.batch:
            return False
        return not self.running or min(self.running) > head[-1]

    def take(self, step: int) -> Taken:
        """The learner's step `step`: its B groups, each group's lag checked against [0, S]."""
        if not self.can_take():
            raise AdmissionError(f"step {step}: {len(self.ready)} groups ready of {self.batch}, "
                                 f"{len(self.running)} running (wait for them: can_take)")
        tickets = [self.ready.pop(i) for i in sorted(self.ready)[:self.batch]]
        lags = [step - t.version for t in tickets]
        self.violations += sum(not 0 <= lag <= self.max_staleness for lag in lags)
        self.taken += len(tickets)
        return Taken(step, tickets, lags)

    def take_finished(self, step: int, remaining: int) -> Taken:
        """Complete-group pipelining (RolloutPipe): the finished groups of step `step` that it may train on now,
        `remaining` of its B groups not yet handed out. The step's groups are the first `remaining` accepted or
        running ones in start order; a finished one among them stays among them (later starts come after it, and
        an earlier one only leaves by failing), so it is handed out at once, before the groups started ahead of it.
        Handing out the whole step this way gives the same groups as `take`."""
        head = sorted([*self.ready, *self.running])[:remaining]
        tickets = [self.ready.pop(i) for i in head if i in self.ready]
        lags = [step - t.version for t in tickets]
        self.violations += sum(not 0 <= lag <= self.max_staleness for lag in lags)
        self.taken += len(tickets)
        return Taken(step, tickets, lags)

    # ---------------------------------------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint after a step keeps: the counts. Groups running or waiting are not kept: a resumed
        run regenerates them from their seeds (exact at S = 0, where none is in flight between steps)."""
        return {"batch": self.batch, "max_staleness": self.max_staleness, "taken": self.taken,
                "violations": self.violations}

    @classmethod
    def resumed(cls, state: dict[str, int], batch: int, max_staleness: int) -> Admission:
        """The controller after a resume: the groups taken so far count as accepted and started; nothing runs."""
        if state["taken"] % batch:
            raise AdmissionError(f"a checkpoint with {state['taken']} groups taken is not at a step boundary of "
                                 f"{batch} groups per step")
        return cls(batch, max_staleness, started=state["taken"], accepted=state["taken"], taken=state["taken"],
                   violations=state["violations"])
