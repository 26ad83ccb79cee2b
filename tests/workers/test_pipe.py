"""`workers.pipe=true` (dllm_rl/workers/pipe.py): each group's stages and backward as it arrives, one optimizer step
per step, equal to the synchronous update up to float rounding. Here the groups come from the learner's own
process one at a time (the Ray workers' stream is tested in test_remote_training.py), so what is compared is the
update alone: the same rollouts, the same weights after two steps, the same metrics."""

import json
import zlib

import pytest
import torch

from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.collect import group_records, verify
from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from tests.conftest import DigitShare
from tests.test_train import SMALL, weights


class GroupsOneByOne:
    """`PipelinedRollouts.stream`'s contract from in-process rollouts: the step's prompts, each group generated,
    verified and handed out alone (with the seeds the synchronous step uses)."""

    def __init__(self, prompts, rollouts, task, group_size):
        self.prompts, self.rollouts, self.task, self.group_size = prompts, rollouts, task, group_size
        self.streamed = {}

    def stream(self, step):
        for drawn in self.prompts(step):
            group = self.prompts.batch(step, [drawn], [self.group_size])
            group.rows["on_policy"] = self.rollouts(group)
            verify(group, self.task)
            group.visits = group_records(group)
            yield group
        self.streamed = {"rollout/learner_wait_s": 0.0}


def metrics_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def both_ways(task, tmp_path, monkeypatch, **extra):
    """Two steps of `task` with SMALL's settings and `extra`, synchronously and piped (one minibatch, fp32);
    the two run directories."""
    options = dict(SMALL, steps=2, checkpoint_every=2, bf16=False, lr=1e-4, **extra)
    options["minibatch_size"] = options["prompts_per_step"] * options["group_size"]
    local, piped = tmp_path / "local", tmp_path / "piped"
    train(task, run_dir=str(local), **options)
    monkeypatch.setattr("dllm_rl.run_setup.remote_collect",
                        lambda cfg, workers, task, learned, rollouts, prompts, collect, state:
                        GroupsOneByOne(prompts, rollouts, task, cfg.group_size))
    train(task, run_dir=str(piped), workers={"count": 1, "pipe": True}, **options)
    return local, piped


# ERILS with its running baseline (held at the step's start value while the groups arrive, moved once at the end)
# and the capped importance weights of each row alone (not self-normalised: a row's weight is its own)
RUNNING_IS = {"statistic": "running", "baseline_decay": 0.5, "correction": "is", "is_self_normalize": False,
              "length_rule": "truncate", "keep": "all"}


@pytest.mark.parametrize("extra", [{"external": {"name": "solver"}, "group_size": 3,
                                    "mixing": {"length_rule": "truncate", "keep": "all"}},  # external rows kept
                                   {"external": {"name": "solver"}, "group_size": 3, "mixing": RUNNING_IS},
                                   {"algo": {**SMALL["algo"], "aggregation": "sequence", "beta": 0.05}}],
                         ids=["erils", "erils+running+is", "sequence+kl"])
def test_a_piped_step_equals_the_synchronous_update(extra, saved_model, tmp_path, monkeypatch):
    local, piped = both_ways(DigitShare(), tmp_path, monkeypatch, model=saved_model, **extra)
    a, b, start = weights(latest_checkpoint(local)), weights(latest_checkpoint(piped)), weights(saved_model)
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the run trained
    # Adam divides by sqrt(v): where a weight's gradient is near zero, the rounding of the sum's order (groups one
    # by one) becomes a few percent of its step (lr 1e-4): 3.5e-6 measured; a group lost or counted twice is ~1e-4
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=2e-5) for k in a)
    assert not all(torch.equal(a[k], b[k]) for k in a)  # rounded otherwise: the normaliser comes at the end
    ours, theirs = metrics_of(local), metrics_of(piped)
    for key in ("reward/on_policy", "rollouts/on_policy", "policy/updates", "len/on_policy", "reward/accuracy"):
        assert [m[key] for m in ours] == [m[key] for m in theirs], key
    for key in ("loss/policy", "loss/kl", "policy/grad_norm", "adv/on_policy"):
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in theirs], rel=1e-4, abs=1e-7), key
    if "external" in extra:
        assert [m["external/rows"] for m in ours] == [m["external/rows"] for m in theirs] and ours[0]["external/rows"]
        for key in ("adv/external", "external/weight_mean"):
            if key in ours[0]:
                assert [m[key] for m in ours] == pytest.approx([m[key] for m in theirs], rel=1e-5), key
    assert all(m["rollout/learner_wait_s"] == 0.0 and m["perf/update_s"] > 0 for m in theirs)


class HalfFlat(DigitShare):
    """DigitShare, but about half the prompts score 0.5 whatever is written: their groups are flat (no signal)."""

    name = "half_flat"

    def reward(self, completion: str, ex):
        from dllm_rl.data.task import Reward

        if zlib.crc32(ex.uid.encode()) % 2:
            return Reward(0.5, True, False, "ok")
        return super().reward(completion, ex)


@pytest.mark.parametrize("beta, extra", [(0.0, {}), (0.05, {}),
                                         (0.0, {"external": {"name": "solver"}, "mixing": {"weight": 0.5}})],
                         ids=["flat", "flat+kl", "flat+weights_below_one"])
def test_a_piped_step_with_a_flat_group_equals_the_synchronous_update(beta, extra, saved_model, tmp_path,
                                                                        monkeypatch):
    """A flat group's rows count towards the step's normaliser on both paths (one `minibatch_units`), with beta > 0
    its KL term is trained on both, and rows weighted below one (ERILS's mixing weight 0.5) count as their weight:
    the streamed gradient is the synchronous one, not scaled up by the share of flat rows."""
    local, piped = both_ways(HalfFlat(), tmp_path, monkeypatch, model=saved_model, seed=1,
                             algo={**SMALL["algo"], "beta": beta}, **extra)
    ours, theirs = metrics_of(local), metrics_of(piped)
    assert [m["reward/zero_std_groups"] for m in ours] == [0.5, 0.5]  # one flat group, one with signal, per step
    a, b = weights(latest_checkpoint(local)), weights(latest_checkpoint(piped))
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=2e-5) for k in a)
    for key in ("loss/policy", "loss/kl", "policy/grad_norm"):
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in theirs], rel=1e-4, abs=1e-7), key
    assert (ours[-1]["loss/kl"] > 0) == (beta > 0)  # the policy has moved from the reference after one update


def test_pipe_refuses_what_is_not_local_to_a_group_by_name(saved_model, tmp_path):
    for extra, match in (({"inner_iterations": 2}, "inner_iterations=2"),
                         ({"minibatch_size": 4}, "minibatch_size=4 for 8 rows"),
                         ({"curation": {"name": "greso"}}, "curation="),
                         ({"deepspeed": {"name": "zero1", "stage": 1}}, "ZeRO stage 0 or 3"),
                         ({"deepspeed": {"bf16": True}}, "deepspeed.bf16=true accumulates"),
                         ({"external": {"name": "solver"}, "mixing": {"correction": "is"}}, "is_self_normalize=true"),
                         ({"workers": {"count": 0, "pipe": True}}, "workers.pipe=true needs rollout workers")):
        with pytest.raises(ConfigError, match=match):
            train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "r"), steps=1,
                  **{"workers": {"count": 1, "pipe": True}, **SMALL, **extra})


def test_sync_every_needs_the_staleness_it_creates_by_name():
    from dllm_rl.workers.config import WorkersConfig

    with pytest.raises(ConfigError, match=r"workers.sync_every=3 with workers.max_staleness=1: .* up to 2 updates old"):
        WorkersConfig(count=1, sync_every=3, max_staleness=1)
    with pytest.raises(ConfigError, match="workers.sync_every must be >= 1, got 0"):
        WorkersConfig(count=1, sync_every=0)
    assert WorkersConfig(count=1, sync_every=3, max_staleness=2).sync_every == 3


def test_a_non_finite_loss_mid_step_skips_the_update_and_still_takes_every_group(saved_model, tmp_path,
                                                                                  monkeypatch):
    """The first group's loss is NaN: nothing is stepped (the weights stay), the step's other groups are still
    taken from the stream (admission's slots released), and the skip counts towards max_bad_steps."""
    from dllm_rl import learner

    real, calls = learner.grpo_loss, []

    def nan_first(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 1 else loss), metrics

    monkeypatch.setattr(learner, "grpo_loss", nan_first)
    handed = []

    class Counting(GroupsOneByOne):
        def stream(self, step):
            for group in super().stream(step):
                handed.append(group.prompt_ids[0])
                yield group

    monkeypatch.setattr("dllm_rl.run_setup.remote_collect",
                        lambda cfg, workers, task, learned, rollouts, prompts, collect, state:
                        Counting(prompts, rollouts, task, cfg.group_size))
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match="non-finite loss or gradient; update skipped"):
        train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, checkpoint_every=1, bf16=False,
              workers={"count": 1, "pipe": True}, **SMALL)
    assert handed == [0, 1] and len(calls) == 1  # the second group arrived, and made no loss
    (line,) = metrics_of(run)
    assert line["policy/updates"] == 0.0
    before, after = weights(saved_model), weights(latest_checkpoint(run))
    assert all(torch.equal(before[k], after[k]) for k in before)
