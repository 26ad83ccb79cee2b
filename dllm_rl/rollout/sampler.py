"""The denoising sampler: LLaDA's semi-autoregressive low-confidence remasking, batched and reproducible.

Semantics of LLaDA's reference `generate` (arXiv 2502.09992, Appendix B): the completion window of
`gen_length` masks is split into blocks of `block_length` filled left to right; each block gets
`steps / num_blocks` steps; at each step the model predicts every masked token (Gumbel-max sampling at
`temperature`, noise drawn in float64 because low-precision Gumbel noise collapses the distribution's
tail), and the `k` predictions with the highest confidence (low-confidence remasking) or `k` random ones
(random remasking) are kept, `k` following the masking schedule. Optional classifier-free guidance runs
the prompt-masked batch alongside: logits = uncond + (scale + 1) * (cond - uncond).

How it departs from the reference:
- Gumbel-max is written as argmax(logits - T * log(-log u)), which picks the same token as LLaDA's
  exp(logits) / (-log u)^T without overflowing exp for large logits.
- Randomness comes from one `torch.Generator` per row, drawn from only at the row's own steps, so a row's
  sample does not depend on which other rows share its batch (the batched sampler equals a per-row loop, with
  parallel decoding too, where a row that finished its block waits for the others; evaluation does not depend
  on batch size).
- Prompts are left-padded with an attention mask (LLaDA's reference takes one unpadded prompt).
- The mask token is excluded from the predictions (an untrained or RL-drifted model may otherwise
  "unmask" a position into the mask token).
- It records, for each completion token, the step at which it was unmasked, its probability among the tokens
  it could commit (the confidence low-confidence remasking ranks by) and its log-probability under the policy:
  temperature 1 and the whole vocabulary, the mask token included, which is exactly what the `ordered` estimator
  scores the token by (the tokens of earlier steps revealed, the rest masked), whatever temperature it sampled
  at. With the exact sampler (no block cache, or one refreshed every step; no classifier-free guidance, whose
  logits are not the policy's) the recorded log-probs are the ordered likelihood of the rollout, which the trainer
  then takes as the old policy's instead of scoring it again (`likelihood.estimators.replays_rollout`). And the
  entropy of the distribution each token was committed from (temperature 1, the mask token excluded: the one the
  confidence is taken from), which EchoRL's step entropy averages (dllm_rl/curation/echo.py). A step
  counts for a row when the row still had masked tokens in the block being decoded: with parallel decoding a row
  that finished its block early waits for the others without counting, so its steps (what the `ordered`
  estimator scores by) do not depend on the rows batched with it.

Faster decoding (Fast-dLLM, arXiv 2505.22618), each off by default, so the default is the exact sampler:
- `threshold` / `factor`: confidence-parallel commits (`parallel_commits`), as many steps per block as needed;
- `cache="prefix"` / `"dual"`: a block cache (`policy.modeling.BlockCache`), refreshed by a full forward at the
  start of every block (and every `cache_refresh` steps inside it, where that is > 0); between refreshes each
  step runs the current block and what follows it (prefix) or the current block alone (dual). Approximate:
  the cached keys and values miss the block's newest tokens. `cache_refresh=1` refreshes every step: exact.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dllm_rl.errors import ConfigError, check_ranges, check_types, require
from dllm_rl.policy.adapters import DiffusionPolicy
from dllm_rl.policy.modeling import BlockCache
from dllm_rl.policy.schedule import MaskingSchedule
from dllm_rl.types import Samples

REMASKING = ("low_confidence", "random")
CACHE_MODES = ("none", "prefix", "dual")


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BP, attention_mask_BP) on `device`, with every row right-aligned."""
    width = max(len(s) for s in sequences)
    ids = [[pad_id] * (width - len(s)) + list(s) for s in sequences]
    real = [[0] * (width - len(s)) + [1] * len(s) for s in sequences]
    return (torch.tensor(ids, dtype=torch.long, device=device).view(len(sequences), width),
            torch.tensor(real, dtype=torch.long, device=device).view(len(sequences), width))


def check_sampler_settings(gen_length: int = 64, block_length: int = 32, steps: int = 64, temperature: float = 0.0,
                           remasking: str = "low_confidence", cfg_scale: float = 0.0, threshold: float | None = None,
                           factor: float | None = None, random_first: bool = False, cache: str = "none",
                           cache_refresh: int = 0, temperature_floor: float = 0.0, key: str = "rollout") -> int:
    """The sampler's settings by name, type and range, before any model is loaded (`key` prefixes the names in
    errors); returns the number of blocks."""
    check_types(check_sampler_settings, dict(gen_length=gen_length, block_length=block_length, steps=steps,
                                             temperature=temperature, remasking=remasking, cfg_scale=cfg_scale,
                                             threshold=threshold, factor=factor, random_first=random_first,
                                             cache=cache, cache_refresh=cache_refresh,
                                             temperature_floor=temperature_floor), key)
    require(remasking in REMASKING, f"{key}.remasking must be one of {REMASKING}, got {remasking!r}")
    require(cache in CACHE_MODES, f"{key}.cache must be one of {CACHE_MODES}, got {cache!r}")
    require(cache_refresh >= 0, f"{key}.cache_refresh={cache_refresh}: expected >= 0 (0: at the start of every "
            f"block only; n: also every n steps inside a block; 1: every step, exact)")
    require(cache_refresh == 0 or cache != "none", f"{key}.cache_refresh={cache_refresh} refreshes a block cache, "
            f"and {key}.cache=none has none: set {key}.cache=prefix or dual, or {key}.cache_refresh=0")
    check_ranges(dict(gen_length=gen_length, block_length=block_length, steps=steps), dict.fromkeys(
        ("gen_length", "block_length", "steps"), "at_least_1"), key)
    check_ranges(dict(temperature=temperature, cfg_scale=cfg_scale, factor=factor, temperature_floor=temperature_floor),
                 dict.fromkeys(("temperature", "cfg_scale", "temperature_floor"), "non_negative")
                 | {"factor": "positive"}, key)
    require(threshold is None or (0 < threshold <= 1),
            f"{key}.threshold={threshold!r}: expected a probability in (0, 1] (or null: the fixed schedule)")
    require(threshold is None or factor is None,
            f"{key}.threshold and {key}.factor are two rules for parallel decoding; set one of them")
    require((threshold is None and factor is None) or remasking == "low_confidence",
            f"{key}.threshold / {key}.factor commit the most confident tokens: they need "
            f"{key}.remasking=low_confidence, got {remasking!r} (or {key}.threshold=null {key}.factor=null: the "
            f"fixed schedule)")
    require(gen_length % block_length == 0,
            f"gen_length={gen_length} must be a multiple of block_length={block_length}")
    num_blocks = gen_length // block_length
    require(steps % num_blocks == 0,
            f"steps={steps} must be divisible by the number of blocks gen_length/block_length={num_blocks}")
    return num_blocks


def check_sampler_args(prompt_length: int, max_length: int | None, **settings) -> int:
    """Validate the settings and the context they need for a prompt of `prompt_length`; returns the number of
    blocks."""
    num_blocks = check_sampler_settings(**settings)
    gen_length = settings["gen_length"]
    require(max_length is None or prompt_length + gen_length <= max_length,
            f"prompt of {prompt_length} tokens + gen_length={gen_length} exceeds the model's context of {max_length}")
    return num_blocks


def guided_logits(policy: DiffusionPolicy, x_BL, attention_mask_BL, is_prompt_BL, cfg_scale: float, cache=None):
    if cfg_scale == 0:
        return policy.logits(x_BL, attention_mask_BL, cache)
    uncond_BL = x_BL.masked_fill(is_prompt_BL, policy.mask_id)
    both = policy.logits(torch.cat([x_BL, uncond_BL]), torch.cat([attention_mask_BL, attention_mask_BL]), cache)
    cond, uncond = both.chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)


def row_uniforms(generators, shape: tuple[int, ...], active_B: torch.Tensor, device) -> torch.Tensor:
    """Float64 uniforms of `shape` per row, drawn from the row's generator only where the row is active (0.5
    elsewhere): a row that waits for its batch draws nothing, so its later draws do not depend on its batch."""
    rows = [torch.rand(shape, generator=g, dtype=torch.float64, device=g.device).to(device) if active else
            torch.full(shape, 0.5, dtype=torch.float64, device=device)
            for g, active in zip(generators, active_B.tolist())]
    return torch.stack(rows)


def gumbel_argmax(logits_BCV: torch.Tensor, temperature: float, generators,
                  active_B: torch.Tensor | None = None) -> torch.Tensor:
    """Logits must already exclude the mask token (see `denoise`); only `active_B` rows draw noise (all: None)."""
    logits64 = logits_BCV.double()
    if temperature == 0:
        return logits64.argmax(-1)
    if active_B is None:
        active_B = torch.ones(logits_BCV.shape[0], dtype=torch.bool, device=logits_BCV.device)
    u = row_uniforms(generators, tuple(logits_BCV.shape[1:]), active_B, logits64.device)
    # Guard u == 0 (log(-log 0) = log(inf)): such a draw would be chosen with certainty anyway.
    gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (logits64 + temperature * gumbel).argmax(-1)


def parallel_commits(prob_BC: torch.Tensor, eligible_BC: torch.Tensor, threshold: float | None,
                     factor: float | None) -> torch.Tensor:
    """Which eligible positions to commit in one step of parallel decoding (Fast-dLLM, arXiv 2505.22618):
    every one whose confidence reaches `threshold`, or, by the factor rule, the n most confident where n is the
    largest with (n + 1)(1 - c_n) < `factor` (c_n the n-th highest confidence). Always at least the most
    confident one of a row that has any, so decoding always progresses."""
    confidence_BC = prob_BC.masked_fill(~eligible_BC, -1.0)
    if threshold is not None:
        chosen_BC = eligible_BC & (prob_BC >= threshold)
    else:
        sorted_BC, order_BC = confidence_BC.sort(dim=-1, descending=True, stable=True)
        rank_C = torch.arange(1, prob_BC.shape[1] + 1, device=prob_BC.device, dtype=prob_BC.dtype)
        count_B1 = ((rank_C + 1) * (1 - sorted_BC) < factor).logical_and(sorted_BC >= 0).sum(-1, keepdim=True)
        chosen_BC = torch.zeros_like(eligible_BC).scatter(1, order_BC, rank_C[None].long() <= count_B1)
    top_B = confidence_BC.argmax(-1)
    any_B = eligible_BC.any(-1)
    chosen_BC[any_B, top_B[any_B]] = True
    return chosen_BC & eligible_BC


def random_commit(eligible_BC: torch.Tensor, generators) -> torch.Tensor:
    """One eligible position per row, uniformly at random from the row's generator (single-step random
    initialisation: the first commit of a rollout is not the most confident one, which keeps parallel
    decoding exploring)."""
    u_BC = row_uniforms(generators, (eligible_BC.shape[1],), eligible_BC.any(-1), eligible_BC.device)
    pick_B = u_BC.masked_fill(~eligible_BC, -1.0).argmax(-1)
    chosen_BC = torch.zeros_like(eligible_BC)
    chosen_BC[torch.arange(len(pick_B), device=pick_B.device), pick_B] = True
    return chosen_BC & eligible_BC


@torch.no_grad()
def denoise(
    policy: DiffusionPolicy,
    prompt_ids_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor | None = None,
    *,
    gen_length: int = 64,
    block_length: int = 32,
    steps: int = 64,
    temperature: float = 0.0,
    remasking: str = "low_confidence",
    cfg_scale: float = 0.0,
    threshold: float | None = None,
    factor: float | None = None,
    random_first: bool = False,
    cache: str = "none",
    cache_refresh: int = 0,
    temperature_floor: float = 0.0,
    generators: Sequence[torch.Generator] | None = None,
    schedule: MaskingSchedule | None = None,
    max_length: int | None = None,
) -> Samples:
    """Fill a window of `gen_length` masks after each prompt; see the module docstring. With `threshold` or
    `factor` each block takes as many steps as its confident tokens allow (`steps` is not used; at most
    `block_length` per block); `random_first` commits one random position per row at the first step; `cache`
    decodes with a block cache; `temperature_floor` is the lowest temperature it samples at."""
    B, P = prompt_ids_BP.shape
    settings = dict(gen_length=gen_length, block_length=block_length, steps=steps, temperature=temperature,
                    remasking=remasking, cfg_scale=cfg_scale, threshold=threshold, factor=factor,
                    random_first=random_first, cache=cache, cache_refresh=cache_refresh,
                    temperature_floor=temperature_floor)
    num_blocks = check_sampler_args(P, max_length, **settings)
    temperature = max(temperature, temperature_floor)
    check_generators(generators, B, temperature, remasking, random_first)
    schedule = schedule or MaskingSchedule()
    parallel = threshold is not None or factor is not None
    steps_per_block = steps // num_blocks
    device = prompt_ids_BP.device
    if prompt_mask_BP is None:
        prompt_mask_BP = torch.ones_like(prompt_ids_BP)
    mask_id = policy.mask_id
    x_BL = torch.cat([prompt_ids_BP, torch.full((B, gen_length), mask_id, dtype=torch.long, device=device)], 1)
    attention_mask_BL = torch.cat([prompt_mask_BP.long(), torch.ones_like(x_BL[:, P:])], 1)
    is_prompt_BL = torch.zeros_like(x_BL, dtype=torch.bool)
    is_prompt_BL[:, :P] = prompt_mask_BP.bool()
    unmask_step_BC = torch.full((B, gen_length), -1, dtype=torch.long, device=device)
    confidence_BC, logp_BC, entropy_BC = torch.zeros((3, B, gen_length), dtype=torch.float32, device=device)
    step = 0
    row_step_B = torch.zeros(B, dtype=torch.long, device=device)  # each row's own count of its decoding steps
    block_cache = None if cache == "none" else BlockCache()
    for block in range(num_blocks):
        lo, hi = block * block_length, (block + 1) * block_length
        in_block_C = torch.zeros(gen_length, dtype=torch.bool, device=device)
        in_block_C[lo:hi] = True
        num_masked_B = (x_BL[:, P + lo : P + hi] == mask_id).sum(-1)
        transfer_BS = schedule.num_transfer_tokens(num_masked_B, steps_per_block).to(device)
        if random_first and step == 0:
            transfer_BS = first_step_takes_one(transfer_BS)
        for i in range(block_length if parallel else steps_per_block):
            window_BC = x_BL[:, P:]
            eligible_BC = (window_BC == mask_id) & in_block_C  # masked tokens of the current block compete
            active_B = eligible_BC.any(-1)  # a row whose block is done waits: it draws nothing, counts no step
            if parallel and not active_B.any():
                break
            refresh = block_cache is None or i == 0 or (cache_refresh > 0 and i % cache_refresh == 0)
            span = None if refresh else (P + lo, x_BL.shape[1] if cache == "prefix" else P + hi)
            logits_BCV, mask_logit_BC = window_logits(policy, x_BL, attention_mask_BL, is_prompt_BL, cfg_scale, P,
                                                      block_cache, span)
            x0_BC = gumbel_argmax(logits_BCV, temperature, generators, active_B=active_B)
            prob_BC = F.softmax(logits_BCV.double(), dim=-1).gather(-1, x0_BC[..., None]).squeeze(-1)
            chosen_BC = step_commits(prob_BC, eligible_BC, transfer_BS[:, i : i + 1], random_first and step == 0,
                                     threshold, factor, remasking, generators)
            x_BL[:, P:] = torch.where(chosen_BC, x0_BC, window_BC)
            unmask_step_BC = torch.where(chosen_BC, row_step_B[:, None], unmask_step_BC)
            row_step_B += active_B.long()
            confidence_BC[chosen_BC] = prob_BC[chosen_BC].float()
            logp_BC[chosen_BC] = policy_logp(logits_BCV, mask_logit_BC, x0_BC)[chosen_BC].float()
            entropy_BC[chosen_BC] = entropy(logits_BCV[chosen_BC]).float()
            step += 1
    return Samples(x_BL, attention_mask_BL, P, unmask_step_BC, confidence_BC, forwards=step * (2 if cfg_scale else 1),
                   logp_BC=logp_BC, entropy_BC=entropy_BC)


def check_generators(generators, B: int, temperature: float, remasking: str, random_first: bool) -> None:
    """A sampler that draws randomness needs one generator per row."""
    if temperature > 0 or remasking == "random" or random_first:
        if generators is None or len(generators) != B:
            raise ConfigError(f"sampling with temperature={temperature}, remasking={remasking!r}, random_first="
                              f"{random_first} needs one torch.Generator per row ({B}), got "
                              f"{None if generators is None else len(generators)}")


def window_logits(policy, x_BL, attention_mask_BL, is_prompt_BL, cfg_scale: float, P: int,
                  block_cache: BlockCache | None, span: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits_BCV, mask_logit_BC): the completion window's logits, the mask token excluded (LLaDA relies on a
    trained model never predicting it), and the mask token's logit as it was (what the policy's log-probability
    is normalised with). With a block cache: a refresh (`span` None: every position, the cache rewritten) or a
    forward of `span` alone, placed at its positions (the others get zeros: they are outside the current
    block, so nothing is committed there)."""
    if block_cache is not None:
        block_cache.span = span
    out_BSV = guided_logits(policy, x_BL, attention_mask_BL, is_prompt_BL, cfg_scale, block_cache)
    if span is None:
        logits_BCV = out_BSV[:, P:].clone()
    else:
        logits_BCV = out_BSV.new_zeros(x_BL.shape[0], x_BL.shape[1] - P, out_BSV.shape[-1])
        logits_BCV[:, span[0] - P:span[1] - P] = out_BSV
    mask_logit_BC = logits_BCV[..., policy.mask_id].clone()
    logits_BCV[..., policy.mask_id] = float("-inf")
    return logits_BCV, mask_logit_BC


def policy_logp(logits_BCV: torch.Tensor, mask_logit_BC: torch.Tensor, token_BC: torch.Tensor) -> torch.Tensor:
    """log p(token) under the policy at temperature 1 over the whole vocabulary: `logits_BCV` with the mask
    token excluded (-inf), its logit given apart (float64)."""
    logits64 = logits_BCV.double()
    log_norm_BC = torch.logaddexp(logits64.logsumexp(-1), mask_logit_BC.double())
    return logits64.gather(-1, token_BC[..., None]).squeeze(-1) - log_norm_BC


def entropy(logits_KV: torch.Tensor) -> torch.Tensor:
    """entropy_K of softmax(logits) per row, in nats (float64; -inf logits, the excluded mask token, count 0)."""
    logp_KV = F.log_softmax(logits_KV.double(), dim=-1)
    return -(logp_KV.exp() * logp_KV.nan_to_num(neginf=0.0)).sum(-1)


def step_commits(prob_BC: torch.Tensor, eligible_BC: torch.Tensor, transfer_B1: torch.Tensor, random: bool,
                 threshold: float | None, factor: float | None, remasking: str, generators) -> torch.Tensor:
    """The positions one step commits: by the parallel rule, or the schedule's `transfer_B1` by `remasking`.
    With `random` (the first step under `random_first`) one random position is the first commit: parallel
    decoding commits it alone, the schedule counts it among the step's commits."""
    parallel = threshold is not None or factor is not None
    chosen_BC = torch.zeros_like(eligible_BC)
    if random:
        chosen_BC = random_commit(eligible_BC, generators)
        eligible_BC = torch.zeros_like(eligible_BC) if parallel else eligible_BC & ~chosen_BC
    if parallel:
        return chosen_BC | parallel_commits(prob_BC, eligible_BC, threshold, factor)
    count_B1 = transfer_B1 - chosen_BC.sum(-1, keepdim=True)
    return chosen_BC | scheduled_commits(prob_BC, eligible_BC, count_B1, remasking, generators)


def first_step_takes_one(transfer_BS: torch.Tensor) -> torch.Tensor:
    """The block's schedule with at least one commit at its first step (the single-step random initialisation
    takes it): a row whose schedule gives the first step none (a cosine schedule can) moves one from its first
    step that has some, so every row still commits exactly its masked tokens."""
    out_BS = transfer_BS.clone()
    empty_B = out_BS[:, 0] == 0
    if bool(empty_B.any()):
        donor_B = (out_BS > 0).int().argmax(-1)
        rows_B = empty_B.nonzero().squeeze(-1)
        out_BS[rows_B, donor_B[rows_B]] -= 1
        out_BS[rows_B, 0] = 1
    return out_BS


def scheduled_commits(prob_BC: torch.Tensor, eligible_BC: torch.Tensor, transfer_B1: torch.Tensor, remasking: str,
                      generators) -> torch.Tensor:
    """LLaDA's rule: the k eligible positions with the highest confidence (or random scores), k from the
    masking schedule."""
    if remasking == "low_confidence":
        score_BC = prob_BC.clone()
    else:
        score_BC = row_uniforms(generators, (prob_BC.shape[1],), eligible_BC.any(-1), prob_BC.device)
    score_BC = score_BC.masked_fill(~eligible_BC, float("-inf"))
    ranks_BC = score_BC.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
    return ranks_BC < transfer_B1


def first_eos(completion_BC: torch.Tensor, eos_id: int | None) -> torch.Tensor:
    """lengths_B: the index of each row's first EOS, or C where it has none (the tokens before the EOS)."""
    is_eos_BC = completion_BC == eos_id if eos_id is not None else torch.zeros_like(completion_BC, dtype=torch.bool)
    C = completion_BC.shape[1]
    # argmax returns the first maximal index; rows without an EOS have no 1 and get C
    return torch.where(is_eos_BC.any(-1), is_eos_BC.int().argmax(-1),
                       torch.full_like(is_eos_BC[:, 0], C, dtype=torch.long))


def completion_mask(completion_BC: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1.0 on completion tokens up to and including the first EOS (the EOS fill after it does not count)."""
    lengths_B1 = first_eos(completion_BC, eos_id)[:, None]
    return (torch.arange(completion_BC.shape[1], device=completion_BC.device) <= lengths_B1).float()


def completion_texts(tokenizer, completion_BC: torch.Tensor, eos_id: int | None) -> list[str]:
    """Decode each completion up to (not including) its first EOS; special tokens are dropped."""
    lengths = first_eos(completion_BC, eos_id).tolist()
    return [tokenizer.decode(row[:n], skip_special_tokens=True) for row, n in zip(completion_BC.tolist(), lengths)]
