"""Kill tests: a run SIGKILLed at random points over ten attempts (after a random delay, inside a log write,
inside each part of a checkpoint write) and resumed each time ends exactly where an uninterrupted run ends, and
every log holds each step exactly once. The attempts run in tests/kill_worker.py (forked children)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_rl.analysis import load_run
from dllm_rl.checkpoint import latest_checkpoint
from tests.engine.test_distributed import clean_env

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("kill_worker.py")
TRIALS = 10


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in rows]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, char_tokenizer):
    from tests.conftest import save_tiny_dllm

    out = tmp_path_factory.mktemp("kill")
    model = save_tiny_dllm(out / "model", char_tokenizer)
    result = subprocess.run([sys.executable, str(WORKER), str(out), str(model), "2026", str(TRIALS)],
                            env=clean_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return out, json.loads((out / "attempts.json").read_text())["attempts"]


def test_every_kill_point_was_hit(killed):
    _, attempts = killed
    *kills, finish = attempts
    assert finish["where"] == "finish" and finish["status"] == 0
    assert len(kills) == TRIALS, kills
    assert {k["where"] for k in kills} >= {"time", "metrics", "samples", "trainer_state", "manifest", "latest"}
    for kill in kills:  # a hooked kill point always fires; a timed one may come after the attempt finished
        assert kill["status"] == -signal.SIGKILL or (kill["where"] == "time" and kill["status"] == 0), kill
    assert sum(k["status"] == -signal.SIGKILL for k in kills) >= TRIALS - 1


def test_the_resumed_run_equals_the_uninterrupted_one(killed):
    out, _ = killed
    straight, run = out / "straight", out / "killed"
    assert without_perf(lines(run / "metrics.jsonl")) == without_perf(lines(straight / "metrics.jsonl"))
    assert lines(run / "samples.jsonl") == lines(straight / "samples.jsonl")
    a, b = latest_checkpoint(straight), latest_checkpoint(run)
    assert a.name == b.name == "step_000008"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_every_step_is_logged_once(killed):
    out, _ = killed
    logged = load_run(out / "killed")
    steps = [row["step"] for row in lines(out / "killed" / "metrics.jsonl")]
    assert steps == list(range(0, 9)), steps
    samples = logged["samples"].groupby("step").size().to_dict()
    straight = load_run(out / "straight")["samples"].groupby("step").size().to_dict()
    assert sorted(samples) == list(range(1, 9)) and samples == straight, (samples, straight)
