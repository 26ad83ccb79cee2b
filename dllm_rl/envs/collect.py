"""The stages a multi-turn run puts into the step in place of the single-turn ones: collect (choose environment
seeds, play each group's episodes, one row per turn), the advantages per turn, and the held-out evaluation
(success rate over held-out seeds, greedy). The other stages of dllm_rl/step.py run on the turn rows unchanged."""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from dllm_rl.collect import InProcessRollouts, PromptSource, StepBatch
from dllm_rl.data.task import draw_examples, render_prompt
from dllm_rl.envs.episodes import Episode, anchors_shared, play_episodes
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
        batch.metrics.update(episode_metrics(episodes) | {"env/anchors_shared": anchors_shared(episodes)})
        return batch


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


def run_env_eval(task: EnvTask, *, model: str, kind: str = "auto", dtype: str = "float32",
                 rollout: dict[str, Any], protocol: dict[str, Any] | None = None, num_prompts: int | None = 100,
                 num_samples: int = 1, batch_size: int = 32, seed: int = 0, split: str = "test", chat: bool = True,
                 output_dir: str | None = None, trust_remote_code: bool = False, device: str = "auto",
                 print_fn=print) -> dict[str, float]:
    """`dllm-rl eval env=<name>`: one episode per seed of `split` (`num_prompts` of them) played by `model` with the
    `rollout` sampler (greedy by default); prints and writes (summary.json, episodes.jsonl) the success rate, the
    turns per episode and the shares of invalid actions and of truncated episodes. All episodes take their turns
    in lockstep (`batch_size` does not apply)."""
    import json
    import time
    from pathlib import Path

    from dllm_rl.errors import require
    from dllm_rl.likelihood.estimators import build_estimator
    from dllm_rl.rollout.generate import load_generator

    require((protocol or {}).get("name", "none") == "none",
            f"protocol={(protocol or {}).get('name')!r} with env={task.config.name}: the evaluation protocols are "
            f"for single-turn tasks; use protocol=none")
    require(num_samples == 1, f"num_samples={num_samples} with env={task.config.name}: one episode per seed")
    generator = load_generator(model, kind=kind, dtype=dtype, trust_remote_code=trust_remote_code, device=device,
                               **rollout)
    examples = draw_examples(task, split, num_prompts or 100, seed, "num_prompts")
    rollouts = InProcessRollouts(generator, build_estimator({"name": "mean_field"}), seed, contextlib.nullcontext)
    tokenizer = generator.tokenizer if chat else None
    starts = [(b, -1 - b, ex.meta["seed"]) for b, ex in enumerate(examples)]
    render = lambda text: render_prompt(text, tokenizer)  # noqa: E731
    with torch.no_grad():
        _, episodes = play_episodes(rollouts, task.make, starts, 1, 0, task.config.history,
                                    generator.tokenizer.pad_token_id, render=render)
    summary = {"env": task.name, "model": model, "split": split, "episodes": len(episodes),
               **{k.split("/")[1]: v for k, v in episode_metrics(episodes, "eval").items()}}
    out = Path(output_dir or time.strftime("runs/eval-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "episodes.jsonl", "w") as f:
        for ex, ep in zip(examples, episodes):
            f.write(json.dumps({"seed": ex.meta["seed"], "success": ep.success, "truncated": ep.truncated,
                                "invalid": ep.invalid, "actions": [a for _, a in ep.records]}) + "\n")
    print_fn(f"{task.name}: success {summary['success']:.3f} over {len(episodes)} {split} seeds, "
             f"{summary['turns']:.1f} turns each, {summary['invalid']:.3f} of the actions invalid, "
             f"{summary['truncated']:.3f} truncated")
    print_fn(f"wrote {out}/summary.json and {out}/episodes.jsonl")
    return summary
