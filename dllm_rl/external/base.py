"""What every external source returns, and the protocol it follows (the sources are in `sources.py` and
`served.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from dllm_rl.data.task import Example, Task


@dataclass(frozen=True)
class ExternalRollout:
    """One external completion of the step's prompt number `prompt_index`. `behaviour_logp` is log mu(text | x),
    where the source knows it; `token_logps`, where the source gives per-token values, holds each of its tokens as
    (the character offset in `text` where the token ends, its log-prob), so a cut text has a log-prob too
    (`prefix_logp`)."""

    prompt_index: int
    text: str
    source: str
    behaviour_logp: float | None = None
    token_logps: tuple[tuple[int, float], ...] | None = None


def token_ends(pieces: Sequence[str]) -> list[int]:
    """The character offset where each of a text's consecutive pieces ends."""
    ends, at = [], 0
    for piece in pieces:
        at += len(piece)
        ends.append(at)
    return ends


def prefix_logp(rollout: ExternalRollout, kept: str) -> float | None:
    """log mu of `kept`, a cut of `rollout.text` (length control's `truncate`): the whole text's log-prob if
    nothing was cut; 0 for a deterministic source (log mu = 0 for the whole text, so for every prefix of it); else
    the sum over the source's tokens that end inside `kept` (a token the cut splits is left out, so the estimate is
    log mu of the longest token prefix, never below log mu(kept): the importance weight is not inflated). None
    when that cannot be known: no per-token values, or `kept` is not a prefix of the text."""
    if kept == rollout.text or rollout.behaviour_logp == 0.0:
        return rollout.behaviour_logp
    if rollout.token_logps is None or not rollout.text.startswith(kept):
        return None
    return sum(logp for end, logp in rollout.token_logps if end <= len(kept))


class ExternalSource(Protocol):
    """A source may also have `step_metrics() -> dict[str, float]`, about its last `rollouts` call (logged as
    external/<key>); `prefetch(task, examples, count, seeds)`, which starts the work of a later `rollouts` call with
    the same arguments (called before the dLLM's own rollouts where the trigger allows); `close()`."""

    name: str

    def rollouts(self, task: Task, examples: Sequence[Example], count: int,
                 seeds: Sequence[Sequence[int]]) -> list[list[ExternalRollout]]:
        """`count` rollouts for each example (seeds[i][j] for rollout j of example i); one list per example."""
        ...
