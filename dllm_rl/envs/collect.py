"""The stages a multi-turn run puts into the step in place of the single-turn ones: collect (choose environment
seeds, play each group's episodes, one row per turn), the advantages per turn, and the held-out evaluation
(success rate over held-out seeds, greedy). The other stages of dllm_rl/step.py run on the turn rows unchanged."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

from dllm_rl.collect import InProcessRollouts, PromptSource, StepBatch
from dllm_rl.data.task import draw_examples, render_prompt
from dllm_rl.envs.episodes import Episode, episode_advantages, play_episodes
from dllm_rl.envs.task import EnvTask


def episode_metrics(episodes: list[Episode], prefix: str = "env") -> dict[str, float]:
    """Success rate, turns per episode, the share of invalid actions and of truncated episodes."""
    if not episodes:
        return {}
    turns = sum(len(ep.turns) for ep in episodes)
    return {f"{prefix}/success": statistics.fmean(ep.success for ep in episodes),
            f"{prefix}/turns": turns / len(episodes),
            f"{prefix}/invalid": sum(ep.invalid for ep in episodes) / max(turns, 1),
            f"{prefix}/truncated": statistics.fmean(ep.truncated for ep in episodes)}


@dataclass
class CollectEpisodes:
    """The collect stage of a multi-turn run: the step's environment seeds (this rank's whole groups), each played
    `group_size` times from the same seed; `rows["on_policy"]` holds every turn, `episodes` the episodes."""

    prompts: PromptSource
    rollouts: InProcessRollouts
    task: EnvTask
    tokenizer: Any
    group_size: int
    pad_id: int

    def __call__(self, step: int) -> StepBatch:
        drawn = self.prompts(step)
        batch = self.prompts.batch(step, drawn, [self.group_size] * len(drawn))
        starts = [(b, q, ex.meta["seed"]) for b, (q, ex) in enumerate(zip(batch.prompt_ids, batch.examples))]
        with self.rollouts.inference():
            if not starts:
                batch.rows["on_policy"] = self.rollouts.stand_in(batch)
                return batch
            rows, episodes = play_episodes(self.rollouts, self.task.make, starts, self.group_size, step,
                                           self.task.config.history, self.pad_id,
                                           render=lambda text: render_prompt(text, self.tokenizer))
        batch.rows["on_policy"], batch.episodes = rows, episodes
        batch.metrics.update(episode_metrics(episodes))
        return batch


def assign_turn_advantages(batch: StepBatch, advantage: str, task: EnvTask) -> None:
    """adv_N of the turn rows from their episodes (`env.credit`); a rank's stand-in row keeps its 0."""
    on = batch.real("on_policy")
    if on is not None:
        on.adv_N = episode_advantages(on, batch.episodes, task.max_turns, advantage, task.config.credit,
                                      **task.config.credit_options())


@dataclass
class EpisodeHeldOut:
    """Held-out evaluation of a multi-turn run: one greedy episode per held-out seed; `eval/pass@1` is the success
    rate (so the summary's paired gain reads it), with turns, invalid actions and truncations beside it."""

    rollouts: InProcessRollouts  # over the greedy generator
    task: EnvTask
    tokenizer: Any
    prompts: int
    seed: int
    pad_id: int
    inference: Callable[[], ContextManager]
    correct: dict[str, int] | None = None

    def __call__(self) -> dict[str, float]:
        examples = draw_examples(self.task, "test", self.prompts, self.seed, "eval_prompts")
        starts = [(b, -1 - b, ex.meta["seed"]) for b, ex in enumerate(examples)]
        with self.inference():
            _, episodes = play_episodes(self.rollouts, self.task.make, starts, 1, 0, self.task.config.history,
                                        self.pad_id, render=lambda text: render_prompt(text, self.tokenizer))
        self.correct = {ex.uid: int(ep.success) for ex, ep in zip(examples, episodes)}
        metrics = episode_metrics(episodes, "eval")
        return {"eval/pass@1": metrics["eval/success"], **metrics}
