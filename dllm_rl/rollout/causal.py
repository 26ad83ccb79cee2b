"""Sampling from an autoregressive (causal) LM with a KV cache, one torch.Generator per row.

Used for the external policy and to evaluate it. Left-padded prompts get positions that count real tokens
only (as `generate` does), so a row's sample does not depend on its batch. Finished rows are filled with
EOS up to `max_new_tokens`, like the dLLM's completion window. `confidence_BC` holds the probability of
each sampled token under the sampling distribution (softmax of logits / temperature; for greedy picks,
the softmax at temperature 1): the behaviour policy's per-token probability.
"""

from __future__ import annotations

import inspect
from typing import Sequence

import torch
import torch.nn.functional as F

from dllm_rl.errors import require
from dllm_rl.types import Samples


def cache_kwargs(model, out) -> dict:
    """The KV cache of `out`, under the keyword this transformers version expects (`cache` since 5.x,
    `past_key_values` before)."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out.cache}
    return {"past_key_values": out.past_key_values}


@torch.no_grad()
def sample_causal(
    model,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_id: int,
    temperature: float = 0.0,
    generators: Sequence[torch.Generator] | None = None,
) -> Samples:
    B, P = prompt_ids_BP.shape
    require(max_new_tokens > 0, f"max_new_tokens must be positive, got {max_new_tokens}")
    require(temperature == 0 or (generators is not None and len(generators) == B),
            f"sampling at temperature={temperature} needs one torch.Generator per row ({B})")
    device = prompt_ids_BP.device
    mask_BL = prompt_mask_BP.long()
    positions_BL = (mask_BL.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=prompt_ids_BP, attention_mask=mask_BL, position_ids=positions_BL, use_cache=True)
    next_pos_B1 = positions_BL[:, -1:] + 1
    tokens, probs = [], []
    done_B = torch.zeros(B, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        logits_BV = out.logits[:, -1].double()
        if temperature == 0:
            token_B = logits_BV.argmax(-1)
            prob_BV = F.softmax(logits_BV, -1)
        else:
            prob_BV = F.softmax(logits_BV / temperature, -1)
            token_B = torch.cat([torch.multinomial(prob_BV[j], 1, generator=g) for j, g in enumerate(generators)])
        prob_B = prob_BV.gather(-1, token_B[:, None]).squeeze(-1)
        token_B = token_B.masked_fill(done_B, eos_id)
        tokens.append(token_B)
        probs.append(prob_B.masked_fill(done_B, 1.0).float())
        done_B = done_B | (token_B == eos_id)
        if bool(done_B.all()):
            break
        mask_BL = torch.cat([mask_BL, torch.ones((B, 1), dtype=torch.long, device=device)], 1)
        out = model(input_ids=token_B[:, None], attention_mask=mask_BL, position_ids=next_pos_B1,
                    use_cache=True, **cache_kwargs(model, out))
        next_pos_B1 = next_pos_B1 + 1
    completion_BC = torch.full((B, max_new_tokens), eos_id, dtype=torch.long, device=device)
    confidence_BC = torch.ones((B, max_new_tokens), dtype=torch.float32, device=device)
    completion_BC[:, : len(tokens)] = torch.stack(tokens, 1)
    confidence_BC[:, : len(probs)] = torch.stack(probs, 1)
    steps_BC = torch.arange(max_new_tokens, device=device).expand(B, -1).clone()
    return Samples(torch.cat([prompt_ids_BP, completion_BC], 1),
                   torch.cat([prompt_mask_BP.long(), torch.ones_like(completion_BC)], 1), P, steps_BC, confidence_BC)
