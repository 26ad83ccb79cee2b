"""A contextual rollout bandit with replay (CBS): each step, an online scorer picks which rows reach the loss, among
the step's own rows and a replay buffer of earlier steps' on-policy rows, from features of each row; the change of a
cheap held-out metric over the step's update is the reward of the rows it picked.

- Features of a row (`FEATURES`): a bias, its age (current step - the step that generated it, over `max_age`),
  how often it reached the loss before (uses / (1 + uses)), whether it is an external (ERILS) row, its reward,
  its advantage, its length (counted tokens over the window), the mean entropy of its tokens when the sampler
  committed them (0 for external rows: no record), and its clip fraction the last time it reached the loss (the
  share of its counted tokens whose clipped term won, over that step's updates; 0 before its first use).
- Scorer (`scorer`): `linear` (ridge regression of the reward on the features, greedy) or `ucb` (LinUCB: that
  estimate plus `alpha` times its confidence width, sqrt(x' A^-1 x)). Deterministic: a fixed scorer state and the
  same candidates give the same choice (ties broken by the rows' keys). The paper's MLP scorer is not built.
- Selection: the `rows` best-scored candidates (0: as many as the step's own rows), then the entropy guard (the
  paper's ablation: without it the bandit learns to pick low-entropy rows and entropy collapses): while the picked
  rows' mean token entropy is below `entropy_guard` times the candidates' mean, the lowest-entropy picked dLLM row
  (this step's or replayed; an external row has no entropy record) is swapped for the highest-entropy candidate
  left out.
- Reward: the change, over the step's update, of the held-out probe: the policy's mean per-token log-likelihood
  (mean-field estimator, one forward) of verified-correct completions (the task's solver, or the reference
  solutions of a file task; with their steps where they fit the window, else the answer alone) of `probe_prompts`
  held-out prompts. Measured once before the first step and after every
  update, on every rank alike. Every picked row of the step shares that reward (`A += x x'`, `b += r x`).
- Replay buffer: after each update the step's on-policy rows join it (what is needed to score them again: tokens,
  denoising order, sampler record, mask seeds, reward, advantage); rows older than `max_age` steps leave, and at
  most `capacity` stay (the newest first). External rows are picked among the step's own only: they are not kept.
- The off-policy choice: a replayed row keeps its stored advantage and its stored mask seeds, and its old
  log-probs are the current policy's (scored like every row before the update), so its clipped ratio starts at 1:
  it is learnt as if the current policy had sampled it. The existing correction for a stale sampler applies as an
  option: with `sampler_correction` on, replayed rows get Sparse-RL's weights too (their sampler log-probs are the
  older policy's), so the weights grow with their age.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dllm_rl.errors import require

FEATURES = ("bias", "age", "uses", "external", "reward", "advantage", "length", "entropy", "clip")
SCORERS = ("linear", "ucb")


@dataclass(frozen=True)
class BanditConfig:
    capacity: int = 64  # replayed rows kept at most
    max_age: int = 4  # steps a row stays in the buffer
    rows: int = 0  # rows that reach the loss per step (0: as many as the step's own rows)
    scorer: str = "ucb"  # linear | ucb
    alpha: float = 0.5  # UCB's width
    ridge: float = 1.0  # the scorer's prior precision (A starts as ridge * I)
    entropy_guard: float = 0.9  # the picked rows' mean entropy stays >= this times the candidates' (0: off)
    probe_prompts: int = 8  # held-out prompts of the probe (the bandit's reward)

    def __post_init__(self) -> None:
        for key, ok, want in (("capacity", self.capacity >= 0, ">= 0"), ("max_age", self.max_age >= 1, ">= 1"),
                              ("rows", self.rows >= 0, ">= 0"), ("alpha", self.alpha >= 0, ">= 0"),
                              ("ridge", self.ridge > 0, "> 0"),
                              ("entropy_guard", 0 <= self.entropy_guard <= 1, "in [0, 1]"),
                              ("probe_prompts", self.probe_prompts >= 1, ">= 1")):
            require(ok and not (isinstance(getattr(self, key), float) and math.isnan(getattr(self, key))),
                    f"curation.bandit.{key} must be {want}, got {getattr(self, key)!r}")
        require(self.scorer in SCORERS, f"curation.bandit.scorer must be one of {SCORERS}, got {self.scorer!r}")


@dataclass
class Candidate:
    """One row the bandit may pick (plain data, the same on every rank)."""

    source: str  # on_policy, external, replay
    key: tuple[int, int]
    features: list[float]
    entropy: float


def features(*, age: int, max_age: int, uses: int, external: bool, reward: float, advantage: float, length: float,
             entropy: float, clip: float) -> list[float]:
    """The feature vector of one row, in `FEATURES` order."""
    return [1.0, age / max_age, uses / (1 + uses), float(external), reward, advantage, length, entropy, clip]


class LinearScorer:
    """Ridge regression of the arm reward on the features, optionally with LinUCB's bonus (float64, CPU)."""

    def __init__(self, dim: int, ridge: float, alpha: float):
        # cpu: a d x d statistic, read back into Python decisions
        self.A = torch.eye(dim, dtype=torch.float64) * ridge
        self.b = torch.zeros(dim, dtype=torch.float64)  # cpu: the statistic beside A
        self.alpha = alpha

    def scores(self, X: Sequence[Sequence[float]]) -> list[float]:
        if not X:
            return []
        X_KD = torch.tensor(X, dtype=torch.float64)  # cpu: the same device as A
        A_inv = torch.linalg.inv(self.A)
        mean_K = X_KD @ (A_inv @ self.b)
        width_K = ((X_KD @ A_inv) * X_KD).sum(-1).clamp(min=0).sqrt()
        return (mean_K + self.alpha * width_K).tolist()

    def update(self, X: Sequence[Sequence[float]], reward: float) -> None:
        if X:
            X_KD = torch.tensor(X, dtype=torch.float64)  # cpu: the same device as A
            self.A += X_KD.T @ X_KD
            self.b += reward * X_KD.sum(0)

    def state_dict(self) -> dict:
        return {"A": self.A.tolist(), "b": self.b.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.A = torch.tensor(state["A"], dtype=torch.float64)  # cpu: the scorer lives on the CPU
        self.b = torch.tensor(state["b"], dtype=torch.float64)  # cpu: the scorer lives on the CPU


def select(candidates: Sequence[Candidate], scores: Sequence[float], count: int, guard: float) -> list[int]:
    """The indices of the `count` best-scored candidates (ties: source, then key), then the entropy guard's swaps."""
    order = sorted(range(len(candidates)), key=lambda i: (-scores[i], candidates[i].source, candidates[i].key))
    picked, left = order[:count], order[count:]
    if guard > 0 and picked:
        target = guard * sum(c.entropy for c in candidates) / len(candidates)
        while sum(candidates[i].entropy for i in picked) / len(picked) < target:
            low = min((i for i in picked if candidates[i].source != "external"),
                      key=lambda i: (candidates[i].entropy, candidates[i].key), default=None)
            high = max(left, key=lambda i: (candidates[i].entropy, tuple(-k for k in candidates[i].key)), default=None)
            if low is None or high is None or candidates[high].entropy <= candidates[low].entropy:
                break
            picked[picked.index(low)] = high
            left.remove(high)
            left.append(low)
    return sorted(picked)


def kept(entries: Sequence[dict], step: int, capacity: int, max_age: int) -> list[dict]:
    """The buffer after `step`: entries younger than `max_age` steps, the newest `capacity` of them (key order)."""
    young = [e for e in entries if step - e["version"] < max_age]
    newest = sorted(young, key=lambda e: (-e["version"], tuple(e["key"])))[:capacity]
    return sorted(newest, key=lambda e: tuple(e["key"]))
