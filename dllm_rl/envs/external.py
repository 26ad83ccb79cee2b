"""ERILS in a multi-turn run: an external policy plays episodes of the step's groups, from the same environment
seeds as the dLLM's own, and its turns become external rows of the mixed buffer.

The external player is the run's `external` source, asked one turn at a time: `solver` plays the environment's
own solver (`Env.solve()` from the current state, its first action; no action where it has none), `causal_lm` and
`openai` are asked the turn prompt (the task, the last `env.history` records and the observation, in the source's
own chat template) for one completion, seeded by (seed, "external", step, prompt id, episode, turn). A `jsonl`
file holds single-turn completions and is refused with `env=`. Each action is bridged into the dLLM's tokens as a
single-turn external completion is; an action the dLLM's tokenizer cannot spell, or longer than the rollout
window, ends the episode there and drops it (`mixing.length_rule=drop`, the only rule a turn takes: a cut action
is another action).

What ERILS's options mean here: the trigger fires per group on its on-policy episodes' successes; the source
plays `per_prompt * candidates` episodes of each fired group, `keep=correct` keeps the successful ones, and the
first `per_prompt` kept ones join the step. Their turns join the group's empirical MDP (`env.credit=crbc`) and
anchor groups (`gigpo`), so the dLLM's turns are credited against states and actions the external policy
reached as well; and they keep their own advantages, as ERILS requires: each external episode's advantage comes
from its return by the mixer's `processing` and `statistic` (separate: the on-policy episodes' statistics
never see it), the same step credit is added to its turns, and its rows carry the `mixing.weight`.
`env/anchors_shared` (the dLLM's episodes alone) and `external/anchors_shared` (with the external ones) log how
many of a group's anchors more than one episode reached: where the closure has anything to work with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import torch

from dllm_rl.algo.advantages import group_advantages
from dllm_rl.buffer import Rows
from dllm_rl.collect import StepBatch
from dllm_rl.data.task import Example, render_prompt
from dllm_rl.envs.base import Env
from dllm_rl.envs.episodes import (Episode, anchors_shared, episode_returns, episode_reward, group_index_of,
                                   read_turn_advantages, run_episodes, turn_advantage_table, turn_key)
from dllm_rl.envs.task import EnvTask
from dllm_rl.external.bridge import bridge
from dllm_rl.external.mixer import ExternalMixer, Gather, local_only
from dllm_rl.seeds import derive_seed


@dataclass(frozen=True)
class TurnTask:
    """One turn as a single-turn task for a text source: the example's question is the turn prompt."""

    name: str
    prompt_style: str = "compact"

    def prompt(self, example: Example) -> str:
        return example.question


@dataclass
class Played:
    """An external turn as played: the prompt the dLLM reads, the action in its tokens, log mu of the action."""

    prompt: str
    item: Any  # the `Bridged` action
    logp: float | None


@dataclass
class ExternalEpisodes:
    """The external rollouts stage of a multi-turn run (see the module docstring): writes `rows["external"]`
    (one row per kept external turn, keyed (prompt id, turn_key(G + j, t)): the j-th external episode of a group
    of G) and `external_episodes`."""

    mixer: ExternalMixer
    task: EnvTask
    tokenizer: Any  # the dLLM's
    group_size: int  # G: the external episodes' rollout indices start after the dLLM's
    window: int
    eos_id: int
    max_length: int | None
    seed: int
    device: torch.device | str = "cpu"
    counts: dict[str, int] = field(default_factory=dict)

    def __call__(self, batch: StepBatch) -> None:
        own = batch.episodes if batch.real("on_policy") is not None else []
        groups = sorted({ep.batch_index for ep in own})
        # cpu: the trigger is decided in Python from these flags (a rank with no group: none)
        correct_BG = torch.tensor([[ep.success for ep in own if ep.batch_index == b] for b in groups] or [[]],
                                  dtype=torch.bool)[: len(groups)]
        fired = [groups[i] for i in self.mixer.fired(batch.step, self.seed, correct_BG,
                                                      [batch.prompt_ids[b] for b in groups])]
        starts = [(b, batch.prompt_ids[b], batch.examples[b].meta["seed"]) for b in fired]
        c = self.mixer.config
        self.counts = dict.fromkeys(("no_move", "unrepresentable", "too_long", "incorrect"), 0)
        played: dict[tuple[int, int], list[Played]] = {}
        candidates = run_episodes(self.task.make, starts, c.per_prompt * c.candidates, self.task.config.history,
                                  lambda live, prompts, envs: self.act(batch.step, live, prompts, envs, played),
                                  first_rollout=self.group_size) if starts else []
        kept: list[Episode] = []
        for b in fired:
            ok = [ep for ep in candidates if ep.batch_index == b and ep.dropped is None]
            self.counts["incorrect"] += sum(not ep.success for ep in ok)
            ok = [ep for ep in ok if c.keep == "all" or ep.success]
            kept += ok[: c.per_prompt]
        batch.external_episodes = kept
        batch.metrics.update(self.metrics(own, candidates, kept, len(fired)))
        if kept:
            rows = self.rows(kept, played)
            batch.metrics["external/rows"] = float(len(rows))
            batch.rows["external"] = rows

    def act(self, step: int, live: list[Episode], prompts: list[str], envs: list[Env],
            played: dict[tuple[int, int], list[Played]]) -> list[str | None]:
        """The source's action for each live external episode (None: the episode ends, dropped)."""
        source = self.mixer.source
        if source.name == "solver":
            moves = [env.solve() for env in envs]
            got = [(m[0], 0.0) if m else None for m in moves]
        else:
            examples = [Example(self.task.name, f"{ep.prompt_id}/{ep.rollout}/{len(ep.turns)}", p, "")
                        for ep, p in zip(live, prompts)]
            seeds = [[derive_seed(self.seed, "external", step, ep.prompt_id, ep.rollout, len(ep.turns))]
                     for ep in live]
            replies = source.rollouts(TurnTask(self.task.name), examples, 1, seeds)
            got = [(r[0].text, r[0].behaviour_logp) if r else None for r in replies]
        out: list[str | None] = []
        for ep, prompt, reply in zip(live, prompts, got):
            if reply is None:
                ep.dropped, text = "no_move", None
            else:
                item = bridge(reply[0], self.tokenizer)
                ep.dropped = "unrepresentable" if item.lost else "too_long" if len(item.ids) > self.window else None
                text = None if ep.dropped else item.text
                played.setdefault((ep.prompt_id, ep.rollout), []).append(
                    Played(render_prompt(prompt, self.tokenizer), item, reply[1]))
            if ep.dropped:
                self.counts[ep.dropped] += 1
            out.append(text)
        return out

    def rows(self, kept: list[Episode], played: dict[tuple[int, int], list[Played]]) -> Rows:
        """The kept episodes' turns as external rows (the mixer's `to_rows`), keyed as the module says."""
        T = self.task.max_turns
        turns = [(ep, t, p) for ep in kept for t, p in enumerate(played[ep.prompt_id, ep.rollout][: len(ep.turns)])]
        rows = self.mixer.to_rows([(n, p.item, episode_reward(ep), p.logp) for n, (ep, _, p) in enumerate(turns)],
                                  [p.prompt for _, _, p in turns], self.tokenizer, self.window, self.eos_id,
                                  self.max_length, self.device, [ep.prompt_id for ep, _, _ in turns])
        rows.prompt_N = torch.tensor([ep.batch_index for ep, _, _ in turns], device=rows.ids_NL.device)
        rows.rollout_N = torch.tensor([turn_key(ep.rollout, t, T) for ep, t, _ in turns], device=rows.ids_NL.device)
        return rows

    def metrics(self, own: list[Episode], candidates: list[Episode], kept: list[Episode],
                prompts: int) -> dict[str, float]:
        out = {f"external/{k}": float(v) for k, v in self.counts.items()}
        out |= {"external/prompts": float(prompts), "external/candidates": float(len(candidates)),
                "external/episodes": float(len(kept)), "external/rows": 0.0}
        if candidates:
            out["external/success"] = fmean(ep.success for ep in candidates)
        if own:
            out["external/anchors_shared"] = anchors_shared(own + kept)
        return out


def assign_turn_advantages(batch: StepBatch, advantage: str, task: EnvTask, mixer: ExternalMixer | None = None,
                           gather: Gather = local_only) -> None:
    """adv_N of the turn rows from their episodes (`env.credit`): the dLLM's episodes' advantages over their
    group, and with ERILS the external episodes' own (the mixer's `processing` and `statistic`; its running
    baseline moves by the mean over all ranks, so every rank calls this), then each turn's credit over all the
    group's episodes. A rank's stand-in row keeps its 0."""
    on, ext = batch.real("on_policy"), batch.real("external")
    own = batch.episodes if on is not None else []
    external = batch.external_episodes if ext is not None else []
    episodes = own + external
    if mixer is None:
        adv_E = group_advantages(episode_returns(own), group_index_of(own), advantage).tolist() if own else []
    else:
        group_E = group_index_of(episodes) if episodes else torch.zeros(0, dtype=torch.long)  # cpu: bookkeeping
        returns_E = episode_returns(episodes)
        adv_on, adv_ext = mixer.advantages(returns_E[: len(own)], group_E[: len(own)], returns_E[len(own):],
                                           group_E[len(own):], advantage, gather)
        adv_E = adv_on.tolist() + adv_ext.tolist()
    table = turn_advantage_table(episodes, adv_E, task.config.credit, **task.config.credit_options())
    if on is not None:
        on.adv_N = read_turn_advantages(on, table, task.max_turns)
    if ext is not None:
        ext.adv_N = read_turn_advantages(ext, table, task.max_turns)
        mixer.weigh(ext)
