"""The GPU scripts are ready to run as they are: gpu_step.py trains one step of a (here tiny) random model and
writes its JSON, and gpu_check.sh runs its checks, says one line per check and fails where there is no GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the same outcome on a machine with a GPU


@pytest.mark.slow
def test_gpu_step_trains_one_step_of_a_random_model_and_writes_its_numbers(tmp_path):
    out = tmp_path / "step.json"
    done = subprocess.run([sys.executable, "scripts/gpu_step.py", "--layers", "2", "--hidden", "64", "--heads", "4",
                           "--intermediate", "128", "--vocab", "512", "--gen-length", "32", "--block-length", "16",
                           "--steps", "16", "--lora-r", "4", "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=ROOT, env=NO_GPU, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["model"]["layers"] == 2 and result["model"]["full_depth"] is True
    assert result["policy_updates"] == 1 and result["finite"] is True
    assert result["rollout_tokens_per_s"] > 0 and result["seconds"]["update"] > 0
    assert "rollout tokens/s" in done.stdout and not (tmp_path / "work").exists()


def test_gpu_check_says_one_line_per_check_and_fails_without_a_gpu(tmp_path):
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**NO_GPU, "SKIP_INSTALL": "1", "PYTHON": sys.executable}, timeout=300)
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[0].startswith("PASS install") and lines[1].startswith("FAIL cuda")
    assert "finds no CUDA GPU" in lines[1]
    assert [l.split()[1] for l in lines[2:6]] == ["gpu_tests", "train", "step_8b", "speculative"]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["checks"]["install"]["passed"] and not result["checks"]["cuda"]["passed"]
    assert set(result["checks"]) == {"install", "cuda", "gpu_tests", "train", "step_8b", "speculative"}


def test_the_llada8b_evaluation_is_behind_its_flag_and_needs_its_data(tmp_path):
    """With LLADA8B set, gpu_check.sh adds the d1-protocol evaluation of that model (not run without a GPU), and
    refuses to start without the GSM8K file it evaluates on."""
    env = {**NO_GPU, "SKIP_INSTALL": "1", "PYTHON": sys.executable, "LLADA8B": str(tmp_path / "llada")}
    refused = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                             env=env, timeout=60)
    assert refused.returncode == 2 and "needs GSM8K_TEST=" in refused.stderr
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "GSM8K_TEST": str(tmp_path / "test.jsonl")}, timeout=300)
    assert done.returncode == 1
    assert "FAIL eval_llada8b (not run: no usable GPU)" in done.stdout
    assert "eval_llada8b" in json.loads((tmp_path / "gpu_check.json").read_text())["checks"]

