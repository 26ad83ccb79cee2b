"""Step credit for multi-turn episodes: GiGPO's anchor groups and Cross-Rollout Bellman Closure (CRBC).

A group is the G episodes that started from one environment seed; each episode a list of `Turn`s (the anchor key
of the state the action was taken in, the action as the environment parsed it, the step's reward). The turn after
turn t of an episode starts from the state turn t reached; the last turn reaches the terminal state (value 0;
a truncation is a failure, so it is terminal too). Anchors are matched by exact equality, within the group only.

GiGPO (verl-agent's `core_gigpo.py`): each turn's discounted return R_t = sum_k gamma^(k-t) r_k (gamma 0.95), its
step advantage R_t minus the mean of R over the group's turns taken at an equal anchor ("mean_norm"); the turn's
advantage is the episode's GRPO advantage + w * the step advantage (w = 1).

CRBC (arXiv 2609.35082; no code was released, so what the paper leaves open is decided here and said): the group's
turns are merged into an empirical MDP over its anchors. With n(s) the turns taken at s, n(s, s') those that reach
s' and r the rewards, M[s, s'] = n(s, s') / n(s) (the terminal state has no row) and b[s] = mean reward of the
turns at s; V solves (I - beta M) V = b (beta 0.98), once per group. Q(s, a) = the mean over the turns at s with
action a of r + beta V(next), so under the group's visit policy mu(a | s) = n(s, a) / n(s), V(s) = sum_a mu(a|s)
Q(s, a) and the credits Q - V sum to 0 at every anchor. Every occurrence of (anchor, action) shares one credit,
(Q - V) / max(sigma(s), sigma_min), where sigma(s) (this project's reading of the paper's sigma_g(s)) is the visit-
weighted standard deviation of Q(s, .) about V(s), floored at sigma_min = 0.1; an anchor with fewer than two distinct
observed actions gets credit 0 (the gate). The turn's advantage is w_G * the episode's GRPO advantage + w_S * its
credit, (w_G, w_S) = (1, 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from dllm_rl.errors import ConfigError, require


@dataclass(frozen=True)
class Turn:
    anchor: Hashable  # the state's key (exact equality within the group)
    action: Hashable  # the action as the environment parsed it ("semantic action"; an invalid one as its text)
    reward: float


Group = list[list[Turn]]  # the group's episodes, each its turns in order


def discounted_returns(rewards: list[float], gamma: float) -> list[float]:
    """R_t = r_t + gamma R_(t+1), from the last turn back."""
    out, running = [], 0.0
    for r in reversed(rewards):
        running = r + gamma * running
        out.append(running)
    return out[::-1]


def gigpo_step_advantages(group: Group, gamma: float = 0.95) -> list[list[float]]:
    """Each turn's R_t minus the mean R of the group's turns taken at an equal anchor."""
    returns = [discounted_returns([t.reward for t in episode], gamma) for episode in group]
    by_anchor: dict[Hashable, list[float]] = {}
    for episode, rs in zip(group, returns):
        for turn, r in zip(episode, rs):
            by_anchor.setdefault(turn.anchor, []).append(r)
    means = {s: sum(v) / len(v) for s, v in by_anchor.items()}
    return [[r - means[turn.anchor] for turn, r in zip(episode, rs)] for episode, rs in zip(group, returns)]


@dataclass
class EmpiricalMDP:
    anchors: list[Hashable]  # in first-visit order
    M: torch.Tensor  # (S, S) float64: empirical transition probabilities (rows sum to 1 - P(terminal))
    b: torch.Tensor  # (S,) float64: mean reward of the turns at each anchor
    visits: list[int]  # turns taken at each anchor


def empirical_mdp(group: Group) -> EmpiricalMDP:
    """The group's turns as one Markov chain over its anchors (the terminal state left out: value 0)."""
    index: dict[Hashable, int] = {}
    for episode in group:
        for turn in episode:
            index.setdefault(turn.anchor, len(index))
    S = len(index)
    # cpu: a group's handful of anchors, counted in Python and solved once; the credits go back as floats
    counts = torch.zeros(S, S, dtype=torch.float64)
    # cpu: the same small chain's rewards and visit counts
    rewards, visits = torch.zeros(S, dtype=torch.float64), torch.zeros(S, dtype=torch.float64)
    for episode in group:
        for t, turn in enumerate(episode):
            s = index[turn.anchor]
            visits[s] += 1
            rewards[s] += turn.reward
            if t + 1 < len(episode):
                counts[s, index[episode[t + 1].anchor]] += 1
    return EmpiricalMDP(list(index), counts / visits[:, None], rewards / visits, [int(v) for v in visits])


def closure_values(mdp: EmpiricalMDP, beta: float) -> torch.Tensor:
    """V_S from (I - beta M) V = b, one linear solve (float64)."""
    require(0.0 < beta <= 1.0, f"crbc beta must be in (0, 1], got {beta}")
    S = len(mdp.anchors)
    return torch.linalg.solve(torch.eye(S, dtype=torch.float64) - beta * mdp.M, mdp.b)  # cpu: beside mdp.M


def crbc_step_credit(group: Group, beta: float = 0.98, sigma_min: float = 0.1,
                     normalise: bool = True) -> list[list[float]]:
    """Each turn's CRBC credit (Q - V) / max(sigma(s), sigma_min) (Q - V itself with `normalise` off), 0 at an
    anchor with one observed action."""
    mdp = empirical_mdp(group)
    V = closure_values(mdp, beta)
    index = {s: i for i, s in enumerate(mdp.anchors)}
    targets: dict[tuple[Hashable, Hashable], list[float]] = {}  # (anchor, action) -> r + beta V(next) per turn
    for episode in group:
        for t, turn in enumerate(episode):
            after = float(V[index[episode[t + 1].anchor]]) if t + 1 < len(episode) else 0.0
            targets.setdefault((turn.anchor, turn.action), []).append(turn.reward + beta * after)
    Q = {key: sum(v) / len(v) for key, v in targets.items()}
    credit: dict[tuple[Hashable, Hashable], float] = {}
    for s in mdp.anchors:
        actions = [(a, len(targets[s_, a])) for s_, a in targets if s_ == s]
        if len(actions) < 2:
            credit.update({(s, a): 0.0 for a, _ in actions})
            continue
        v, n = float(V[index[s]]), mdp.visits[index[s]]
        sigma = (sum(k / n * (Q[s, a] - v) ** 2 for a, k in actions)) ** 0.5
        scale = max(sigma, sigma_min) if normalise else 1.0
        credit.update({(s, a): (Q[s, a] - v) / scale for a, _ in actions})
    return [[credit[turn.anchor, turn.action] for turn in episode] for episode in group]


def turn_advantages(group: Group, episode_adv: list[float], method: str, *, gamma: float = 0.95,
                    beta: float = 0.98, sigma_min: float = 0.1, w_episode: float = 1.0,
                    w_step: float | None = None) -> list[list[float]]:
    """Each turn's advantage: `grpo` the episode's advantage broadcast to its turns; `gigpo` + w_step (1) times
    GiGPO's step advantage; `crbc` w_episode times it + w_step (5) times CRBC's credit."""
    require(len(episode_adv) == len(group), f"{len(episode_adv)} episode advantages for {len(group)} episodes")
    if method == "grpo":
        return [[a] * len(episode) for a, episode in zip(episode_adv, group)]
    if method == "gigpo":
        step, w = gigpo_step_advantages(group, gamma), 1.0 if w_step is None else w_step
    elif method == "crbc":
        step, w = crbc_step_credit(group, beta, sigma_min), 5.0 if w_step is None else w_step
    else:
        raise ConfigError(f"step credit {method!r}: expected grpo, gigpo or crbc")
    return [[w_episode * a + w * c for c in credits] for a, credits in zip(episode_adv, step)]


def shared_anchor_share(group: Group) -> float:
    """The share of the group's anchors that more than one of its episodes reached (0 for an empty group): where
    the empirical MDP has anything to close."""
    reached: dict[Hashable, set[int]] = {}
    for e, episode in enumerate(group):
        for turn in episode:
            reached.setdefault(turn.anchor, set()).add(e)
    return sum(len(v) > 1 for v in reached.values()) / len(reached) if reached else 0.0
