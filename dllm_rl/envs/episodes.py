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
from dllm_rl.algo.step_credit import Turn, shared_anchor_share, turn_advantages
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
    dropped: str | None = None  # why the player stopped it before the environment did (an external player's)

    @property
    def total(self) -> float:
        return sum(t.reward for t in self.turns)


# (the live episodes, their turn prompts as the task writes them, their environments) -> each one's action text, or
# None where the player has no action (the episode ends there, `Episode.dropped` says why)
Act = Callable[[list[Episode], list[str], list[Env]], list[str | None]]


def run_episodes(make_env: Callable[[], Env], starts: list[tuple[int, int, int]], count: int, keep: int, act: Act,
                 first_rollout: int = 0) -> list[Episode]:
    """Play `count` episodes from each start (batch index, prompt id, environment seed), rollout indices
    `first_rollout`, ...; every live episode takes its turn in one `act` call (in lockstep) until all are done."""
    episodes, envs, observations = [], [], []
    for b, q, env_seed in starts:
        for g in range(first_rollout, first_rollout + count):
            env = make_env()
            observations.append(env.reset(env_seed))
            envs.append(env)
            episodes.append(Episode(b, q, g, env_seed))
    live = list(range(len(episodes)))
    while live:
        prompts = [turn_prompt(envs[i].describe(), episodes[i].records, observations[i], keep) for i in live]
        texts = act([episodes[i] for i in live], prompts, [envs[i] for i in live])
        for i, text in zip(live, texts):
            env, ep = envs[i], episodes[i]
            if text is None:
                ep.dropped = ep.dropped or "no action"
                continue
            anchor, move = env.anchor(), env.parse(action_text(text))
            result = env.step(text)
            ep.turns.append(Turn(anchor, move if move is not None else ("unparsed", action_text(text)),
                                 result.reward))
            ep.records.append((observations[i], text))
            ep.invalid += result.info["invalid"]
            ep.success, ep.truncated = result.info["success"], result.info["truncated"]
            observations[i] = result.observation
        live = [i for i in live if not envs[i].done and episodes[i].dropped is None]
    return episodes


def anchors_shared(episodes: list[Episode]) -> float:
    """The mean over the episodes' groups of the share of the group's anchors more than one episode reached
    (`step_credit.shared_anchor_share`)."""
    groups = sorted({ep.prompt_id for ep in episodes})
    return sum(shared_anchor_share([ep.turns for ep in episodes if ep.prompt_id == q]) for q in groups) / len(groups)


def episode_reward(ep: Episode) -> Reward:
    """The reward record of each of an episode's turn rows: the episode's success as its score."""
    return Reward(float(ep.success), ep.success, True, "ok" if ep.success else "truncated" if ep.truncated
                  else "failed")


def play_episodes(rollouts: Any, make_env: Callable[[], Env], starts: list[tuple[int, int, int]], group_size: int,
                  step: int, keep: int = 2, pad_id: int = 0,
                  render: Callable[[str], str] = lambda text: text) -> tuple[Rows, list[Episode]]:
    """The step's episodes played by the dLLM and their turn rows: `starts` holds (batch index, prompt id,
    environment seed) per prompt, each played `group_size` times; `rollouts` is an `InProcessRollouts` (its
    generator, estimator and seed); `render` makes a turn prompt what the model reads (a chat template). Rows in
    the order turns were taken (round by round), each with its turn's reward record (`episode_reward`)."""
    parts: list[tuple[Rows, list[Episode]]] = []

    def act(live: list[Episode], prompts: list[str], envs: list[Env]) -> list[str]:
        T = envs[0].max_turns
        keys = [(ep.batch_index, ep.prompt_id, turn_key(ep.rollout, len(ep.turns), T)) for ep in live]
        seeds = [derive_seed(rollouts.seed, "rollout", step, q, *split_key(k, T)) for _, q, k in keys]
        rows = rollouts.rows_of(rollouts.generator.sample([render(p) for p in prompts], seeds), keys, version=step)
        parts.append((rows, live))
        return rows.texts

    episodes = run_episodes(make_env, starts, group_size, keep, act)
    rows = concat_rows([p for p, _ in parts], pad_id)
    rows.rewards = [episode_reward(ep) for _, members in parts for ep in members]
    return rows, episodes


def turn_advantage_table(episodes: list[Episode], adv_E: list[float], credit: str,
                         **options: Any) -> dict[tuple[int, int, int], float]:
    """(prompt id, rollout, turn) -> the turn's advantage: each group's episodes (all that started from its seed,
    whoever played them) with their episode advantages `adv_E`, then each turn's by `credit` (grpo: broadcast;
    gigpo; crbc); `options` go to `step_credit.turn_advantages` (gamma, beta, sigma_min, w_episode, w_step)."""
    table: dict[tuple[int, int, int], float] = {}
    for q in sorted({ep.prompt_id for ep in episodes}):
        members = [n for n, ep in enumerate(episodes) if ep.prompt_id == q]
        per_turn = turn_advantages([episodes[n].turns for n in members], [adv_E[n] for n in members], credit,
                                   **options)
        for n, advs in zip(members, per_turn):
            for t, a in enumerate(advs):
                table[q, episodes[n].rollout, t] = a
    return table


def read_turn_advantages(rows: Rows, table: dict[tuple[int, int, int], float], max_turns: int) -> torch.Tensor:
    """adv_N of turn rows, read from `turn_advantage_table` by the rows' keys (made with `max_turns`)."""
    return torch.tensor([table[(q, *split_key(k, max_turns))] for q, k in rows.keys], dtype=torch.float32,
                        device=rows.ids_NL.device)


def group_index_of(episodes: list[Episode]) -> torch.Tensor:
    """Each episode's group as an index over the step's prompt ids (what `group_advantages` groups by)."""
    groups = sorted({ep.prompt_id for ep in episodes})
    return torch.tensor([groups.index(ep.prompt_id) for ep in episodes], dtype=torch.long)  # cpu: bookkeeping


def episode_returns(episodes: list[Episode]) -> torch.Tensor:
    """Each episode's return (the sum of its turns' rewards)."""
    return torch.tensor([ep.total for ep in episodes], dtype=torch.float32)  # cpu: read back into Python


def episode_advantages(rows: Rows, episodes: list[Episode], max_turns: int, advantage: str, credit: str,
                       **options: Any) -> torch.Tensor:
    """adv_N of the dLLM's own turn rows: each group's episode advantages from their returns (`algo.advantage`,
    the same estimators as single-turn rows), then each turn's by `credit` (`turn_advantage_table`)."""
    adv_E = group_advantages(episode_returns(episodes), group_index_of(episodes), advantage).tolist()
    return read_turn_advantages(rows, turn_advantage_table(episodes, adv_E, credit, **options), max_turns)
