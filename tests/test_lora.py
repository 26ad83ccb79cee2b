"""LoRA through peft and gradient checkpointing: only the adapter trains, the KL reference is the base (the same
network with the adapter off), checkpoints hold the adapter only and resume exactly, `eval` and `export` merge
the adapter into its base, and checkpointed gradients equal plain ones."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl import cli
from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.errors import ConfigError
from dllm_rl.policy.adapters import load_policy
from dllm_rl.train import train
from tests.conftest import DigitShare
from tests.test_train import SMALL

LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
KL = {**SMALL, "algo": {**SMALL["algo"], "beta": 0.1}, "lr": 1e-2, "checkpoint_every": 2}


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, char_tokenizer):
    from tests.conftest import save_tiny_dllm

    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_dllm(root / "model", char_tokenizer)
    run = root / "run"
    train(DigitShare(), model=str(model), run_dir=str(run), steps=4, lora=LORA, **KL)
    return model, run


def test_only_the_adapter_trains_and_the_reference_is_the_base(lora_run):
    model, run = lora_run
    lines = metrics(run)
    assert lines[0]["loss/kl"] == 0.0  # step 1 scores the untouched policy: LoRA's B starts at zero
    assert all(line["loss/kl"] > 0 for line in lines[1:]) and all(line["policy/updates"] == 1 for line in lines)
    checkpoint = latest_checkpoint(run)
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "reference").exists()
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter and all("lora_" in name for name in adapter)
    assert any(t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name)  # the adapter moved
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(model.resolve()) and config["r"] == 4
    states = torch.load(checkpoint / "deepspeed" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert states and all("lora_" in name for name in states)  # DeepSpeed saved the trained parameters only


def test_a_lora_checkpoint_loads_and_exports_merged(lora_run, tmp_path, capsys):
    model, run = lora_run
    checkpoint = latest_checkpoint(run)
    merged, _ = load_policy(str(checkpoint))
    base, _ = load_policy(str(model))
    ids = torch.randint(5, 60, (2, 12))
    with torch.no_grad():
        logits, base_logits = merged.logits(ids), base.logits(ids)
    assert not torch.allclose(logits, base_logits)  # the adapter changed the model
    from peft import PeftModel

    live = PeftModel.from_pretrained(load_policy(str(model))[0].model, str(checkpoint)).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits, live(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    out = tmp_path / "exported"
    assert cli.main(["export", f"checkpoint={run}", f"output_dir={out}"]) == 0
    assert "LoRA adapter merged" in capsys.readouterr().out
    exported, _ = load_policy(str(out))
    assert not (out / "adapter_config.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(exported.logits(ids), logits, rtol=1e-5, atol=1e-5)


def test_lora_resume_is_exact(lora_run, tmp_path):
    model, straight = lora_run
    split = tmp_path / "split"
    train(DigitShare(), model=str(model), run_dir=str(split), steps=2, lora=LORA, **KL)
    train(DigitShare(), model=str(model), resume=str(split), steps=4, lora=LORA, **KL)
    a, b = (load_file(str(latest_checkpoint(run) / "adapter_model.safetensors")) for run in (straight, split))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [line["loss/policy"] for line in metrics(split)] == [line["loss/policy"] for line in metrics(straight)]


def test_with_dropout_resume_is_exact_and_old_log_probs_are_scored_without_it(lora_run, tmp_path):
    """LoRA dropout draws from the global RNG: checkpoints save it (per rank) so a resumed run draws what the
    uninterrupted one drew, and the old / reference log-probs are scored in eval mode (no dropout), so scoring
    them twice gives the same values and draws nothing."""
    model, _ = lora_run
    lora = {**LORA, "dropout": 0.3}
    options = {**KL, "inner_iterations": 2, "checkpoint_every": 2}  # two iterations: old log-probs are scored
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(DigitShare(), model=str(model), run_dir=str(straight), steps=4, lora=lora, **options)
    train(DigitShare(), model=str(model), run_dir=str(split), steps=2, lora=lora, **options)
    torch.manual_seed(12345)  # whatever the process did since, the resume restores the run's own state
    train(DigitShare(), model=str(model), resume=str(split), steps=4, lora=lora, **options)
    a, b = (load_file(str(latest_checkpoint(run) / "adapter_model.safetensors")) for run in (straight, split))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (latest_checkpoint(split) / "rng_rank0.pt").is_file()

    import contextlib

    from dllm_rl.data_parallel import DataParallel
    from dllm_rl.engine import World
    from dllm_rl.likelihood.estimators import build_estimator
    from dllm_rl.policy.lora import add_adapters
    from dllm_rl.collect import StepBatch
    from dllm_rl.stages import score_old_and_reference
    from tests.conftest import fake_rows

    policy, _ = load_policy(str(model))
    net = add_adapters(policy.model.train(), lora, base_path=str(model), seed=0)
    with torch.no_grad():  # a non-zero B, so the adapter (and its dropout) changes the output
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    policy = dataclasses.replace(policy, model=net)
    batch = StepBatch(0, [], [], [], [], rows={"on_policy": fake_rows("on_policy", 4, C=6)})
    rows = batch.rows["on_policy"]
    dp = DataParallel(World(), 1, 4, 4)
    dp.shard_sources(batch.rows, {"on_policy": build_estimator({"name": "mean_field"})})
    state = torch.get_rng_state()
    score_old_and_reference(batch, policy, None, 2, False, 0, contextlib.nullcontext(), dp=dp)
    first = [t.clone() for t in rows.old_logp]
    score_old_and_reference(batch, policy, None, 2, False, 0, contextlib.nullcontext(), dp=dp)
    assert all(torch.equal(x, y) for x, y in zip(first, rows.old_logp)) and net.training
    assert torch.equal(torch.get_rng_state(), state)  # no dropout draw
    with torch.no_grad():
        train_mode = rows.score_all(policy, 0)
    assert not torch.equal(train_mode, first[0])  # with dropout they would have been noisy


def test_gradient_checkpointing_gives_the_same_gradients(tiny_policy):
    net = tiny_policy.model.train()
    ids = torch.randint(5, 60, (2, 12))

    def grads():
        net.zero_grad()
        net(input_ids=ids).logits.logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    plain = grads()
    from dllm_rl.policy.lora import enable_gradient_checkpointing

    enable_gradient_checkpointing(net)
    assert all(block.gradient_checkpointing for block in net.blocks)
    checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_on_a_model_without_it_is_a_named_error():
    from dllm_rl.policy.lora import enable_gradient_checkpointing

    with pytest.raises(ConfigError, match="Linear does not support gradient checkpointing"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_lora_with_gradient_checkpointing_trains(saved_model, tmp_path):
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, lora=LORA, gradient_checkpointing=True, **KL)
    assert metrics(run)[0]["policy/updates"] == 1


@pytest.mark.parametrize("options, message", [
    ({"r": -1}, "lora.r=-1: expected a finite number >= 0"),
    ({"r": 2.5}, "lora.r=2.5: expected int"),
    ({"r": 4, "dropout": 1.0}, "lora.dropout=1.0: expected a number in [0, 1)"),
    ({"r": 4, "alpha": 0}, "lora.alpha=0: expected a finite number > 0"),
    ({"r": 4, "target_modules": []}, "lora.target_modules=[]: expected all-linear or a list"),
    ({"r": 4, "rank": 3}, "unknown config key 'lora.rank'"),
])
def test_bad_lora_values_are_named(saved_model, tmp_path, options, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "run"), steps=1, lora=options, **SMALL)


def test_lora_refuses_what_it_cannot_do(saved_model, tmp_path):
    with pytest.raises(ConfigError, match="ref_sync_every=2 with lora.r=4"):
        train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "a"), steps=1, lora=LORA, ref_sync_every=2,
              **SMALL)
    with pytest.raises(ConfigError, match=r"lora.target_modules: 'nope' matches no linear layer.*named \["):
        train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "b"), steps=1,
              lora={**LORA, "target_modules": ["nope"]}, **SMALL)


@pytest.mark.parametrize("lora, message", [
    # a typo beside a real name: peft would adapt qkv alone, silently
    ({"target_modules": ["qkv", "o_proj"]}, "lora.target_modules: 'o_proj' matches no linear layer"),
    ({"r": 1000}, "lora.r=1000: larger than the rank of every adapted layer (at most 32"),
])
def test_lora_options_that_would_train_something_else_are_named(saved_model, tmp_path, lora, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "run"), steps=1, lora={**LORA, **lora}, **SMALL)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_lora_may_adapt_the_output_head_by_name(saved_model, tmp_path):
    """all-linear leaves the head out; naming it is a deliberate choice, and it trains."""
    from dllm_rl.policy.lora import adapted_layers

    net = load_policy(saved_model)[0].model
    head = [name for name, m in adapted_layers(net, ["lm_head"]).items()]
    assert head and not set(head) & set(adapted_layers(net, "all-linear"))
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, lora={**LORA, "target_modules": ["lm_head"]},
          **SMALL)
    assert metrics(run)[0]["policy/updates"] == 1


@pytest.mark.slow
def test_sft_and_exported_lora_models_hand_off_to_rl(lora_run, tmp_path):
    """`dllm-rl train model=<dir>` from a `dllm-rl sft` output, from an exported LoRA run, and from a LoRA
    checkpoint itself (merged on load), each with a fresh LoRA on top."""
    model, run = lora_run
    sft_out, exported = tmp_path / "sft", tmp_path / "exported"
    assert cli.main(["sft", f"model={model}", "task=arithmetic", "steps=2", "batch_size=4", "examples=8",
                     f"output_dir={sft_out}", "gen_length=32"]) == 0
    assert cli.main(["export", f"checkpoint={run}", f"output_dir={exported}"]) == 0
    for i, start in enumerate((sft_out, exported, latest_checkpoint(run))):
        out = tmp_path / f"rl{i}"
        assert cli.main(["train", f"model={start}", f"run_dir={out}", "task=arithmetic", "steps=1", "external=none",
                         "prompts_per_step=2", "group_size=2", "minibatch_size=4", "rollout.gen_length=16",
                         "rollout.block_length=16", "rollout.steps=8", "eval_every=0", "tensorboard=false",
                         "lora.r=2", "algo.beta=0.04"]) == 0
        assert metrics(out)[0]["step"] == 1  # (an untrained model earns no reward on arithmetic: no update)
        assert (latest_checkpoint(out) / "adapter_model.safetensors").is_file()


def test_merged_weights_give_the_adapted_networks_outputs_and_leave_it_as_it_is(make_dllm):
    """What rollout workers load with LoRA: the base weights with the adapter merged in, under the base's names."""
    from dllm_rl.policy.lora import add_adapters, merged_state_dict

    adapted = add_adapters(make_dllm(seed=0).model, {"r": 4, "alpha": 8.0, "dropout": 0.0,
                                                     "target_modules": "all-linear"}, base_path=".", seed=1)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if "lora_B" in name:  # B starts at 0: give the adapter something to merge
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    ids = torch.randint(5, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    adapted.eval()
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        plain = make_dllm(seed=0).model.eval()
        base = plain(input_ids=ids).logits
        state = merged_state_dict(adapted)
        assert set(state) == set(plain.state_dict())
        plain.load_state_dict(state)
        got = plain(input_ids=ids).logits
        again = adapted(input_ids=ids).logits
    assert (expected - base).abs().max() > 1e-2  # the adapter matters
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, expected) and any("lora_A" in n for n, _ in adapted.named_parameters())
