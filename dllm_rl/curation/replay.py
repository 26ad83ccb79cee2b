"""Replayed rows as a source of the step (`rows["replay"]`), beside the on-policy and the external rows.

The contextual rollout bandit (dllm_rl/curation/bandit.py, its state in `teach.Bandit`) decides which rows reach
the loss, among the step's own and the entries of its replay buffer; this module holds what a buffer entry is
(`entry_of`: plain values, saved with checkpoints) and the stage that turns the step's picked entries into rows
(`ReplaySource`): each row with its provenance (the key of the rollout it was, its source "on_policy" and the
policy version that made it, `Rows.version_N`), its stored advantage and mask seeds, scored by the on-policy
estimator. The picks are global (the same list on every rank); pick i goes to rank i % world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dllm_rl.buffer import Rows
from dllm_rl.data.task import Reward
from dllm_rl.rollout.sampler import left_pad


def clip_of(rows: Rows, n: int) -> float:
    """Row n's clip fraction over the step's updates (0 where it was not trained on)."""
    if rows.clip_counts_N2 is None or float(rows.clip_counts_N2[n, 1]) == 0:
        return 0.0
    return float(rows.clip_counts_N2[n, 0] / rows.clip_counts_N2[n, 1])


def entry_of(rows: Rows, n: int, used: bool) -> dict:
    """A replay buffer entry (plain values) of on-policy row n: what scoring it again takes, and its record."""
    prompt = rows.ids_NL[n, : rows.prompt_length][rows.attention_mask_NL[n, : rows.prompt_length] != 0]
    r = rows.rewards[n]
    return {"key": list(rows.keys[n]), "version": rows.version, "prompt": prompt.tolist(),
            "window": rows.ids_NL[n, rows.prompt_length:].tolist(), "mask": rows.mask_NC[n].tolist(),
            "order": rows.order_NC[n].tolist(), "sampler_logp": rows.sampler_logp_NC[n].tolist(),
            "entropy": rows.entropy_NC[n].tolist(), "reward": [r.score, r.correct, r.formatted, r.reason],
            "text": rows.texts[n], "adv": float(rows.adv_N[n]), "uses": int(used),
            "clip": clip_of(rows, n) if used else 0.0, "seeds": [s[n] for s in rows.mask_seeds]}


def replay_rows(entries: list[dict], estimator: Any, pad_id: int, device: torch.device) -> Rows:
    """Buffer entries as a "replay" source: prompts left-padded, each row's window, mask, sampler record, stored
    advantage, reward and mask seeds; `version` the oldest, `version_N` each row's."""
    ids_NP, mask_NP = left_pad([e["prompt"] for e in entries], pad_id, device)
    window_NC = torch.tensor([e["window"] for e in entries], dtype=torch.long, device=device)
    floats = lambda name: torch.tensor([e[name] for e in entries], dtype=torch.float32, device=device)  # noqa: E731
    longs = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    rows = Rows("replay", torch.cat([ids_NP, window_NC], 1), torch.cat([mask_NP, torch.ones_like(window_NC)], 1),
                ids_NP.shape[1], floats("mask"), longs([e["order"] for e in entries]), longs([0] * len(entries)),
                [Reward(*e["reward"]) for e in entries], [e["text"] for e in entries],
                version=min(e["version"] for e in entries), estimator=estimator,
                sampler_logp_NC=floats("sampler_logp"), entropy_NC=floats("entropy"), adv_N=floats("adv"),
                weight_N=torch.ones(len(entries), device=device),
                prompt_id_N=longs([e["key"][0] for e in entries]), rollout_N=longs([e["key"][1] for e in entries]),
                version_N=longs([e["version"] for e in entries]))
    rows.mask_seeds = [[e["seeds"][it] for e in entries] for it in range(len(entries[0]["seeds"]))]
    return rows


@dataclass
class ReplaySource:
    """The replay stage: this rank's share of the entries the step's curation picked for replay, as
    `rows["replay"]` (none where it has no share)."""

    curation: Any  # a Curation: its `replayed()` are the step's picked entries, in the same order on every rank
    estimator: Any  # the on-policy estimator
    pad_id: int
    rank: int
    world: int

    def __call__(self, batch) -> None:
        mine = self.curation.replayed()[self.rank::self.world]
        if mine:
            batch.rows["replay"] = replay_rows(mine, self.estimator, self.pad_id, batch.rows["on_policy"].ids_NL.device)
