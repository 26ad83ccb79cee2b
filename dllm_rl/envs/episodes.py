"""Episodes of a multi-turn environment played by the dLLM, and their turns as training rows.

One training row per turn (the layout of verl-agent, ROLL's step manager and SkyRL's step-wise mode): a turn's row
is one canvas whose prompt is the task's description, the last `keep` observation-action records and the current
observation, and whose completion window is the action the sampler wrote. No environment token is ever inside a
canvas, so every likelihood estimator applies to a turn row unchanged (it masks only the completion window), and a
row's score cannot depend on the turns after it. The sampler's token ids, unmasking order and per-token log-probs
are kept as generated; the action sent to the environment is the decoded window (up to its first EOS).

The G episodes of a group start from the same environment seed (the prompt's); episode g's turn t samples from seed
(seed, "rollout", step, prompt id, g, t). A turn row is keyed by (the episode's prompt id, g * max_turns + t)
(`turn_key`, `split_key`): unique within the step, so sharding and mask seeds work as for single-turn rows.
All live episodes of the step take their turn in one sampler call (in lockstep), until every one is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from dllm_rl.algo.advantages import group_advantages
from dllm_rl.algo.step_credit import Turn, turn_advantages
from dllm_rl.buffer import Rows, concat_rows
from dllm_rl.data.task import Reward
from dllm_rl.envs.base import Env, action_text
from dllm_rl.seeds import derive_seed


def turn_prompt(description: str, records: list[tuple[str, str]], observation: str, keep: int = 2) -> str:
    """A turn's prompt: the task, the last `keep` (observation, action) records, the current observation."""
    lines = [description]
    for seen, did in records[len(records) - keep:] if keep > 0 else []:
        lines += [f"Observation: {seen}", f"Action: {did}"]
    return "\n".join(lines + [f"Observation: {observation}", "Action: "])


def turn_key(rollout: int, turn: int, max_turns: int) -> int:
    """The row's rollout index: episode `rollout`'s turn `turn`."""
    return rollout * max_turns + turn


def split_key(key: int, max_turns: int) -> tuple[int, int]:
    """(episode rollout index, turn) of a turn row's rollout index."""
    return divmod(key, max_turns)


@dataclass
class Episode:
    """One episode as played: its turns (anchor, parsed action, reward) and what it ended as."""

    batch_index: int  # its prompt's index in the step's batch
    prompt_id: int
    rollout: int
    env_seed: int
    turns: list[Turn] = field(default_factory=list)
    records: list[tuple[str, str]] = field(default_factory=list)  # (observation, action text) per turn
    success: bool = False
    truncated: bool = False
    invalid: int = 0  # turns whose action was unparsable or illegal

    @property
    def total(self) -> float:
        return sum(t.reward for t in self.turns)


def play_episodes(rollouts: Any, make_env: Callable[[], Env], starts: list[tuple[int, int, int]], group_size: int,
                  step: int, keep: int = 2, pad_id: int = 0,
                  render: Callable[[str], str] = lambda text: text) -> tuple[Rows, list[Episode]]:
    """The step's episodes and their turn rows: `starts` holds (batch index, prompt id, environment seed) per
    prompt, each played `group_size` times; `rollouts` is an `InProcessRollouts` (its generator, estimator and
    seed); `render` makes a turn prompt what the model reads (a chat template). Rows in the order turns were taken
    (round by round), each with its turn's reward record: the episode's success as its score."""
    episodes, envs, observations = [], [], []
    for b, q, env_seed in starts:
        for g in range(group_size):
            env = make_env()
            observations.append(env.reset(env_seed))
            envs.append(env)
            episodes.append(Episode(b, q, g, env_seed))
    T = envs[0].max_turns if envs else 1
    parts: list[tuple[Rows, list[int]]] = []
    live = list(range(len(episodes)))
    while live:
        prompts = [render(turn_prompt(envs[i].describe(), episodes[i].records, observations[i], keep)) for i in live]
        keys = [(episodes[i].batch_index, episodes[i].prompt_id,
                 turn_key(episodes[i].rollout, len(episodes[i].turns), T)) for i in live]
        seeds = [derive_seed(rollouts.seed, "rollout", step, q, *split_key(k, T)) for _, q, k in keys]
        samples = rollouts.generator.sample(prompts, seeds)
        rows = rollouts.rows_of(samples, keys, version=step)
        for n, i in enumerate(live):
            env, ep, text = envs[i], episodes[i], rows.texts[n]
            anchor, move = env.anchor(), env.parse(action_text(text))
            result = env.step(text)
            ep.turns.append(Turn(anchor, move if move is not None else ("unparsed", action_text(text)),
                                 result.reward))
            ep.records.append((observations[i], text))
            ep.invalid += result.info["invalid"]
            ep.success, ep.truncated = result.info["success"], result.info["truncated"]
            observations[i] = result.observation
        parts.append((rows, list(live)))
        live = [i for i in live if not envs[i].done]
    rows = concat_rows([p for p, _ in parts], pad_id)
    rows.rewards = [Reward(float(episodes[i].success), episodes[i].success, True,
                           "ok" if episodes[i].success else "truncated" if episodes[i].truncated else "failed")
                    for _, members in parts for i in members]
    return rows, episodes


def episode_advantages(rows: Rows, episodes: list[Episode], max_turns: int, advantage: str, credit: str,
                       **options: Any) -> torch.Tensor:
    """adv_N of the turn rows: each group's episode advantages from their returns (`algo.advantage`, the same
    estimators as single-turn rows), then each turn's by `credit` (grpo: broadcast; gigpo; crbc), read back by
    the rows' keys (made with the environment's `max_turns`). `options` go to `step_credit.turn_advantages`
    (gamma, beta, sigma_min, w_episode, w_step)."""
    groups = sorted({ep.prompt_id for ep in episodes})
    # cpu: per-episode values, read back into Python for the per-turn credit
    returns_E = torch.tensor([ep.total for ep in episodes], dtype=torch.float32)
    group_E = torch.tensor([groups.index(ep.prompt_id) for ep in episodes])  # cpu: beside returns_E
    adv_E = group_advantages(returns_E, group_E, advantage).tolist()
    by_key: dict[tuple[int, int, int], float] = {}
    for q in groups:
        members = [n for n, ep in enumerate(episodes) if ep.prompt_id == q]
        per_turn = turn_advantages([episodes[n].turns for n in members], [adv_E[n] for n in members], credit,
                                   **options)
        for n, advs in zip(members, per_turn):
            for t, a in enumerate(advs):
                by_key[q, episodes[n].rollout, t] = a
    return torch.tensor([by_key[(q, *split_key(k, max_turns))] for q, k in rows.keys], dtype=torch.float32,
                        device=rows.ids_NL.device)
