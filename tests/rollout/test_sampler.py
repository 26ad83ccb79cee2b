import pytest
import torch
import torch.nn.functional as F

from dllm_rl.errors import ConfigError
from dllm_rl.policy.schedule import MaskingSchedule
from dllm_rl.rollout.sampler import completion_texts, denoise, left_pad
from dllm_rl.seeds import row_generators

PROMPTS = ["Compute 12 + 7\n", "Sudoku. Puzzle: 0124041310400031\n", "x"]


def encode(tokenizer, texts):
    return left_pad([tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts], tokenizer.pad_token_id)


def llada_reference(policy, prompt_1P, gen_length, block_length, steps):
    """LLaDA's reference `generate` for one unpadded prompt, greedy, low-confidence remasking, written as
    literally as possible (per-block loop, topk over confidences, LLaDA's transfer-count rule), plus our one
    departure: the mask token is never predicted."""
    mask_id = policy.mask_id
    x = torch.full((1, prompt_1P.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt_1P.shape[1]] = prompt_1P
    P = prompt_1P.shape[1]
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for b in range(num_blocks):
        block_mask = x[:, P + b * block_length : P + (b + 1) * block_length] == mask_id
        n = block_mask.sum(dim=1, keepdim=True)
        num_transfer = (n // steps_per_block).repeat(1, steps_per_block)
        num_transfer[:, : int(n % steps_per_block)] += 1
        for i in range(steps_per_block):
            mask_index = x == mask_id
            logits = policy.logits(x)
            logits[..., mask_id] = -float("inf")
            x0 = torch.argmax(logits, dim=-1)
            p = F.softmax(logits.double(), dim=-1)
            x0_p = torch.gather(p, dim=-1, index=x0.unsqueeze(-1)).squeeze(-1)
            x0_p[:, P + (b + 1) * block_length :] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-float("inf"), dtype=torch.float64))
            _, select = torch.topk(confidence[0], k=int(num_transfer[0, i]))
            x[0, select] = x0[0, select]
    return x


@pytest.mark.parametrize("gen_length, block_length, steps", [(16, 8, 8), (16, 16, 16), (12, 4, 6)])
def test_matches_the_llada_reference_sampler(tiny_policy, char_tokenizer, gen_length, block_length, steps):
    for text in PROMPTS:
        prompt = torch.tensor([char_tokenizer(text, add_special_tokens=False)["input_ids"]])
        ours = denoise(tiny_policy, prompt, gen_length=gen_length, block_length=block_length, steps=steps)
        assert torch.equal(ours.sequences_BL, llada_reference(tiny_policy, prompt, gen_length, block_length, steps))


@pytest.mark.parametrize(
    "temperature, remasking, cfg_scale",
    [(0.0, "low_confidence", 0.0), (1.0, "low_confidence", 0.0), (0.8, "random", 0.0), (0.5, "low_confidence", 1.5)],
)
def test_invariants_and_batched_equals_per_row(tiny_policy, char_tokenizer, temperature, remasking, cfg_scale):
    ids, mask = encode(char_tokenizer, PROMPTS)
    settings = dict(gen_length=16, block_length=8, steps=8, temperature=temperature, remasking=remasking,
                    cfg_scale=cfg_scale)
    out = denoise(tiny_policy, ids, mask, generators=row_generators([11, 12, 13]), **settings)
    P = ids.shape[1]
    assert not (out.completion_BC == tiny_policy.mask_id).any()          # no mask left
    assert torch.equal(out.sequences_BL[:, :P], ids)                      # prompt (and padding) untouched
    assert out.unmask_step_BC.min() >= 0 and out.unmask_step_BC.max() < 8
    assert ((out.confidence_BC > 0) & (out.confidence_BC <= 1)).all()
    # Each block is filled by its own steps: block 0 by steps 0-3, block 1 by steps 4-7.
    assert (out.unmask_step_BC[:, :8] < 4).all() and (out.unmask_step_BC[:, 8:] >= 4).all()
    # Tokens unmasked per step follow the schedule: 8 tokens over 4 steps -> 2 per step.
    for s in range(8):
        assert ((out.unmask_step_BC == s).sum(-1) == 2).all()
    rows = []
    for j, text in enumerate(PROMPTS):
        one_ids, one_mask = encode(char_tokenizer, [text])
        rows.append(denoise(tiny_policy, one_ids, one_mask, generators=row_generators([11 + j]),
                            **settings).completion_BC[0])
    assert torch.equal(torch.stack(rows), out.completion_BC)


def test_same_generator_same_output_other_seed_other_output(tiny_policy, char_tokenizer):
    ids, mask = encode(char_tokenizer, PROMPTS[:1] * 4)
    settings = dict(gen_length=16, block_length=16, steps=16, temperature=1.5)
    a = denoise(tiny_policy, ids, mask, generators=row_generators([1, 2, 3, 4]), **settings).completion_BC
    b = denoise(tiny_policy, ids, mask, generators=row_generators([1, 2, 3, 4]), **settings).completion_BC
    assert torch.equal(a, b)
    assert len({tuple(r) for r in a.tolist()}) > 1  # different seeds, different samples


def test_uneven_schedule_counts(tiny_policy, char_tokenizer):
    ids, mask = encode(char_tokenizer, PROMPTS[:1])
    out = denoise(tiny_policy, ids, mask, gen_length=10, block_length=10, steps=4)
    # LLaDA's rule: 10 tokens over 4 steps -> 3, 3, 2, 2.
    assert [(out.unmask_step_BC[0] == s).sum().item() for s in range(4)] == [3, 3, 2, 2]
    cosine = denoise(tiny_policy, ids, mask, gen_length=10, block_length=10, steps=4,
                     schedule=MaskingSchedule(schedule="cosine"))
    counts = [(cosine.unmask_step_BC[0] == s).sum().item() for s in range(4)]
    assert counts == MaskingSchedule(schedule="cosine").num_transfer_tokens(torch.tensor([10]), 4)[0].tolist()


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(gen_length=16, block_length=5, steps=8), "gen_length=16 must be a multiple of block_length=5"),
        (dict(gen_length=16, block_length=4, steps=6), "steps=6 must be divisible by the number of blocks"),
        (dict(gen_length=16, block_length=8, steps=8, max_length=20), "exceeds the model's context of 20"),
        (dict(gen_length=16, block_length=8, steps=8, temperature=1.0), "needs one torch.Generator per row"),
        (dict(gen_length=16, block_length=8, steps=8, remasking="entropy"), "remasking must be one of"),
    ],
)
def test_invalid_settings_are_named(tiny_policy, char_tokenizer, settings, message):
    ids, mask = encode(char_tokenizer, PROMPTS[:1])
    with pytest.raises(ConfigError, match=message):
        denoise(tiny_policy, ids, mask, **settings)


def test_completion_texts_cut_at_eos(char_tokenizer):
    ids = char_tokenizer("ab", add_special_tokens=False)["input_ids"]
    eos = char_tokenizer.eos_token_id
    rows = torch.tensor([ids + [eos, ids[0]], ids + ids])
    assert completion_texts(char_tokenizer, rows, eos) == ["ab", "abab"]
