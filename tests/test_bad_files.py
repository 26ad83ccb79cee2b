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
    assert "cannot tell which adapter fits model_type 'qwen2'" in err


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
