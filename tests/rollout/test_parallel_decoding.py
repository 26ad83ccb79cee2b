"""Confidence-parallel decoding (threshold and factor rules), the single-step random initialisation, the forward
count, and the per-group diversity metrics: hand-made cases and invariants on the tiny dLLM."""

import math

import pytest
import torch

from dllm_rl.errors import ConfigError
from dllm_rl.rollout.diversity import distinct_share, pairwise_agreement
from dllm_rl.rollout.sampler import denoise, left_pad, parallel_commits
from dllm_rl.seeds import row_generators


def prompts(char_tokenizer, texts=("12+7=", "3*4-5=", "9=")):
    return left_pad([char_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts],
                    char_tokenizer.pad_token_id)


def test_the_commit_rules_by_hand():
    prob = torch.tensor([[0.95, 0.5, 0.91, 0.2], [0.3, 0.99, 0.9, 0.8]], dtype=torch.float64)
    eligible = torch.tensor([[True, True, True, True], [True, True, True, False]])
    assert parallel_commits(prob, eligible, 0.9, None).tolist() == [[True, False, True, False],
                                                                    [False, True, True, False]]
    # nothing reaches 0.999: the most confident eligible one still goes (row 1: 0.8 is not eligible)
    assert parallel_commits(prob, eligible, 0.999, None).tolist() == [[True, False, False, False],
                                                                      [False, True, False, False]]
    # factor 1: sorted 0.99, 0.9, 0.8(ineligible), 0.3 -> n=1: 2*0.01, n=2: 3*0.1 < 1, n=3: 4*0.7 > 1
    assert parallel_commits(prob, eligible, None, 1.0)[1].tolist() == [False, True, True, False]
    # row 0 sorted 0.95, 0.91, 0.5, 0.2: 2*0.05, 3*0.09 < 1, 4*0.5 > 1 -> two
    assert parallel_commits(prob, eligible, None, 1.0)[0].tolist() == [True, False, True, False]
    none = torch.zeros_like(eligible)
    assert not parallel_commits(prob, none, 0.5, None).any()  # a finished row commits nothing


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_threshold_one_is_the_one_token_per_step_sampler(tiny_policy, char_tokenizer, temperature):
    ids, mask = prompts(char_tokenizer)
    common = dict(gen_length=16, block_length=8, temperature=temperature)
    plain = denoise(tiny_policy, ids, mask, steps=16, generators=row_generators([1, 2, 3]), **common)
    one = denoise(tiny_policy, ids, mask, steps=2, threshold=1.0, generators=row_generators([1, 2, 3]), **common)
    assert torch.equal(plain.sequences_BL, one.sequences_BL)
    assert torch.equal(plain.unmask_step_BC, one.unmask_step_BC)
    assert plain.forwards == one.forwards == 16


@pytest.mark.parametrize("rule", [{"threshold": 0.05}, {"threshold": 0.3}, {"factor": 2.0}, {"factor": 0.5}])
def test_parallel_decoding_never_leaves_a_mask_and_always_progresses(tiny_policy, char_tokenizer, rule):
    ids, mask = prompts(char_tokenizer)
    out = denoise(tiny_policy, ids, mask, gen_length=24, block_length=8, steps=3, temperature=1.0,
                  generators=row_generators([4, 5, 6]), **rule)
    completion = out.completion_BC
    assert not (completion == tiny_policy.mask_id).any() and (out.unmask_step_BC >= 0).all()
    assert 3 <= out.forwards <= 24  # at least one step per block, at most one token per step
    steps = out.unmask_step_BC
    for row in steps:  # every step commits at least one token of every row still unmasking its block
        assert set(row.tolist()) <= set(range(out.forwards))
    blocks = steps.view(3, 3, 8)
    assert (blocks[:, :-1].amax(-1) < blocks[:, 1:].amin(-1)).all()  # blocks are filled left to right


def test_a_low_threshold_fills_a_block_in_one_forward(tiny_policy, char_tokenizer):
    ids, mask = prompts(char_tokenizer)
    out = denoise(tiny_policy, ids, mask, gen_length=16, block_length=8, steps=2, threshold=1e-9)
    assert out.forwards == 2 and set(out.unmask_step_BC.flatten().tolist()) == {0, 1}


def test_random_first_commits_exactly_one_random_position(tiny_policy, char_tokenizer):
    ids, mask = prompts(char_tokenizer)
    firsts = set()
    for seed in range(6):
        out = denoise(tiny_policy, ids, mask, gen_length=16, block_length=8, steps=2, threshold=1e-9,
                      random_first=True, temperature=1.0, generators=row_generators([seed, seed + 10, seed + 20]))
        at_step_0 = out.unmask_step_BC == 0
        assert at_step_0.sum(-1).tolist() == [1, 1, 1]  # one position per rollout, not the whole block
        assert (at_step_0[:, 8:] == 0).all()  # inside the first block
        firsts.update(at_step_0.int().argmax(-1).tolist())
        assert out.forwards == 3  # the random commit, then the rest of block 0, then block 1
    assert len(firsts) >= 3  # the position is drawn, not the most confident one


def test_random_first_needs_generators(tiny_policy, char_tokenizer):
    ids, mask = prompts(char_tokenizer)
    with pytest.raises(ConfigError, match="random_first=True needs one torch.Generator per row"):
        denoise(tiny_policy, ids, mask, gen_length=8, block_length=8, steps=8, random_first=True)


@pytest.mark.parametrize("threshold", [None, 0.9])
def test_the_temperature_floor_raises_a_lower_temperature_only(tiny_policy, char_tokenizer, threshold):
    ids, mask = prompts(char_tokenizer, ("12+7=",) * 4)
    common = dict(gen_length=16, block_length=8, steps=16, threshold=threshold)
    run = lambda **kw: denoise(tiny_policy, ids, mask, generators=row_generators([1, 2, 3, 4]),  # noqa: E731
                               **common, **kw)
    greedy = run(temperature=0.0)
    assert all(torch.equal(row, greedy.sequences_BL[0]) for row in greedy.sequences_BL)  # a group of one rollout
    floored = run(temperature=0.0, temperature_floor=0.7)
    assert torch.equal(floored.sequences_BL, run(temperature=0.7).sequences_BL)
    assert len({tuple(row.tolist()) for row in floored.sequences_BL}) > 1  # the group explores again
    assert torch.equal(run(temperature=1.0, temperature_floor=0.7).sequences_BL, run(temperature=1.0).sequences_BL)
    with pytest.raises(ConfigError, match="rollout.temperature_floor=-1"):
        run(temperature=1.0, temperature_floor=-1)


def test_diversity_metrics_by_hand():
    completions = torch.tensor([[1, 2], [1, 2], [3, 4], [5, 6], [5, 7], [8, 6]])
    assert (distinct_share(completions, torch.tensor([0, 0, 0, 1, 1, 1]))
            == pytest.approx(5 / 6))  # groups: 2 distinct of 3, 3 of 3
    # group 1: pairs agree 1, 0, 0 -> 1/3; group 2: (5,6)-(5,7) 1/2, (5,6)-(8,6) 1/2, (5,7)-(8,6) 0 -> 1/3
    assert pairwise_agreement(completions, torch.tensor([0, 0, 0, 1, 1, 1])) == pytest.approx(1 / 3)
    assert pairwise_agreement(torch.tensor([[1, 2], [1, 2]]), torch.tensor([4, 4])) == 1.0
    # groups of any size, rows in any order: {0: (1,2),(1,3)} agree 1/2; {5: (4,4)} has no pair; {2: 3 rows} 1/3
    ragged = torch.tensor([[1, 2], [5, 6], [4, 4], [1, 3], [5, 7], [8, 6]])
    group_N = torch.tensor([0, 2, 5, 0, 2, 2])
    assert distinct_share(ragged, group_N) == 1.0
    assert pairwise_agreement(ragged, group_N) == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_training_with_parallel_decoding_logs_forwards_and_diversity(saved_model, tmp_path):
    import json

    from dllm_rl.train import train
    from tests.conftest import DigitShare
    from tests.test_train import SMALL

    runs = {}
    for name, rollout in (("exact", {}), ("fast", {"threshold": 1e-6, "random_first": True})):
        run = tmp_path / name
        train(DigitShare(), model=saved_model, run_dir=str(run), steps=1,
              **{**SMALL, "rollout": {**SMALL["rollout"], **rollout}})
        runs[name] = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert runs["exact"]["rollout/forwards"] == 8  # rollout.steps
    assert runs["fast"]["rollout/forwards"] == 3  # the random commit, the rest of block 0, block 1
    for line in runs.values():
        assert 0 < line["rollout/distinct"] <= 1 and 0 <= line["rollout/agreement"] <= 1
        assert 0 < line["policy/entropy"] < math.log(len(char_vocab()))  # nats, below the uniform's


def char_vocab():
    from dllm_rl.data.tokenizers import build_char_tokenizer

    return build_char_tokenizer().get_vocab()


def test_policy_entropy_is_the_sampler_records_mean_over_the_scored_tokens(make_rows):
    """`policy/entropy` (dllm_rl/collect.py, rollout_metrics): the entropies the sampler recorded at each commit,
    averaged over the tokens the loss scores (up to and including the first EOS), by hand."""
    from dllm_rl.collect import rollout_metrics

    rows = make_rows("on_policy", 2, C=3)
    rows.entropy_NC = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    rows.mask_NC = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert rollout_metrics(rows, 3.0)["policy/entropy"] == pytest.approx((1 + 2 + 4) / 3)
    rows.entropy_NC = None  # rows without a sampler record (an external source's) log none
    assert "policy/entropy" not in rollout_metrics(rows, 3.0)


@pytest.mark.parametrize("random_first", [False, True])
def test_parallel_decoding_batched_equals_per_row(tiny_policy, char_tokenizer, random_first):
    """Rows that finish a block early wait for the others without drawing noise or counting steps, so a row's
    tokens and unmask steps are those it gets alone (what makes N ranks equal one process, and evaluation
    independent of its batch size); the threshold is one the tiny model's confidences cross now and then."""
    texts = ["12+7=", "3*4-5=", "9=", "100-1=", "7*7="]
    ids, mask = prompts(char_tokenizer, texts)
    common = dict(gen_length=32, block_length=16, steps=4, temperature=1.0, random_first=random_first, threshold=0.011)
    batched = denoise(tiny_policy, ids, mask, generators=row_generators(range(5)), **common)
    lengths = set()
    for b, text in enumerate(texts):
        one_ids, one_mask = prompts(char_tokenizer, [text])
        alone = denoise(tiny_policy, one_ids, one_mask, generators=row_generators([b]), **common)
        assert torch.equal(alone.completion_BC[0], batched.completion_BC[b])
        assert torch.equal(alone.unmask_step_BC[0], batched.unmask_step_BC[b])
        lengths.add(alone.forwards)
    assert len(lengths) > 1  # the rows alone take different numbers of steps: the batch waited for the slowest
