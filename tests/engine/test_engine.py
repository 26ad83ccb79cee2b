"""The DeepSpeed config function, the single-process environment, and the engine in a world of one."""

import os

import pytest
import torch

from dllm_rl import cli
from dllm_rl.engine import deepspeed_config
from dllm_rl.engine.dist import MARKER, launched, single_process_environment
from dllm_rl.errors import ConfigError


def test_config_from_flat_arguments():
    config = deepspeed_config(stage=3, bf16=True, grad_clip=0.5, micro_batch_size=4, gradient_accumulation_steps=2,
                              world_size=8, offload_optimizer="cpu", offload_params="cpu")
    assert config["train_batch_size"] == 4 * 2 * 8 and config["train_micro_batch_size_per_gpu"] == 4
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    zero = config["zero_optimization"]
    assert (zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
            and zero["offload_param"]["device"] == "cpu")
    plain = deepspeed_config()
    assert plain["zero_optimization"] == {"stage": 0} and plain["bf16"] == {"enabled": False}


def test_buckets_follow_the_hidden_size():
    zero = deepspeed_config(stage=3, hidden_size=100)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 10_000 and zero["stage3_prefetch_bucket_size"] == 9_000
    assert zero["stage3_param_persistence_threshold"] == 1_000
    zero = deepspeed_config(stage=2, hidden_size=100)["zero_optimization"]
    assert zero["reduce_bucket_size"] == 10_000 and "stage3_prefetch_bucket_size" not in zero
    assert "reduce_bucket_size" not in deepspeed_config(stage=3)["zero_optimization"]  # DeepSpeed's defaults


@pytest.mark.parametrize("kwargs, message", [
    ({"stage": 4}, "deepspeed.stage must be one of (0, 1, 2, 3), got 4"),
    ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer='cpu' needs stage >= 1"),
    ({"stage": 2, "offload_params": "cpu"}, "offload_params='cpu' needs stage 3"),
    ({"offload_params": "nvme"}, "deepspeed.offload_params must be one of ('none', 'cpu'), got 'nvme'"),
    ({"micro_batch_size": 0}, "micro_batch_size must be >= 1, got 0"),
    ({"hidden_size": 0}, "hidden_size must be >= 1 or None, got 0"),
])
def test_bad_config_values_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        deepspeed_config(**kwargs)


def test_single_process_environment_is_not_taken_for_a_launch(monkeypatch):
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", MARKER):
        monkeypatch.delenv(key, raising=False)
    assert not launched()
    env = single_process_environment()
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "1" and int(env["MASTER_PORT"]) > 0
    monkeypatch.setattr(os, "environ", {**os.environ, **env})
    assert launched()  # set by this process for itself: reused by its next run
    monkeypatch.setitem(os.environ, MARKER, f"{os.getpid() + 1}:{env['MASTER_PORT']}")
    assert not launched()  # inherited from a parent: the child must pick its own port
    monkeypatch.setitem(os.environ, "MASTER_PORT", "29500")
    assert launched()  # a launcher rewrote the world


def test_cli_composes_every_deepspeed_option(capsys):
    for option in ("zero0", "zero1", "zero2", "zero3", "zero3_offload"):
        assert cli.main(["train", f"deepspeed={option}", "--cfg"]) == 0
        assert f"name: {option}" in capsys.readouterr().out
    assert cli.main(["train", "deepspeed.stage=5", "steps=1", "model=nowhere"]) == 2
    assert "deepspeed.stage must be one of (0, 1, 2, 3), got 5" in capsys.readouterr().err


def test_zero3_offload_trains_in_one_process(saved_model, tmp_path):
    """Stage 3 with optimizer and parameter offload, single process: the weights move and the run resumes."""
    from dllm_rl.data import build_task
    from dllm_rl.checkpoint import latest_checkpoint
    from dllm_rl.train import train
    from safetensors.torch import load_file

    options = dict(rollout={"gen_length": 32, "block_length": 16, "steps": 16}, likelihood={"name": "mean_field"},
                   algo={}, external={"name": "solver"}, mixing={"per_prompt": 1}, prompts_per_step=2, group_size=2,
                   minibatch_size=4, eval_every=0, tensorboard=False, lr=1e-3, print_fn=lambda *_: None,
                   deepspeed={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"})
    run = tmp_path / "run"
    metrics = train(build_task("arithmetic"), model=saved_model, run_dir=str(run), steps=1, **options)
    assert metrics["policy/updates"] == 1
    before, after = (load_file(f"{saved_model}/model.safetensors"),
                     load_file(str(latest_checkpoint(run) / "model.safetensors")))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    train(build_task("arithmetic"), model=saved_model, resume=str(run), steps=2, **options)
    assert latest_checkpoint(run).name == "step_000002"
    with pytest.raises(ConfigError, match="resume: deepspeed.stage was 3 in this run; 0 would change the run"):
        train(build_task("arithmetic"), model=saved_model, resume=str(run), steps=3,
              **{**options, "deepspeed": {"stage": 0}})
    with pytest.raises(ConfigError, match="written at ZeRO stage 3 with 1 rank"):  # allowed, but it cannot load
        train(build_task("arithmetic"), model=saved_model, resume=str(run), steps=3, allow_changes=True,
              **{**options, "deepspeed": {"stage": 0}})


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_non_finite_loss_or_gradient_skips_the_update_at_every_stage(stage, char_tokenizer):
    """`Engine.update` skips a non-finite loss before the backward, and a finite loss with a non-finite
    gradient after it (at stages 1-3 DeepSpeed's ZeRO optimizer skips that step itself); either way it says
    so, the weights stay as they were, and the next finite update applies."""
    from tests.conftest import make_tiny_dllm
    from dllm_rl.engine import Engine, Update, init_distributed

    model = make_tiny_dllm(char_tokenizer).model.train()
    world = init_distributed()
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), world,
                    deepspeed_config(stage=stage, micro_batch_size=1))
    ids = torch.randint(5, 50, (1, 12))
    with engine.gathered():
        before = [p.detach().clone() for p in engine.module.parameters()]
    update = engine.update(engine.ds(input_ids=ids).logits.float().mean() * float("nan"))
    assert update == Update(False, skipped="non-finite loss")
    total = engine.ds(input_ids=ids).logits.float().sum()
    loss = (total - total.detach()).abs().sqrt()  # value 0, gradient inf * 0 = NaN
    assert torch.isfinite(loss) and engine.update(loss) == Update(False, skipped="non-finite gradient")
    with engine.gathered():
        assert all(torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
    engine.zero_grad()
    update = engine.update(engine.ds(input_ids=ids).logits.float().logsumexp(-1).mean())
    assert update.applied and update.grad_norm > 0
    with engine.gathered():
        assert any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters()))
