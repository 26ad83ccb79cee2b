"""EchoRL's echo clips: the sampler's entropy record, the clip of a hand-made record, which groups make clips, the
auxiliary SFT loss by a slow reference, and the update it makes where GRPO has no signal."""

import pytest
import torch
import torch.nn.functional as F

from dllm_rl.algo.auxiliary import AuxRows, auxiliary_loss, noised
from dllm_rl.curation import build_curation
from dllm_rl.curation.echo import EchoConfig, clip_mask, step_entropies
from dllm_rl.data.task import Reward
from dllm_rl.errors import ConfigError
from dllm_rl.rollout.sampler import denoise
from dllm_rl.seeds import row_generators
from dllm_rl.stages import assign_advantages
from tests.test_micro_batches import learner_of
from tests.test_stages import ARITHMETIC, batch_of


def test_the_clip_ends_at_the_highest_entropy_step_of_a_hand_made_record():
    order = torch.tensor([0, 0, 1, 1, 2, 3, 3])
    entropy = torch.tensor([0.1, 0.3, 1.0, 0.8, 0.2, 0.5, 2.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0])  # the last token is EOS fill: not counted
    assert step_entropies(order, entropy, mask) == pytest.approx({0: 0.2, 1: 0.9, 2: 0.2, 3: 0.5})
    assert clip_mask(order, entropy, mask).tolist() == [True, True, True, True, False, False, False]
    # counting the fill would make step 3 the hardest
    assert clip_mask(order, entropy, torch.ones(7)).tolist() == [True] * 7
    # equal means: the earliest step
    assert clip_mask(torch.tensor([1, 0]), torch.tensor([0.5, 0.5]), torch.ones(2)).tolist() == [False, True]
    assert not clip_mask(order, entropy, torch.zeros(7)).any()


def test_bad_echo_options_are_named():
    with pytest.raises(ConfigError, match="curation.echo.weight must be > 0"):
        EchoConfig(weight=0.0)
    with pytest.raises(ConfigError, match="curation.echo.weighting must be one of"):
        EchoConfig(weighting="sum")


def test_the_sampler_records_the_entropy_each_token_was_committed_from(tiny_policy):
    """A slow reference: replay the trajectory, each step's state rebuilt from the recorded steps."""
    prompt = torch.tensor([[5, 6, 7]])
    samples = denoise(tiny_policy, prompt, gen_length=6, block_length=3, steps=4, temperature=1.0,
                      generators=row_generators([3]))
    P, completion = 3, samples.completion_BC[0]
    for step in samples.unmask_step_BC[0].unique().tolist():
        state = samples.sequences_BL.clone()
        state[0, P:][samples.unmask_step_BC[0] >= step] = tiny_policy.mask_id
        logits = tiny_policy.logits(state, torch.ones_like(state))[0, P:].double()
        logits[:, tiny_policy.mask_id] = float("-inf")
        p = F.softmax(logits, -1)
        want = -(p * p.clamp(min=1e-300).log()).sum(-1)
        at = samples.unmask_step_BC[0] == step
        torch.testing.assert_close(samples.entropy_BC[0][at], want[at].float(), atol=1e-5, rtol=1e-5)
    assert (samples.entropy_BC >= 0).all() and completion.numel() == 6


def echo_batch(make_rows, on_correct, ext_correct=None):
    """Two prompts of three on-policy rows (and two external rows each, where given), with a made-up record."""
    batch = batch_of(ARITHMETIC.examples("train", 2, 0), sizes=[3, 3])
    on = make_rows("on_policy", 6, prompts=2, C=4)
    on.order_NC = torch.tensor([[0, 0, 1, 2]] * 6)
    on.entropy_NC = torch.tensor([[0.1, 0.2, 0.9, 0.3]] * 6)
    on.mask_NC[:, 3] = 0
    on.rewards = [Reward(float(c), c, True, "ok") for c in on_correct]
    batch.rows["on_policy"] = on
    if ext_correct is not None:
        ext = make_rows("external", 4, prompts=2, C=5)
        ext.mask_NC[:, 4] = 0
        ext.rewards = [Reward(float(c), c, True, "ok") for c in ext_correct]
        batch.rows["external"] = ext
    return batch


def test_echo_clips_come_from_all_correct_groups_and_correct_external_rows_of_failed_ones(make_rows):
    curation = build_curation({"echo": {}}, group_size=3, prompts_per_step=2, seed=0, pool_size=8)
    batch = echo_batch(make_rows, [True, True, True, True, False, False], ext_correct=[True, True, False, True])
    curation.reweight(batch)
    clips = batch.auxiliary["echo"]
    assert len(clips) == 1 and torch.equal(clips.ids_NL, batch.rows["on_policy"].ids_NL[:1])  # prompt 0's first row
    assert clips.target_NC.tolist() == [[True, True, True, False]]  # up to step 1, the hardest
    assert batch.auxiliary["echo_external"] is None  # prompt 1 has a correct on-policy rollout
    assert batch.metrics["curation/echo_clips"] == 1 and batch.metrics["curation/echo_tokens"] == 3

    batch = echo_batch(make_rows, [True, False, True, False, False, False], ext_correct=[True, True, False, True])
    curation.reweight(batch)
    assert batch.auxiliary["echo"] is None and batch.metrics["curation/echo_clips"] == 0
    ext = batch.auxiliary["echo_external"]  # prompt 1: every on-policy rollout failed; its first correct row, whole
    assert torch.equal(ext.ids_NL, batch.rows["external"].ids_NL[3:4])
    assert ext.target_NC.tolist() == [[True] * 4 + [False]]
    off = build_curation({"echo": {"external": False}}, group_size=3, prompts_per_step=2, seed=0, pool_size=8)
    off.reweight(batch)
    assert batch.auxiliary["echo_external"] is None


def test_the_auxiliary_loss_equals_a_slow_reference(tiny_policy):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 20, (3, 9), generator=g)
    target = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    for weighting in ("elbo", "masked_mean"):
        rows = AuxRows("echo", ids, torch.ones_like(ids), 3, target, [11, 12, 13], 1.0, weighting)
        noisy, masked, t = noised(rows, tiny_policy.mask_id)
        assert (noisy[:, 3:][~target] == tiny_policy.mask_id).all()  # non-targets stay masked
        assert torch.equal(noisy[:, 3:][target & ~masked], ids[:, 3:][target & ~masked])
        assert (masked & target).any(-1).all() and not (masked & ~target).any()  # at least one target per row
        total, units = 0.0, 0
        for n in range(3):
            with torch.no_grad():
                logits = tiny_policy.logits(noisy[n:n + 1], torch.ones_like(noisy[n:n + 1]))[0, 3:].float()
            for c in range(6):
                if masked[n, c]:
                    ce = float(F.cross_entropy(logits[c:c + 1], ids[n, 3 + c:4 + c]))
                    total += ce / float(t[n]) if weighting == "elbo" else ce
            units += int(target[n].sum()) if weighting == "elbo" else int(masked[n].sum())
        got = auxiliary_loss(tiny_policy, rows, float(units))
        assert float(got.detach()) == pytest.approx(total / units, rel=1e-5)
        # two ranks: each divides by the total and scales by 2, so the mean over ranks is the loss
        halves = auxiliary_loss(tiny_policy, rows, 2.0 * units, ranks=2)
        assert float(halves.detach()) == pytest.approx(total / units, rel=1e-5)


@pytest.mark.parametrize("all_correct", [False, True])
def test_echo_updates_where_grpo_has_no_signal_only_with_an_all_correct_group(make_dllm, make_rows, all_correct):
    learner = learner_of(make_dllm(), 0, 0, {"eps_low": 0.2, "eps_high": 0.2})
    learner.iterations = 1
    curation = build_curation({"echo": {"weight": 1.0}}, group_size=3, prompts_per_step=2, seed=0, pool_size=8)
    # flat groups: all correct (prompt 0, when asked) or all failed: zero advantages, no GRPO signal
    batch = echo_batch(make_rows, [all_correct] * 3 + [False] * 3)
    assign_advantages(batch, "mean", None, learner.dp)
    curation.reweight(batch)
    start = [p.detach().clone() for p in learner.engine.module.parameters()]
    metrics = learner.update(batch)
    moved = sum(float((p.detach() - s).abs().sum()) for p, s in zip(learner.engine.module.parameters(), start))
    if all_correct:
        assert metrics["policy/updates"] == 1 and metrics["loss/echo"] > 0 and metrics["policy/grad_norm"] > 0
        assert moved > 0 and metrics["policy/no_signal"] == 0
    else:
        assert metrics["policy/updates"] == 0 and "loss/echo" not in metrics and moved == 0
