"""ESPO's sequence-level ratio (likelihood=espo): the old and current policies score each row under the same masks,
so before the first update the ratio is exactly 1, for every row; after an update it moves, per sequence."""

import torch

from dllm_rl.algo.losses import grpo_loss
from dllm_rl.buffer import Rows, loss_inputs
from dllm_rl.collect import StepBatch
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.rollout.sampler import completion_mask, denoise, left_pad
from dllm_rl.seeds import row_generators
from dllm_rl.stages import score_old_and_reference


def test_espo_ratio_is_exactly_one_before_the_first_update(tiny_policy, char_tokenizer):
    prompts = ["12+7=", "3*4-5=", "9="]
    ids, mask = left_pad([char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompts],
                         char_tokenizer.pad_token_id)
    samples = denoise(tiny_policy, ids, mask, gen_length=12, block_length=6, steps=6, temperature=1.0,
                      generators=row_generators([1, 2, 3]))
    estimator = build_estimator({"name": "espo", "num_masks": 2})
    assert estimator.level == "sequence"
    rows = Rows("on_policy", samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length,
                completion_mask(samples.completion_BC, tiny_policy.eos_id), samples.unmask_step_BC,
                torch.tensor([0, 0, 1]), [], [""] * 3, version=0, estimator=estimator,
                adv_N=torch.tensor([1.0, -1.0, 0.5]))
    batch = StepBatch(step=0, examples=[{}, {}], prompt_texts=prompts[:2], prompt_ids=[0, 1], group_sizes=[2, 1],
                      rows={"on_policy": rows})
    score_old_and_reference(batch, tiny_policy, None, iterations=2, reuse_current=False, seed=0,
                            autocast=torch.autocast("cpu", enabled=False))
    assert (rows.old_logp[0].shape == (3, 1)
            and not torch.equal(rows.old_logp[0], rows.old_logp[1]))  # masks per iteration
    tiny_policy.model.train()
    for iteration in (0, 1):
        inputs = loss_inputs([rows], [torch.arange(3)], tiny_policy, iteration, reuse_current=False)
        assert torch.equal(inputs["logp_NC"].detach(), inputs["old_logp_NC"])
        loss, metrics = grpo_loss(**inputs, eps_low=0.2, eps_high=0.2, beta=0.0)
        assert metrics["policy/ratio_mean"] == 1.0 and metrics["policy/ratio_max"] == 1.0
    loss.backward()
    with torch.no_grad():
        for p in tiny_policy.model.parameters():
            p -= 0.05 * p.grad
    moved = loss_inputs([rows], [torch.arange(3)], tiny_policy, 0, reuse_current=False)
    assert not torch.equal(moved["logp_NC"].detach(), moved["old_logp_NC"])
