"""Every command on CUDA: the same greedy tokens as the CPU, training steps at ZeRO 0, 2 and 3, LoRA with the
disabled-adapter reference, external rollouts, and eval / generate / sft / export through the CLI. Skipped
where there is no GPU; `scripts/gpu_check.sh` runs them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl import cli
from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.data import build_task
from dllm_rl.data.task import render_prompt
from dllm_rl.precision import resolve_bf16
from dllm_rl.rollout.generate import load_generator
from dllm_rl.train import train
from tests.conftest import DigitShare
from tests.test_train import SMALL

pytestmark = pytest.mark.gpu
MODELS = Path(__file__).resolve().parents[2] / "models"
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def finite(line: dict) -> bool:
    return all(math.isfinite(v) for v in line.values() if isinstance(v, float))


def test_greedy_tokens_are_the_same_on_cpu_and_gpu():
    """The embedded dLLM in fp32 at temperature 0: every token of 32 Countdown rollouts equal."""
    task = build_task("countdown")
    settings = dict(gen_length=64, block_length=32, steps=64, temperature=0.0)
    cpu = load_generator(str(MODELS / "tiny-dllm"), device="cpu", **settings)
    gpu = load_generator(str(MODELS / "tiny-dllm"), device="cuda", **settings)
    assert gpu.model.device.type == "cuda"
    prompts = [render_prompt(task.prompt(ex), cpu.tokenizer) for ex in task.examples("test", 32, 0)]
    tokens_cpu = cpu.sample(prompts, list(range(32))).completion_BC
    tokens_gpu = gpu.sample(prompts, list(range(32))).completion_BC
    assert tokens_gpu.device.type == "cuda"
    assert torch.equal(tokens_cpu, tokens_gpu.cpu())


def test_a_sampled_row_does_not_depend_on_its_batch_on_cuda():
    """The seed contract on CUDA: a row's draws come from its own generator on the GPU."""
    generator = load_generator(str(MODELS / "tiny-dllm"), device="cuda", gen_length=32, block_length=16, steps=32,
                               temperature=1.0, random_first=True)
    prompts = ["Countdown. Numbers: [3, 5, 7]\nTarget: 22\n", "Countdown. Numbers: [2, 9]\nTarget: 18\n"] * 2
    together = generator.sample(prompts, [11, 12, 13, 14]).completion_BC
    alone = generator.sample(prompts[2:3], [13]).completion_BC
    assert torch.equal(together[2:3], alone)
    again = generator.sample(prompts, [11, 12, 13, 14]).completion_BC
    assert torch.equal(together, again)


def test_bf16_auto_follows_the_gpu():
    assert resolve_bf16("auto", "cuda") == torch.cuda.is_bf16_supported()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_training_step_on_cuda_changes_the_parameters(saved_model, tmp_path, stage):
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=2, checkpoint_every=2, deepspeed={"stage": stage},
          **{**SMALL, "algo": {**SMALL["algo"], "beta": 0.04}})
    before, after = (load_file(f"{saved_model}/model.safetensors"),
                     load_file(f"{latest_checkpoint(run)}/model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    lines = metrics(run)
    assert [l["step"] for l in lines] == [1, 2] and all(finite(l) for l in lines)
    assert all(l["policy/updates"] == 1 for l in lines)


def test_lora_on_cuda_uses_the_disabled_adapter_reference(saved_model, tmp_path):
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=2, checkpoint_every=2, lora=LORA,
          gradient_checkpointing=True, **{**SMALL, "algo": {**SMALL["algo"], "beta": 0.1}, "lr": 1e-2})
    lines = metrics(run)
    assert lines[0]["loss/kl"] == 0.0 and lines[1]["loss/kl"] > 0 and all(finite(l) for l in lines)
    assert (latest_checkpoint(run) / "adapter_config.json").is_file()


def test_external_causal_lm_rollouts_on_cuda(saved_model, tmp_path):
    run = tmp_path / "run"
    train(build_task("arithmetic"), model=saved_model, run_dir=str(run), steps=1, checkpoint_every=0,
          **{**SMALL, "external": {"name": "causal_lm", "path": str(MODELS / "tiny-ar"), "max_new_tokens": 16},
             "mixing": {"per_prompt": 1, "keep": "all", "length_rule": "truncate"}})
    line = metrics(run)[0]
    assert line["external/candidates"] > 0 and finite(line)


def test_eval_generate_sft_and_export_run_on_cuda(tmp_path, capsys):
    model = str(MODELS / "tiny-dllm")
    short = ["rollout.gen_length=32", "rollout.block_length=32", "rollout.steps=32"]
    assert cli.main(["generate", f"model={model}", "device=cuda", *short]) == 0
    assert cli.main(["eval", f"model={model}", "device=cuda", "num_prompts=8", f"output_dir={tmp_path / 'eval'}",
                     *short]) == 0
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["tasks"]["countdown"]["num_prompts"] == 8
    assert cli.main(["sft", f"model={model}", "device=cuda", "steps=2", "examples=16", "batch_size=4",
                     f"output_dir={tmp_path / 'sft'}"]) == 0
    assert (tmp_path / "sft" / "model.safetensors").is_file()
    run = tmp_path / "run"
    train(DigitShare(), model=model, run_dir=str(run), steps=1, checkpoint_every=1, lora=LORA, **SMALL)
    assert cli.main(["export", f"checkpoint={run}", f"output_dir={tmp_path / 'export'}", "device=cuda"]) == 0
    assert (tmp_path / "export" / "model.safetensors").is_file()
