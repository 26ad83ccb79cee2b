"""Properties every denoising rollout must have, over a grid of sampler settings on a random-logit policy:
every window position is committed exactly once (it goes from the mask to a token at one step and never
changes after), no mask remains, the prompt is never touched, and every recorded unmask step is the row's own
count of steps before the one that committed the position (steps at which the row still had masks in the block
being decoded), within the steps the rollout took.

The policy is the tiny random dLLM with its logits scaled (x1: near-uniform predictions, so parallel rules
commit one token at a time; x8: confident ones, so they commit many), wrapped to record the window it is asked
about at every forward: the states between steps, from which each position's commit step is read off."""

import itertools
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from dllm_rl.policy.adapters import DiffusionPolicy
from dllm_rl.policy.schedule import MaskingSchedule
from dllm_rl.rollout.sampler import denoise, first_step_takes_one, left_pad
from dllm_rl.seeds import row_generators


class Recording(nn.Module):
    """The network with its logits scaled; `inputs` collects each forward's (conditional) input ids."""

    def __init__(self, net: nn.Module, scale: float):
        super().__init__()
        self.net, self.scale, self.inputs = net, scale, []

    @property
    def config(self):
        return self.net.config

    def forward(self, input_ids, attention_mask=None, block_cache=None):
        self.inputs.append(input_ids.clone())
        extra = {} if block_cache is None else {"block_cache": block_cache}
        return SimpleNamespace(logits=self.net(input_ids=input_ids, attention_mask=attention_mask, **extra).logits
                               * self.scale)


WINDOWS = [(16, 16, 16), (16, 8, 4), (24, 8, 6), (16, 4, 16), (12, 4, 3), (8, 8, 16), (16, 8, 2)]
RULES = [{}, {"threshold": 0.5}, {"threshold": 0.95}, {"factor": 1.0}, {"factor": 3.0}]
CACHES = [("none", 0), ("prefix", 0), ("prefix", 2), ("dual", 0), ("dual", 1), ("dual", 3)]
SCHEDULES = [("linear", 1.0), ("cosine", 1.0), ("polynomial", 2.0), ("polynomial", 0.25)]
GRID = list(itertools.product(WINDOWS, RULES, [False, True], CACHES, [0.0, 0.7, 1.5], ["low_confidence", "random"],
                              [0.0, 1.0], SCHEDULES, [1.0, 8.0]))


def settings_sample(n: int = 90, seed: int = 0):
    """`n` settings from the grid (random remasking only with the fixed schedule, classifier-free guidance only
    without a cache), and every value of every axis at least once (the first rows walk each axis)."""
    valid = [g for g in GRID if not (g[5] == "random" and g[1]) and not (g[6] and g[3][0] != "none")]
    rng = random.Random(seed)
    chosen = rng.sample(valid, n)
    for axis in range(len(GRID[0])):
        values = {repr(g[axis]) for g in chosen}
        for g in valid:
            if repr(g[axis]) not in values:
                chosen.append(g)
                values.add(repr(g[axis]))
    return chosen


def check_rollout(policy: DiffusionPolicy, recording: Recording, out, prompt_ids, P: int, cfg: bool, block: int,
                  steps_per_block: int | None) -> None:
    mask_id = policy.mask_id
    states = [x[: len(x) // 2] if cfg else x for x in recording.inputs]  # the conditional half under CFG
    states = states + [out.sequences_BL]
    assert all(torch.equal(s[:, :P], prompt_ids) for s in states), "the prompt changed"
    window_SBC = torch.stack([s[:, P:] for s in states])
    assert (window_SBC[0] == mask_id).all(), "the window did not start masked"
    final_BC = out.completion_BC
    assert not (final_BC == mask_id).any(), "a mask remains"
    unmasked_SBC = window_SBC != mask_id
    # once a position holds a token it holds that token to the end: committed once, never rewritten
    assert (unmasked_SBC[1:] >= unmasked_SBC[:-1]).all()
    assert ((window_SBC == final_BC) | ~unmasked_SBC).all()
    forward_BC = unmasked_SBC.int().argmax(0) - 1  # the first state that shows it: committed by the forward before
    # a row's step counts the forwards at which it still had masks in the block being decoded: the fixed
    # schedule's block of forward s is s // steps_per_block; parallel decoding moves on when no row has any left
    S, B, C = window_SBC[:-1].shape
    masked_SBK = (window_SBC[:-1] == mask_id).view(S, B, C // block, block).any(-1)
    if steps_per_block:
        current_S = torch.arange(S) // steps_per_block
    else:
        current_S = masked_SBK.any(1).int().argmax(-1)
    active_SB = masked_SBK[torch.arange(S), :, current_S]
    before_SB = active_SB.long().cumsum(0) - active_SB.long()  # active forwards before forward s
    assert torch.equal(out.unmask_step_BC, before_SB.gather(0, forward_BC.T.contiguous()).T)
    assert (out.unmask_step_BC >= 0).all() and (out.unmask_step_BC < S).all()


@pytest.mark.parametrize("setting", settings_sample(), ids=lambda g: "-".join(map(str, g)).replace(" ", ""))
def test_every_position_is_committed_exactly_once(char_tokenizer, make_dllm, setting):
    (gen, block, steps), rule, random_first, (cache, refresh), temperature, remasking, cfg_scale, \
        (schedule, exponent), scale = setting
    net = make_dllm().model
    recording = Recording(net, scale)
    policy = DiffusionPolicy(recording, "native", char_tokenizer.mask_token_id, char_tokenizer.pad_token_id,
                             char_tokenizer.eos_token_id)
    texts = ["12+7=", "3*4-5=", "9=", "100-1="]  # padded: four prompt lengths
    ids, mask = left_pad([char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
                         char_tokenizer.pad_token_id)
    out = denoise(policy, ids.clone(), mask, gen_length=gen, block_length=block, steps=steps, temperature=temperature,
                  remasking=remasking, cfg_scale=cfg_scale, random_first=random_first, cache=cache,
                  cache_refresh=refresh, generators=row_generators([3, 4, 5, 6]),
                  schedule=MaskingSchedule(schedule, exponent=exponent), **rule)
    steps_taken = out.forwards // (2 if cfg_scale else 1)
    assert steps_taken == len(recording.inputs)
    assert rule or steps_taken == steps  # the fixed schedule takes exactly its steps
    check_rollout(policy, recording, out, ids, ids.shape[1], bool(cfg_scale), block,
                  None if rule else steps // (gen // block))
    if random_first:  # the first step commits one position (parallel) or counts it among its commits
        committed_0 = (out.unmask_step_BC == 0).sum(-1)
        assert (committed_0 == 1).all() if rule else (committed_0 >= 1).all()


def test_the_first_step_takes_one_from_the_first_step_that_has_some():
    transfer = torch.tensor([[0, 0, 3, 1], [2, 1, 1, 0], [0, 1, 0, 0]])
    assert first_step_takes_one(transfer).tolist() == [[1, 0, 2, 1], [2, 1, 1, 0], [1, 0, 0, 0]]
    slow_start = MaskingSchedule("polynomial", exponent=0.25).num_transfer_tokens(torch.tensor([8]), 8)
    assert slow_start[0, 0] == 0  # why the rule exists: this schedule commits nothing at the first step
    assert first_step_takes_one(slow_start).sum() == 8 and first_step_takes_one(slow_start)[0, 0] == 1


def test_random_first_with_the_fixed_schedule_commits_every_position(tiny_policy, char_tokenizer):
    """The training default (64 tokens in 32 steps: two per step) with the random first commit: before the fix
    one mask stayed in every rollout, and ordered scoring failed on its unmask step of -1."""
    ids, mask = left_pad([char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("12+7=", "9=")],
                         char_tokenizer.pad_token_id)
    out = denoise(tiny_policy, ids, mask, gen_length=64, block_length=32, steps=32, temperature=1.0,
                  random_first=True, generators=row_generators([1, 2]))
    assert not (out.completion_BC == tiny_policy.mask_id).any() and (out.unmask_step_BC >= 0).all()
    assert ((out.unmask_step_BC == 0).sum(-1) == 2).all()  # the random commit and the most confident one
    assert out.forwards == 32
