"""The published LLaDA and Dream code under transformers 5, through stand-ins with the same quirks
(tests/policy/remote_standins.py): without dllm_rl/policy/compat.py each quirk breaks the load, the logits or the
save; with it both load, give the logits their own code computes, save and load again, and train."""

import itertools
import json

import pytest
import torch
from transformers import AutoModel

from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.policy.adapters import load_policy
from dllm_rl.policy.compat import load_remote_model
from tests.policy.remote_standins import direct_model, write_dream, write_llada

COUNTER = itertools.count()
WRITERS = {"llada": write_llada, "dream": write_dream}


@pytest.fixture
def standin(tmp_path, char_tokenizer):
    """A fresh stand-in directory (its own dynamic module, so fixes applied to one never reach another)."""
    def make(kind: str, seed: int = 0):
        return WRITERS[kind](tmp_path / f"{kind}_{next(COUNTER)}_{seed}", char_tokenizer, seed)

    return make


def ids(n: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(5, 90, (n, length), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_plain_transformers_cannot_load_the_published_code(standin, kind):
    path = standin(kind)
    with pytest.raises((AttributeError, KeyError, TypeError)):
        AutoModel.from_pretrained(path, trust_remote_code=True)


@pytest.mark.parametrize("kind, fix, symptom", [
    ("llada", "post_init", "all_tied_weights_keys"),
    ("llada", "tie_weights", "recompute_mapping|missing_keys"),
    ("llada", "use_cache", "use_cache"),
    ("dream", "rope_default", "default"),
    ("dream", "generation_validate", "user_set_attributes|unexpected keyword"),
])
def test_each_fix_is_needed(standin, kind, fix, symptom):
    """Leave out one fix: the load (or the first forward) fails on exactly that quirk."""
    path = standin(kind)
    from transformers import AutoConfig

    with pytest.raises((AttributeError, KeyError, TypeError), match=symptom):
        model = load_remote_model(str(path), kind, AutoConfig.from_pretrained(path, trust_remote_code=True),
                                  torch.float32, skip=(fix,))
        model(input_ids=ids())


def test_dream_rope_buffers_are_recomputed(standin):
    """Without the fix, inv_freq comes out of from_pretrained uninitialised: the logits are not the model's."""
    from transformers import AutoConfig

    path = standin("dream")
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    broken = load_remote_model(str(path), "dream", config, torch.float32, skip=("rope_buffers",))
    fixed = load_remote_model(str(path), "dream",
                              AutoConfig.from_pretrained(path, trust_remote_code=True), torch.float32)
    reference = direct_model(path, weights=True)
    inv_freq = [m.inv_freq for m in broken.modules() if hasattr(m, "rope_init_fn")]
    expected = [m.inv_freq for m in reference.modules() if hasattr(m, "rope_init_fn")]
    assert not all(torch.equal(a, b) for a, b in zip(inv_freq, expected))
    for module, want in zip((m for m in fixed.modules() if hasattr(m, "rope_init_fn")), expected):
        torch.testing.assert_close(module.inv_freq, want)


def test_dream_save_needs_the_tied_weights_mapping(standin, tmp_path):
    from transformers import AutoConfig

    path = standin("dream")
    model = load_remote_model(str(path), "dream", AutoConfig.from_pretrained(path, trust_remote_code=True),
                              torch.float32, skip=("tied_weights_mapping",))
    with pytest.raises(AttributeError, match="keys"):
        model.save_pretrained(tmp_path / "saved")


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_loaded_logits_are_the_published_codes_and_survive_save_and_load(standin, kind, tmp_path, char_tokenizer):
    path = standin(kind)
    policy, _ = load_policy(str(path), trust_remote_code=True)
    again, _ = load_policy(str(path), trust_remote_code=True)
    reference = direct_model(path, weights=True)
    x = ids()
    with torch.no_grad():
        want = reference(input_ids=x).logits
        if kind == "dream":  # the adapter aligns Dream's shifted logits: row i scores token i
            want = torch.cat([want[:, :1], want[:, :-1]], 1)
        got = policy.logits(x)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(again.logits(x), got)  # two loads agree (Dream's RoPE buffers)
    assert policy.context_length == 64 and policy.mask_id == char_tokenizer.mask_token_id
    saved = tmp_path / f"saved_{kind}"
    policy.model.save_pretrained(saved)
    char_tokenizer.save_pretrained(saved)
    assert json.loads((saved / "config.json").read_text())["auto_map"]  # the code travels with the weights
    reloaded, _ = load_policy(str(saved), trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(reloaded.logits(x), got)


def test_llada_rows_do_not_depend_on_their_batch_in_the_sampler(standin, char_tokenizer):
    """LLaDA ignores the mask: each prompt length runs alone, so a prompt's completion is the same alone or
    batched with prompts of other lengths."""
    from dllm_rl.rollout.generate import TextGenerator

    policy, tokenizer = load_policy(str(standin("llada")), trust_remote_code=True)
    generator = TextGenerator(policy, tokenizer, gen_length=8, block_length=8, steps=8, temperature=1.0)
    prompts, seeds = ["12+7=", "3*45-6=", "9="], [11, 12, 13]
    together = generator.sample(prompts, seeds)
    for i, prompt in enumerate(prompts):
        alone = generator.sample([prompt], [seeds[i]])
        assert torch.equal(alone.completion_BC[0], together.completion_BC[i])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_rl_on_the_published_code_trains_and_its_checkpoint_loads(standin, kind, tmp_path):
    from dllm_rl.train import train
    from tests.conftest import DigitShare
    from tests.test_train import SMALL

    path, run = standin(kind), tmp_path / f"run_{kind}"
    train(DigitShare(), model=str(path), trust_remote_code=True, run_dir=str(run), steps=1, **SMALL)
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert line["policy/updates"] == 1
    policy, _ = load_policy(str(latest_checkpoint(run)), trust_remote_code=True)
    before, _ = load_policy(str(path), trust_remote_code=True)
    from dllm_rl import cli

    exported = tmp_path / f"exported_{kind}"
    assert cli.main(["export", f"checkpoint={run}", f"output_dir={exported}", "trust_remote_code=true"]) == 0
    merged, _ = load_policy(str(exported), trust_remote_code=True)
    with torch.no_grad():
        assert not torch.allclose(policy.logits(ids()), before.logits(ids()))  # trained weights, reloaded
        torch.testing.assert_close(merged.logits(ids()), policy.logits(ids()))  # export gives the same model


def test_llada_gradient_checkpointing_goes_through_its_own_strategy(standin):
    """LLaDA has no transformers switch; its own whole_layer strategy gives the same gradients."""
    from dllm_rl.policy.lora import enable_gradient_checkpointing

    policy, _ = load_policy(str(standin("llada")), trust_remote_code=True)
    net = policy.model.train()

    def grads():
        net.zero_grad()
        policy.logits(ids()).logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in net.named_parameters()}

    plain = grads()
    enable_gradient_checkpointing(net)
    assert str(net.model.activation_checkpointing_strategy.value) == "whole_layer"
    checkpointed = grads()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6)
