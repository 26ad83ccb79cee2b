"""The rollout workers' errors: both named, neither a hang."""

from __future__ import annotations

from dllm_rl.errors import RunStopped


class WorkersError(RunStopped):
    """Ray did not start, or the rollout workers cannot go on (all gone, timed out): named, never a hang."""


class WorkerDied(RuntimeError):
    """A backend's failure of a worker process (not of one group): its queued work is lost, it must restart."""
