"""Corrupt or wrong files: each is a named error saying which file and what is wrong, never a traceback."""

import json
import shutil

import pytest

from dllm_rl import cli


def run(args, capsys) -> str:
    assert cli.main(args) == 2, args
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
    return err


@pytest.fixture
def model_copy(saved_model, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(saved_model, path)
    return path


def test_a_malformed_config_json(model_copy, capsys):
    (model_copy / "config.json").write_text('{"model_type": "dllm_rl_diffusion_lm",')
    assert "config.json is not valid JSON" in run(["eval", f"model={model_copy}", "num_prompts=1"], capsys)
    (model_copy / "config.json").unlink()
    assert "no config.json there" in run(["eval", f"model={model_copy}", "num_prompts=1"], capsys)


def test_truncated_weights(model_copy, capsys):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "cannot load the model from it" in run(["generate", f"model={model_copy}"], capsys)


def test_a_missing_tokenizer(model_copy, capsys):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    assert "no tokenizer could be loaded from it" in run(["generate", f"model={model_copy}"], capsys)


@pytest.mark.parametrize("mask_id, message", [(10_000, "mask token id 10000 is outside the model's vocabulary"),
                                              ("pad", "the mask token id equals the pad token id")])
def test_a_mask_token_the_model_cannot_use(model_copy, capsys, mask_id, message):
    config = json.loads((model_copy / "config.json").read_text())
    config["mask_token_id"] = config["pad_token_id"] if mask_id == "pad" else mask_id
    (model_copy / "config.json").write_text(json.dumps(config))
    assert message in run(["generate", f"model={model_copy}"], capsys)


def test_a_causal_lm_given_as_the_policy(tmp_path, capsys):
    err = run(["train", "model=models/tiny-ar", f"run_dir={tmp_path / 'run'}", "steps=1"], capsys)
    assert "is not a masked-diffusion model (model_type 'qwen2')" in err and "external=causal_lm" in err


def test_an_unwritable_run_dir(saved_model, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    err = run(["train", f"model={saved_model}", f"run_dir={tmp_path / 'file' / 'run'}", "steps=1"], capsys)
    assert "cannot write there" in err


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe not utf-8", "not UTF-8 text"),
    (b'{"uid": "x", "completion": "y", "behaviour_logp": NaN}\n', "behaviour_logp must be a finite log-probability"),
    (b'{"uid": "no such prompt", "completion": "y"}\n', "none of its 1 uids is the uid of a train prompt"),
])
def test_bad_external_rollout_files(saved_model, tmp_path, capsys, content, message):
    path = tmp_path / "external.jsonl"
    path.write_bytes(content)
    err = run(["train", f"model={saved_model}", f"run_dir={tmp_path / 'run'}", "steps=1", "external=jsonl",
               f"external.path={path}", "eval_every=0"], capsys)
    assert message in err


@pytest.mark.parametrize("text, message", [
    ('{"model_type": "dllm_rl_diffusion_lm",', "config.json is not valid JSON"),
    ("", "config.json is not valid JSON"),
    (None, "config.json has hidden_size='64'; expected a positive integer"),
])
def test_a_training_model_whose_config_json_is_bad(model_copy, tmp_path, capsys, text, message):
    """The trainer reads the model's config.json (its width sizes the DeepSpeed config) before it loads anything:
    a malformed or empty file, or a width of the wrong type, is a named error, not a JSONDecodeError or TypeError."""
    config = model_copy / "config.json"
    if text is None:
        config.write_text(json.dumps({**json.loads(config.read_text()), "hidden_size": "64"}))
    else:
        config.write_text(text)
    err = run(["train", f"model={model_copy}", f"run_dir={tmp_path / 'run'}", "steps=1", "eval_every=0"], capsys)
    assert message in err


def test_an_external_causal_lm_that_is_not_one(saved_model, tmp_path, capsys):
    """A masked-diffusion model, or truncated weights, given as the external causal LM: named by its key."""
    args = [f"model={saved_model}", "steps=1", "eval_every=0", "external=causal_lm"]
    err = run(["train", *args, f"run_dir={tmp_path / 'a'}", f"external.path={saved_model}"], capsys)
    assert f"external.path='{saved_model}' is a masked-diffusion model" in err
    broken = tmp_path / "tiny-ar"
    shutil.copytree("models/tiny-ar", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    err = run(["train", *args, f"run_dir={tmp_path / 'b'}", f"external.path={broken}"], capsys)
    assert f"external.path='{broken}': cannot load a causal LM from it" in err


def test_a_block_cache_for_a_model_without_one_is_refused_before_it_loads(tmp_path, char_tokenizer, capsys):
    """The LLaDA stand-in without its weights: the refusal comes from config.json alone (loading would fail on
    the missing weights with another message)."""
    from tests.policy.remote_standins import write_llada

    path = write_llada(tmp_path / "llada", char_tokenizer)
    (path / "model.safetensors").unlink()
    message = "rollout.cache='dual': a llada model's code has no block cache"
    common = ["rollout.cache=dual", "trust_remote_code=true"]
    assert message in run(["train", f"model={path}", f"run_dir={tmp_path / 'run'}", "steps=1", *common], capsys)
    assert message in run(["eval", f"model={path}", f"output_dir={tmp_path / 'eval'}", *common], capsys)


def test_a_damaged_checkpoint_is_not_exported(saved_model, tmp_path, capsys):
    from dllm_rl.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    assert cli.main(["train", f"model={saved_model}", f"run_dir={run_dir}", "steps=2", "checkpoint_every=1",
                     "eval_every=0", "task=arithmetic", "prompts_per_step=2", "group_size=2", "minibatch_size=4",
                     "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8", "tensorboard=false"]) == 0
    newest = latest_checkpoint(run_dir)
    (newest / "model.safetensors").write_bytes(b"flipped")
    err = run(["export", f"checkpoint={newest}", f"output_dir={tmp_path / 'out'}"], capsys)
    assert "is damaged (model.safetensors has 7 bytes" in err
    # the run directory takes its newest intact checkpoint, as resume does
    with pytest.warns(UserWarning, match="step_000002 is damaged"):
        assert cli.main(["export", f"checkpoint={run_dir}", f"output_dir={tmp_path / 'out'}"]) == 0
    assert "exported " + str(run_dir / "checkpoints" / "step_000001") in capsys.readouterr().out
