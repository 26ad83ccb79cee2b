"""JustGRPO's recipe on the embedded-model scale (configs/experiment/tiny_justgrpo.yaml): it composes into rollouts
decoded left to right with the exact AR-order likelihood, and a short run of it trains with the old policy's
log-probs taken from the sampler's record, giving the updates that scoring them again gives."""

import json

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl import cli
from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.likelihood.estimators import build_estimator, replays_rollout
from dllm_rl.train import train
from dllm_rl.train_config import TrainConfig
from tests.conftest import DigitShare


def test_the_recipe_is_justgrpos():
    cfg = cli.to_plain(cli.compose_config("train", ["+experiment=tiny_justgrpo"]))
    cfg.pop("task")
    config = TrainConfig.from_options(cfg)
    assert config.rollout["block_length"] == 1 and config.rollout["steps"] == config.rollout["gen_length"]
    assert config.rollout["temperature"] == 1.0 and config.external["name"] == "none"
    assert config.likelihood == {"name": "left_to_right", "group": 1}
    assert config.algo["advantage"] == "std" and config.algo["beta"] == 0.0 and config.algo["eps_low"] == 0.2
    assert config.replay_rollout_logp and replays_rollout(build_estimator(config.likelihood), config.sampler)
    assert config.minibatch_size < config.prompts_per_step * config.group_size  # several updates: old log-probs count


def recipe(**overrides) -> dict:
    cfg = cli.to_plain(cli.compose_config("train", ["+experiment=tiny_justgrpo"]))
    cfg.pop("task")
    return {**cfg, **overrides}


@pytest.mark.slow
def test_a_run_replays_the_sampler_record_and_matches_rescoring(saved_model, tmp_path):
    """The recipe, small, on a task whose dense reward an untrained model earns: with the record replayed and
    with the old log-probs scored again, the same updates (the record is the estimator's value within 2e-5)."""
    runs = {}
    for replay in (True, False):
        run = tmp_path / f"replay_{replay}"
        options = recipe(model=saved_model, run_dir=str(run), replay_rollout_logp=replay, steps=2, prompts_per_step=2,
                         group_size=4, minibatch_size=4, eval_every=0, sample_every=0, tensorboard=False, lr=1e-3,
                         rollout={**recipe()["rollout"], "gen_length": 16, "steps": 16})
        train(DigitShare(), print_fn=lambda *_: None, **options)
        runs[replay] = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        after = load_file(str(latest_checkpoint(run) / "model.safetensors"))
        before = load_file(str(saved_model + "/model.safetensors"))
        assert any(not torch.equal(before[k], after[k]) for k in before)
    for replayed, rescored in zip(runs[True], runs[False]):
        assert replayed["likelihood/old_from_rollout"] == 1.0 and rescored["likelihood/old_from_rollout"] == 0.0
        assert replayed["policy/updates"] == rescored["policy/updates"] == 2.0  # 8 rows in minibatches of 4
        assert replayed["loss/policy"] == pytest.approx(rescored["loss/policy"], abs=1e-4)
        assert replayed["policy/ratio_max"] == pytest.approx(rescored["policy/ratio_max"], abs=1e-3)
