"""Evaluation protocols (`dllm-rl eval protocol=...`): the settings each pins, checked by hand from the YAML the
command composes; bad protocols named; several lengths in one call, one table, a result file that records the
protocol and the environment; and results that do not depend on batch size or padding, for every adapter."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from dllm_rl import cli
from dllm_rl.data import build_task
from dllm_rl.errors import ConfigError
from dllm_rl.evaluate import evaluate_task
from dllm_rl.protocols import Protocol
from dllm_rl.rollout.generate import TextGenerator, load_generator
from tests.policy.remote_standins import write_dream, write_llada

EMBEDDED = Path(__file__).resolve().parents[1] / "models" / "tiny-dllm"

ROLLOUT = {"gen_length": 64, "block_length": 32, "steps": 64, "temperature": 1.0, "remasking": "random",
           "cfg_scale": 0.0, "threshold": None, "factor": None, "random_first": True, "cache": "none",
           "cache_refresh": 0, "temperature_floor": 0.0}


def composed(name: str) -> dict:
    return cli.to_plain(cli.compose_config("eval", [f"protocol={name}"]))["protocol"]


def test_each_protocol_pins_its_papers_settings():
    d1 = Protocol(**composed("d1")).settings(ROLLOUT)
    assert [(s["gen_length"], s["steps"], s["block_length"]) for s in d1] == [(128, 64, 32), (256, 128, 32),
                                                                            (512, 256, 32)]
    assert all(s["temperature"] == 0 and s["remasking"] == "low_confidence" and s["cache"] == "none"
               and s["threshold"] is None and not s["random_first"] for s in d1)
    assert composed("d1")["task"] == {"prompt_style": "d1", "reward_style": "d1"}
    justgrpo = Protocol(**composed("justgrpo")).settings(ROLLOUT)
    assert [(s["gen_length"], s["steps"], s["block_length"]) for s in justgrpo] == [(128, 128, 32), (256, 256, 32),
                                                                                  (512, 512, 32)]
    assert all(s["temperature"] == 0 and s["remasking"] == "low_confidence" for s in justgrpo)
    fast = Protocol(**composed("fast")).settings(ROLLOUT)
    assert all(s["threshold"] == 0.9 and s["cache"] == "dual" and s["cache_refresh"] == 0 and s["temperature"] == 0
               for s in fast)
    assert Protocol(**composed("none")).settings(ROLLOUT) == [ROLLOUT]


@pytest.mark.parametrize("protocol, message", [
    (dict(name="x", lengths=[]), "protocol.lengths=[]: expected a non-empty list"),
    (dict(name="x", lengths=[96], steps_per_token=0.3), "length 96 x steps_per_token 0.3 = 28.8"),
    (dict(name="x", lengths=[100], steps_per_token=0.25), "gen_length=100 must be a multiple of block_length=32"),
    (dict(name="x", steps_per_token=-1.0), "protocol.steps_per_token=-1.0: expected > 0"),
    (dict(name="x", lengths=[128], rollout={"cache": "both"}), "rollout.cache must be one of"),
])
def test_bad_protocols_are_named(protocol, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        Protocol(**protocol).settings({**ROLLOUT, "block_length": 32})


def test_a_protocol_for_another_task_or_a_longer_context_is_refused(saved_model, capsys):
    assert cli.main(["eval", f"model={saved_model}", "protocol=d1", "task=arithmetic"]) == 2
    assert "protocol=d1 sets task.reward_style='d1', and task=arithmetic has no such setting" in capsys.readouterr().err
    # the test model's context is 128 tokens: d1's long prompts leave room for no length
    assert cli.main(["eval", f"model={saved_model}", "protocol=d1", "task=countdown", "num_prompts=3"]) == 2
    err = capsys.readouterr().err
    assert "protocol=d1: length 128 after the longest prompt of" in err
    assert "need a long-context model such as LLaDA-8B or Dream-7B; on a short-context model (the embedded ones) " \
           "protocol.task.prompt_style=compact asks the question alone" in err and "Token indices" not in err
    assert cli.main(["eval", f"model={saved_model}", "protocol=justgrpo", "task=countdown", "num_prompts=3",
                     "task.prompt_style=compact"]) == 2
    err = capsys.readouterr().err
    assert "evaluate the lengths that fit with protocol.lengths=[]" not in err and "no length fits this model" in err


def test_eval_runs_every_length_prints_one_table_and_records_the_protocol(saved_model, tmp_path, capsys):
    out = tmp_path / "eval"
    assert cli.main(["eval", f"model={saved_model}", "protocol=d1", "protocol.lengths=[32,64]", "task=countdown",
                     "protocol.task.prompt_style=compact", "num_prompts=3", f"output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "| length | steps | block | pass@1 | best_of_1 | format | tokens | s |" in printed
    assert "\n| 32 | 16 | 32 |" in printed and "\n| 64 | 32 | 32 |" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["lengths"]) == {"32", "64"} and summary["lengths"]["64"]["countdown"]["num_prompts"] == 3
    meta = summary["meta"]
    assert meta["protocol"]["name"] == "d1" and [s["steps"] for s in meta["settings"]] == [16, 32]
    assert (meta["versions"]["torch"] == torch.__version__.split("+")[0]
            or meta["versions"]["torch"] == torch.__version__)
    assert meta["device"] == "cpu" and meta["dtype"] == "float32" and meta["versions"]["transformers"]
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["gen_length"] for r in records}) == [32, 64] and len(records) == 6


def generators(tmp_path, char_tokenizer):
    """A generator per adapter: the embedded trained native model, and the LLaDA (mask-ignoring) and Dream
    stand-ins of the published code."""
    out = {"native": load_generator(str(EMBEDDED))}
    for kind, write in (("llada", write_llada), ("dream", write_dream)):
        out[kind] = load_generator(str(write(tmp_path / kind, char_tokenizer)), trust_remote_code=True)
    return out


@pytest.mark.slow
def test_batch_size_and_padding_never_change_a_result(tmp_path, char_tokenizer):
    """Prompts of several lengths (so a batch pads them), evaluated one at a time and all at once, under every
    protocol (at one short length) and every adapter: the same completions. The LLaDA and Dream stand-ins have no
    block cache, so `fast` runs there with threshold decoding alone. The native model is the embedded trained one:
    a padded batch's logits equal a lone row's up to float noise (about 1e-7), which flips a greedy choice only
    between near-equal tokens, everywhere in a random model's flat distributions (dllm_rl/protocols.py)."""
    task = build_task("arithmetic")  # short prompts of several lengths: they fit the stand-ins' context of 64
    quiet = dict(num_prompts=8, seed=3, print_fn=lambda *_: None)
    for kind, generator in generators(tmp_path, char_tokenizer).items():
        for name in ("none", "d1", "justgrpo", "fast"):
            protocol = composed(name) | {"lengths": [16] if name != "none" else None}
            # blocks of 16 over a 16-token window (the protocols' 32 would need twice the tokens; the rule is the same)
            protocol["rollout"] = ({**protocol["rollout"], "block_length": 16}
                                   | ({} if kind == "native" else {"cache": "none"}))
            base = {**ROLLOUT, "gen_length": 16, "block_length": 8, "steps": 8}
            settings = Protocol(**protocol).settings(base)[0]
            one = evaluate_task(dataclasses.replace(generator, **settings), task, batch_size=1, **quiet)[1]
            many = evaluate_task(dataclasses.replace(generator, **settings), task, batch_size=8, **quiet)[1]
            assert [r["completion"] for r in one] == [r["completion"] for r in many], (kind, name)
            lengths = {len(char_tokenizer(r["prompt"])["input_ids"]) for r in one}
            assert len(lengths) > 1, "the prompts must pad each other"
    assert isinstance(generator, TextGenerator)


def test_a_window_past_the_context_without_a_protocol_names_the_rollout_key_and_the_fix(saved_model, tmp_path, capsys):
    """Not `protocol=none` (which the user never set): the window, and what fits; d1-style prompts (a GSM8K file's)
    point to the compact prompts."""
    assert cli.main(["eval", f"model={saved_model}", "task=countdown", "num_prompts=2", "rollout.gen_length=128",
                     "rollout.block_length=32", "rollout.steps=32"]) == 2
    err = capsys.readouterr().err
    assert "error: rollout.gen_length=128 after the longest prompt of" in err and "set rollout.gen_length <= " in err
    assert "protocol=none" not in err
    assert cli.main(["eval", f"model={saved_model}", "task=countdown", "num_prompts=2", "task.prompt_style=d1"]) == 2
    assert "the d1 prompts (the paper's instructions and format) need a long-context model" in capsys.readouterr().err
