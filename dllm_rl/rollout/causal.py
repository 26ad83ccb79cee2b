"""Sampling from an autoregressive (causal) LM with a KV cache: one sampling rule, with or without drafts.

Used for the external policy of ERILS and to evaluate it. The token at completion position t of a row is the
argmax at temperature 0, and otherwise the inverse CDF of softmax(logits / T) at the row's t-th uniform
(`uniform_BC`, drawn from the row's generator once per position, before anything is generated). Plain sampling
(`sample_causal`) and speculative sampling with drafts (`sample_speculative`, SRT: see rollout/speculative.py)
are the same loop, so they write the same tokens from the same seeds; drafts change only how many forwards a
rollout takes. A row's sample does not depend on its batch: left-padded prompts get positions that count real
tokens only (as `generate` does) and each row draws from its own generator.

Each forward feeds, per row, the last emitted token and up to `k` draft tokens; the logits at every fed
position give the token the model itself writes there. The drafts are accepted left to right while they equal
those tokens; the first disagreement emits the model's token instead, and a fully accepted draft emits one
more (the token after it). So every forward emits between 1 and k + 1 tokens per row. For a draft token d (a
draft from a tree is deterministic: q is a point mass on d) the draft is accepted with probability
p(d) = min(1, p(d) / q(d)) and, rejected, the emitted token is distributed as max(p - q, 0) normalised = p
restricted to the other tokens: the standard speculative accept/reject rule, realised with one uniform per
position (tests/rollout/test_speculative.py enumerates it exhaustively).

Rejected draft tokens stay in the KV cache with attention mask 0 (later tokens never attend to them), so rows
that accept different numbers of tokens share one batch. Finished rows leave the batch (and the KV cache)
where the cache can drop rows, and are filled with EOS up to `max_new_tokens`, like the dLLM's completion
window. `confidence_BC` holds the probability of each sampled token under the sampling distribution (softmax of
logits / temperature; for greedy picks, the softmax at temperature 1): the behaviour policy's per-token
probability.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from dllm_rl.errors import require
from dllm_rl.types import Samples

# (row, the row's tokens so far) -> draft tokens for what follows
Drafter = Callable[[int, list[int]], list[int]]


def cache_kwargs(model, out) -> dict:
    """The KV cache of `out`, under the keyword this transformers version expects (`cache` since 5.x,
    `past_key_values` before)."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


@torch.no_grad()
def sample_causal(model, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, *, max_new_tokens: int,
                  eos_id: int, temperature: float = 0.0,
                  generators: Sequence[torch.Generator] | None = None) -> Samples:
    """Up to `max_new_tokens` after each left-padded prompt, one token per forward (see the module docstring)."""
    return sample_speculative(model, prompt_ids_BP, prompt_mask_BP, max_new_tokens=max_new_tokens, eos_id=eos_id,
                              temperature=temperature, generators=generators)[0]


@dataclass
class SpeculativeStats:
    forwards: int = 0  # forward passes of the batch (the prompt's included)
    row_forwards: int = 0  # forwards summed over the rows still generating in each
    drafted: int = 0  # draft tokens fed for verification
    accepted: int = 0  # draft tokens the model accepted
    emitted: int = 0  # completion tokens written (up to each row's EOS)

    def add(self, other: "SpeculativeStats") -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def metrics(self) -> dict[str, float]:
        """acceptance: accepted / drafted draft tokens; tokens_per_forward: tokens each generating row wrote per
        forward (1.0 without drafts)."""
        return {"spec_acceptance": self.accepted / max(self.drafted, 1),
                "spec_tokens_per_forward": self.emitted / max(self.row_forwards, 1),
                "spec_forwards": float(self.forwards)}


def choose_tokens(logits_BKV: torch.Tensor, temperature: float,
                  uniform_BK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_BK, prob_BK): the argmax at temperature 0, else the inverse CDF of softmax(logits / T) at the
    uniform; prob is the token's probability under the sampling distribution (the softmax at T = 1 for argmax)."""
    logits64 = logits_BKV.double()
    if temperature == 0:
        token_BK = logits64.argmax(-1)
        prob_BKV = F.softmax(logits64, -1)
    else:
        prob_BKV = F.softmax(logits64 / temperature, -1)
        cdf_BKV = prob_BKV.cumsum(-1)
        # the first token whose CDF passes u (scaled by the total, which rounding may leave a hair under 1)
        target_BK1 = (uniform_BK * cdf_BKV[..., -1])[..., None]
        token_BK = torch.searchsorted(cdf_BKV, target_BK1, right=True).squeeze(-1).clamp(max=prob_BKV.shape[-1] - 1)
    return token_BK, prob_BKV.gather(-1, token_BK[..., None]).squeeze(-1)


def accepted_drafts(token_BK1: torch.Tensor, draft_BK: torch.Tensor, has_draft_BK: torch.Tensor) -> torch.Tensor:
    """accepted_B: how many leading draft tokens equal the model's own tokens at their positions."""
    agree_BK = (token_BK1[:, :-1] == draft_BK) & has_draft_BK
    return agree_BK.long().cumprod(-1).sum(-1)


def draw_uniforms(generators: Sequence[torch.Generator], n: int, device) -> torch.Tensor:
    """uniform_BC: one float64 uniform per row and completion position, from the row's generator."""
    rows = [torch.rand(n, generator=g, dtype=torch.float64, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


@torch.no_grad()
def sample_speculative(model, prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, *, max_new_tokens: int,
                       eos_id: int, temperature: float = 0.0, generators: Sequence[torch.Generator] | None = None,
                       drafter: Drafter | None = None, draft_tokens: int = 0,
                       uniform_BC: torch.Tensor | None = None) -> tuple[Samples, SpeculativeStats]:
    """Sample up to `max_new_tokens` after each left-padded prompt (see the module docstring); `drafter(row,
    tokens)` proposes up to `draft_tokens` tokens (0 or no drafter: one token per forward). `uniform_BC`
    replaces the draws from `generators`. Rows are filled with EOS after their first EOS; finished rows leave the
    batch (and the KV cache) where the cache can drop rows."""
    B, C, device = prompt_ids_BP.shape[0], max_new_tokens, prompt_ids_BP.device
    require(C > 0, f"max_new_tokens must be positive, got {C}")
    if temperature > 0 and uniform_BC is None:
        require(generators is not None and len(generators) == B,
                f"sampling at temperature={temperature} needs one torch.Generator per row ({B})")
        uniform_BC = draw_uniforms(generators, C, device)
    mask_RL = prompt_mask_BP.long()  # R: the rows in the model's batch (`live`), finished ones dropped
    next_pos_R = mask_RL.sum(-1)  # the position of the next token fed (the first emitted one)
    out = model(input_ids=prompt_ids_BP, attention_mask=mask_RL,
                position_ids=(mask_RL.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    stats = SpeculativeStats(forwards=1, row_forwards=B)
    tokens: list[list[int]] = [[] for _ in range(B)]
    probs: list[list[float]] = [[] for _ in range(B)]
    first_R1 = None if uniform_BC is None else uniform_BC[:, :1]
    token_R1, prob_R1 = choose_tokens(out.logits[:, -1:], temperature, first_R1)
    live = list(range(B))
    active = emit(tokens, probs, token_R1, prob_R1, [0] * B, live, eos_id, C)
    while active:
        cache = next(iter(cache_kwargs(model, out).values()))
        if len(active) < len(live) and hasattr(cache, "batch_select_indices"):
            keep_R = torch.tensor([live.index(b) for b in active], device=device)
            cache.batch_select_indices(keep_R)
            mask_RL, next_pos_R, live = mask_RL[keep_R], next_pos_R[keep_R], active
        R = len(live)
        drafts = [draft_for(drafter, b, tokens[b], draft_tokens, C) if b in active else [] for b in live]
        K = max(len(d) for d in drafts)
        padded = [d + [eos_id] * (K - len(d)) for d in drafts]
        draft_RK = torch.tensor(padded, dtype=torch.long, device=device).view(R, K)
        lengths_R1 = torch.tensor([[len(d)] for d in drafts], device=device)
        has_draft_RK = torch.arange(K, device=device)[None] < lengths_R1
        last_R = torch.tensor([tokens[b][-1] for b in live], dtype=torch.long, device=device)
        mask_RL = torch.cat([mask_RL, torch.ones((R, K + 1), dtype=torch.long, device=device)], 1)
        out = model(input_ids=torch.cat([last_R[:, None], draft_RK], 1), attention_mask=mask_RL,
                    position_ids=next_pos_R[:, None] + torch.arange(K + 1, device=device), use_cache=True,
                    **cache_kwargs(model, out))
        uniform_RK1 = None
        if uniform_BC is not None:  # row b's positions len(tokens[b]) + i; past the window: unused, clamped
            written_R1 = torch.tensor([[len(tokens[b])] for b in live], device=device)
            uniform_RK1 = uniform_BC[torch.tensor(live, device=device)].gather(
                1, (written_R1 + torch.arange(K + 1, device=device)).clamp(max=C - 1))
        token_RK1, prob_RK1 = choose_tokens(out.logits, temperature, uniform_RK1)
        accepted_R = accepted_drafts(token_RK1, draft_RK, has_draft_RK)
        # the cache keeps the fed last token and the accepted drafts; the rest is masked out for later tokens
        is_active_R = torch.tensor([b in active for b in live], device=device)
        keep_RK1 = torch.arange(K + 1, device=device)[None] <= accepted_R[:, None]
        mask_RL[:, -(K + 1):] = (keep_RK1 & is_active_R[:, None]).long()
        next_pos_R = next_pos_R + accepted_R + 1
        stats.forwards += 1
        stats.row_forwards += len(active)
        stats.drafted += sum(len(d) for d in drafts)
        stats.accepted += int(accepted_R[is_active_R].sum())
        active = emit(tokens, probs, token_RK1, prob_RK1, accepted_R.tolist(), live, eos_id, C, active)
    stats.emitted = sum(len(t) for t in tokens)
    return to_samples(prompt_ids_BP, prompt_mask_BP, tokens, probs, eos_id, C), stats


def draft_for(drafter: Drafter | None, row: int, tokens: list[int], k: int, budget: int) -> list[int]:
    """The row's draft, cut to what the window still holds after the token each forward adds."""
    if drafter is None or k == 0:
        return []
    return list(drafter(row, tokens))[: min(k, budget - len(tokens) - 1)]


def emit(tokens, probs, token_RK, prob_RK, accepted_R, live, eos_id: int, C: int, active=None) -> list[int]:
    """Append to each active row (`live[i]` is the row of batch entry i) its accepted tokens and the model's next
    one, up to its EOS and the window's end; returns the rows still generating."""
    token_rows, prob_rows = token_RK.tolist(), prob_RK.float().tolist()
    active = set(live if active is None else active)
    still = []
    for i, b in enumerate(live):
        if b not in active:
            continue
        for j in range(int(accepted_R[i]) + 1):
            tokens[b].append(token_rows[i][j])
            probs[b].append(prob_rows[i][j])
            if token_rows[i][j] == eos_id or len(tokens[b]) == C:
                break
        if tokens[b][-1] != eos_id and len(tokens[b]) < C:
            still.append(b)
    return still


def to_samples(prompt_ids_BP, prompt_mask_BP, tokens, probs, eos_id: int, C: int) -> Samples:
    """The rows as `Samples`: EOS fill after each row's end, confidence 1 there, steps = positions."""
    device = prompt_ids_BP.device
    B = len(tokens)
    completion_BC = torch.tensor([t + [eos_id] * (C - len(t)) for t in tokens], dtype=torch.long, device=device)
    confidence_BC = torch.tensor([p + [1.0] * (C - len(p)) for p in probs], dtype=torch.float32, device=device)
    steps_BC = torch.arange(C, device=device).expand(B, -1).clone()
    return Samples(torch.cat([prompt_ids_BP, completion_BC], 1),
                   torch.cat([prompt_mask_BP.long(), torch.ones_like(completion_BC)], 1), prompt_ids_BP.shape[1],
                   steps_BC, confidence_BC)
