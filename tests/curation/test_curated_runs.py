"""Training runs with rollout curation on the tiny model: a resumed run takes the decisions the uninterrupted
one takes (the strategies' state is in every checkpoint), and each strategy does what its metrics say."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl.train import train
from tests.conftest import DigitAny, DigitPass

pytestmark = pytest.mark.slow

# a pool of 6 prompts, 4 a step: every other step starts an epoch, so GRESO and SERA move within the run
COMMON = dict(prompts_per_step=4, group_size=3, minibatch_size=6, train_pool=6, eval_every=0, sample_every=0,
              tensorboard=False, bf16=False, lr=1e-3, lr_schedule="constant", warmup=0, checkpoint_every=2, external={"name": "none"},
              rollout={"gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0, "threshold": None,
                       "random_first": False},  # the exact sampler: its groups give each strategy work to do
              print_fn=lambda *_: None)
CURATIONS = {
    "greso_ds_darts": {"greso": {"p_start": 0.3}, "dynamic_sampling": {"max_extra": 12}, "darts": {"delta": 1}},
    "sera": {"sera": {"n_min": 1}, "grpo_dropout": {}, "echo": {"weight": 0.5}},
}
TASKS = {"greso_ds_darts": DigitPass, "sera": DigitAny}  # DigitAny: all-correct groups, which echo clips learn from


def lines(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", sorted(CURATIONS))
def test_a_resumed_curated_run_repeats_the_uninterrupted_one(saved_model, tmp_path, name):
    options = dict(model=saved_model, curation=CURATIONS[name], **COMMON)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    start = load_file(str(Path(saved_model) / "model.safetensors"))
    task = TASKS[name]
    train(task(), run_dir=str(straight), steps=6, **options)
    train(task(), run_dir=str(resumed), steps=4, **options)
    state = torch.load(resumed / "checkpoints" / "step_000004" / "trainer_state.pt", weights_only=True)["state"]
    assert set(state["curation"]) == set(CURATIONS[name]) and any(state["curation"].values())
    train(task(), resume=str(resumed), steps=6, **options)
    assert lines(resumed) == lines(straight)
    got, want = (load_file(str(run / "checkpoints" / "step_000006" / "model.safetensors"))
                 for run in (resumed, straight))
    assert all(torch.equal(got[k], want[k]) for k in want)
    metrics = lines(straight)
    assert sum(m["policy/updates"] for m in metrics) > 0 and any(not torch.equal(want[k], start[k]) for k in start)
    if name == "sera":  # from the second epoch on, group sizes follow the posterior: the budget stays B * G
        assert all(m["curation/rollouts_generated"] <= 12 for m in metrics)
        assert all(m["rollouts/on_policy"] == m["curation/rollouts_generated"] for m in metrics)
        # GRPODropout on top: it dropped some positive rollouts, never more than there were
        assert 0 < sum(m["curation/dropout_dropped"] for m in metrics) <= sum(m["curation/dropout_positive"]
                                                                             for m in metrics)
        # and echo clips from the all-correct groups, learnt with their own loss
        clipped = [m for m in metrics if m["curation/echo_clips"] > 0]
        assert clipped and all(m["loss/echo"] > 0 and 0 < m["curation/echo_clip_len"] <= 16 for m in clipped)
    else:  # dynamic sampling: no flat group trains, and a step never spends more than B * G + max_extra
        assert all(m["reward/zero_std_groups"] == 0 for m in metrics if m["rollouts/on_policy"] > 0)
        assert all(m["curation/rollouts_generated"] <= 12 + 12 for m in metrics)
        assert any(m["curation/rounds"] > 1 for m in metrics) and any(m["curation/rows_dropped"] > 0 for m in metrics)


def test_curation_none_is_the_plain_step(saved_model, tmp_path):
    """curation=none logs no curation/* metric and trains on every prompt's group_size rollouts."""
    run = tmp_path / "plain"
    train(DigitPass(), model=saved_model, run_dir=str(run), steps=2, **COMMON)
    metrics = lines(run)
    assert all(m["rollouts/on_policy"] == 12 for m in metrics)
    assert not any(k.startswith("curation/") for m in metrics for k in m)
