"""A multi-turn run's settings (`env=<name>`, the `env` group) and the environment as the trainer's task.

With `env.name` other than none the run plays the environment instead of a single-turn task: each prompt of a step
is an environment seed (`EnvTask`: the seeds split into train and test by a hash, like the generated tasks), its
group is `group_size` episodes from that seed, and each turn is a training row (dllm_rl/envs/episodes.py). The
rest of the step is the same stage list as a single-turn step (dllm_rl/step.py): only the collect stage (episodes
instead of one completion per rollout) and the advantages (per turn, `env.credit`) differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dllm_rl.data.task import Example, Reward, TooFewExamples, in_test_split
from dllm_rl.envs import build_env, env_class
from dllm_rl.envs.base import Env
from dllm_rl.envs.episodes import turn_prompt
from dllm_rl.errors import ConfigError, require

CREDITS = ("grpo", "gigpo", "crbc")


@dataclass(frozen=True)
class EnvConfig:
    name: str = "none"  # none (a single-turn task) | a name of dllm_rl.envs.ENVIRONMENTS | pkg.module:Class
    options: dict[str, Any] = field(default_factory=dict)  # the environment's constructor options
    history: int = 2  # observation-action records in a turn's prompt (CRBC keeps 2)
    credit: str = "grpo"  # grpo (the episode's advantage on every turn) | gigpo | crbc (dllm_rl/algo/step_credit.py)
    gamma: float = 0.95  # GiGPO's discount
    beta: float = 0.98  # CRBC's discount in (I - beta M) V = b
    sigma_min: float = 0.1  # CRBC's floor of an anchor's spread
    w_episode: float = 1.0  # weight of the episode's advantage
    w_step: float | None = None  # weight of the step credit (None: GiGPO 1, CRBC 5)
    test_fraction: float = 0.1  # share of environment seeds held out

    def __post_init__(self) -> None:
        require(self.credit in CREDITS, f"env.credit={self.credit!r}: expected one of {', '.join(CREDITS)}")
        require(isinstance(self.history, int) and self.history >= 0, f"env.history must be >= 0, got {self.history!r}")
        require(0 < self.gamma <= 1 and 0 < self.beta <= 1,
                f"env.gamma and env.beta must be in (0, 1], got {self.gamma} and {self.beta}")
        require(self.sigma_min > 0, f"env.sigma_min must be > 0, got {self.sigma_min}")
        require(math.isfinite(self.w_episode) and (self.w_step is None or math.isfinite(self.w_step)),
                "env.w_episode and env.w_step must be finite")
        require(0 < self.test_fraction < 1, f"env.test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.on:
            env_class(self.name)
            build_env(self.name, **self.options)  # its options, checked by name

    @property
    def on(self) -> bool:
        return self.name != "none"

    def credit_options(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "beta": self.beta, "sigma_min": self.sigma_min, "w_episode": self.w_episode,
                "w_step": self.w_step}


@dataclass(frozen=True)
class EnvTask:
    """The environment as the run's task: an example is an environment seed (`meta["seed"]`); the reward comes
    from playing the episode, not from one completion."""

    config: EnvConfig
    prompt_style: str = "compact"

    @property
    def name(self) -> str:
        return self.make().name or self.config.name

    def make(self) -> Env:
        return build_env(self.config.name, **self.config.options)

    @property
    def max_turns(self) -> int:
        return self.make().max_turns

    def describe_splits(self, needed: tuple[str, ...] = ()) -> str:
        return (f"env={self.config.name}: environment seeds 0, 1, 2, ..., split by a hash of each with "
                f"env.test_fraction={self.config.test_fraction:g}")

    def examples(self, split: str, n: int | None, seed: int) -> list[Example]:
        """The first `n` (1000 when None) environment seeds of `split`, in order (a run shuffles its pool)."""
        require(split in ("train", "test"), f"split must be train or test, got {split!r}")
        n = n or 1000
        name, out, s = self.name, [], 0
        while len(out) < n:
            if in_test_split(name, str(s), self.config.test_fraction) == (split == "test"):
                out.append(Example(name, f"seed{s}", f"{name} from seed {s}", "", {"seed": s}))
            s += 1
            if s > 100 * n + 1000:
                raise TooFewExamples(split, name, len(out), n)
        return out

    def prompt(self, example: Example) -> str:
        """The episode's first turn prompt (what the step's records and a rank's stand-in row show)."""
        env = self.make()
        return turn_prompt(env.describe(), [], env.reset(example.meta["seed"]), self.config.history)

    def reward(self, completion: str, example: Example) -> Reward:
        raise ConfigError(f"env={self.config.name}: an episode's reward comes from playing it "
                          f"(dllm_rl/envs/episodes.py), not from one completion")

    def solve(self, example: Example):
        return None


def preview_env(config: EnvConfig, n: int = 3, split: str = "train", seed: int = 0, check: int = 1000,
                print_fn=print) -> dict:
    """`dllm-rl tasks env=<name>`: the environments there are, `n` episodes of `split` played by the
    environment's solver (each turn's prompt, action and reward), and the solver's success over `check` more."""
    require(isinstance(n, int) and n >= 1 and isinstance(check, int) and check >= 0,
            f"n must be >= 1 and check >= 0, got {n!r} and {check!r}")
    from dllm_rl.envs import ENVIRONMENTS

    print_fn(f"environments: {', '.join(ENVIRONMENTS)} (or env.name=your.module:YourEnv)")
    task = EnvTask(config)
    seeds = [ex.meta["seed"] for ex in task.examples(split, n + check, seed)]
    successes, turns = 0, 0
    for i, env_seed in enumerate(seeds):
        env = task.make()
        observation, records, show = env.reset(env_seed), [], i < n
        if show:
            print_fn(f"=== {env.name} [{split}] seed {env_seed}: {len(env.solve() or [])} solver turns")
        for action in env.solve() or []:
            step = env.step(action)
            if show:
                print_fn(f"--- prompt\n{turn_prompt(env.describe(), records, observation, config.history)}")
                print_fn(f"--- action {action!r} -> reward {step.reward:g}{', done' if step.done else ''}")
            records.append((observation, action))
            observation = step.observation
            if step.done:
                successes += step.info["success"]
                break
        turns += env.turn
    summary = {"env": task.name, "split": split, "episodes": len(seeds), "solver_success": successes / len(seeds),
               "solver_turns": turns / len(seeds)}
    print_fn(f"solver: {summary['solver_success']:.3f} of {len(seeds)} episodes succeed, "
             f"{summary['solver_turns']:.1f} turns each")
    return summary


def solver_turns(task: EnvTask, n: int, seed: int, render=lambda text: text) -> list[tuple[str, str]]:
    """SFT data from solver episodes: (turn prompt, action) for every turn of the solver's episodes on the train
    seeds, in seed order, until `n` turns (each turn's prompt as a run builds it, `render` applied)."""
    out: list[tuple[str, str]] = []
    for ex in task.examples("train", max(n, 1), seed):
        env = task.make()
        observation, records = env.reset(ex.meta["seed"]), []
        for action in env.solve() or []:
            out.append((render(turn_prompt(env.describe(), records, observation, task.config.history)), action))
            step = env.step(action)
            records.append((observation, action))
            observation = step.observation
            if len(out) == n or step.done:
                break
        if len(out) == n:
            return out
    return out
