"""What every curation strategy shares: the hooks (`Strategy`), the groups they learn from (`GroupRecord`).

`Curation` (dllm_rl/curation/strategies.py) is what the step talks to; each strategy implements the hooks it needs:
- `allocate(step, drawn, counts)`: rollouts per drawn prompt (0 = none), before generating; the same on every
  rank (a function of the drawn prompts, the state and seeds);
- `select(batch)`: this rank's freshly generated rows (whole groups), before verifying: rows to keep, weights;
- `reweight(batch)`: this rank's rows (whole groups) once their advantages are set: advantages, loss weights,
  auxiliary SFT rows (`StepBatch.auxiliary`), the picks of replayed rows (which the replay stage makes,
  dllm_rl/curation/replay.py);
- `annotate(records)`: this rank's groups of the step, with what the strategy noted about them in its own state
  (DARTS: whether its extra rollouts changed the kept set), before they are gathered;
- `observe(records)`: every rank's groups of the step (`GroupRecord`, gathered, in prompt id order);
- `after_update(batch)`: after the step's update (the bandit's feedback and replay buffer);
- `state_dict()` / `load_state_dict()`: plain values, saved with every checkpoint.
Dynamic sampling is not a hook of one batch but the loop around them (`more`, `finish`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from dllm_rl.errors import check_kwargs, check_types


@dataclass
class GroupRecord:
    """One prompt's group of a step, as every rank learns about it (plain data)."""

    prompt_id: int
    example_id: int
    rewards: list[float]
    correct: list[bool]
    external: int = 0  # kept external rows of the prompt (ERILS)
    changed: bool = False  # DARTS: the extra rollouts changed the kept set


def config_of(cls, options: dict[str, Any], name: str):
    check_kwargs(cls, options, f"curation.{name}")
    check_types(cls, options, f"curation.{name}")
    return cls(**options)


class Strategy:
    name = ""
    config_class: Any = None

    @classmethod
    def check(cls, options: dict[str, Any]):
        return config_of(cls.config_class, options, cls.name)

    @classmethod
    def build(cls, options: dict[str, Any], **context) -> Strategy:
        """The strategy from its options and the run's context (group_size, seed, pool_size, external, task,
        tokenizer), of which it takes what its `__init__` names."""
        wanted = inspect.signature(cls.__init__).parameters
        return cls(cls.check(options), **{k: v for k, v in context.items() if k in wanted})

    def allocate(self, step: int, drawn: list, counts: list[int]) -> list[int]:
        return counts

    def select(self, batch) -> None:
        pass

    def reweight(self, batch) -> None:
        pass

    def annotate(self, records: list[GroupRecord]) -> list[GroupRecord]:
        return records

    def observe(self, records: list[GroupRecord]) -> None:
        pass

    def after_update(self, batch) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def epoch_of(prompt_id: int, pool_size: int) -> int:
    return prompt_id // pool_size


