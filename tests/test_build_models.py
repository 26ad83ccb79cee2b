"""scripts/build_models.py's pieces that decide which dLLM is kept: the headroom rule (stop at the first checkpoint
with both tasks in the band, else restore the nearest one) and the phases' window draws. The rule's evaluation is
scripted here (the builds themselves take an hour; the script's comment has what they measured)."""

import collections
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build_models", ROOT / "scripts" / "build_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def scores(countdown: float, sudoku: float) -> dict:
    return {"countdown": {"pass@1": countdown}, "sudoku": {"pass@1": sudoku}}


def test_headroom_gap_is_the_summed_distance_outside_the_band(build):
    assert build.HEADROOM == (0.05, 0.2)
    assert build.headroom_gap(scores(0.1, 0.2)) == 0.0
    assert build.headroom_gap(scores(0.0, 0.1)) == pytest.approx(0.05)
    assert build.headroom_gap(scores(0.0, 0.38)) == pytest.approx(0.05 + 0.18)


def scripted_rule(build, monkeypatch, results: list[dict]):
    """A HeadroomStop on a one-weight model whose weight is set to the step before each evaluation, with the
    evaluations' results given in order."""
    model = torch.nn.Linear(1, 1, bias=False)
    queue = iter(results)
    monkeypatch.setattr(build, "evaluate_all", lambda *args, **kwargs: next(queue))
    return model, build.HeadroomStop(model, generator=None, offset=1000, every=50, print_fn=lambda *_: None)


def run(model, rule, steps: int) -> int:
    """Drive the rule as train_sft does; the step it stopped at."""
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.weight.fill_(step)
        if rule(step):
            return step
    return steps


def test_the_rule_stops_at_the_first_checkpoint_inside(build, monkeypatch):
    model, rule = scripted_rule(build, monkeypatch, [scores(0.1, 0.0), scores(0.12, 0.06), scores(0.1, 0.1)])
    assert run(model, rule, 200) == 100  # evaluated at 50 and 100 only
    assert [h["step"] for h in rule.history] == [1050, 1100] and rule.history[1]["sudoku"] == 0.06
    assert rule.keep_best() == 1100 and model.weight.item() == 100


def test_without_a_checkpoint_inside_the_nearest_is_restored(build, monkeypatch):
    model, rule = scripted_rule(build, monkeypatch, [scores(0.1, 0.0), scores(0.1, 0.3), scores(0.0, 0.04),
                                                     scores(0.0, 0.5)])
    assert run(model, rule, 200) == 200
    # gaps 0.05, 0.10, 0.06, 0.35: the first is nearest, and its weights come back
    assert rule.keep_best() == 1050 and model.weight.item() == 50


def test_of_equally_near_checkpoints_the_later_is_restored(build, monkeypatch):
    model, rule = scripted_rule(build, monkeypatch, [scores(0.031, 0.109), scores(0.016, 0.109), scores(0.031, 0.141)])
    assert run(model, rule, 150) == 150
    assert rule.keep_best() == 1150 and model.weight.item() == 150  # gaps 0.019, 0.034, 0.019


def test_the_rule_waits_for_its_first_step(build, monkeypatch):
    model, rule = scripted_rule(build, monkeypatch, [scores(0.0, 0.5), scores(0.1, 0.1)])
    rule.start = 100  # no evaluation at 50: the phase has not done its work yet
    assert run(model, rule, 300) == 150
    assert [h["step"] for h in rule.history] == [1100, 1150]


def test_a_phase_without_evaluations_keeps_its_last_weights(build, monkeypatch):
    model, rule = scripted_rule(build, monkeypatch, [])
    rule.every = 0
    assert run(model, rule, 120) == 120 and rule.keep_best() is None and model.weight.item() == 120


def test_windows_are_drawn_by_their_shares_and_seeded(build):
    draw = build.phase_windows({64: 0.5, 128: 0.25, 256: 0.25}, seed=3)
    counts = collections.Counter(draw() for _ in range(4000))
    assert set(counts) == {64, 128, 256}
    assert abs(counts[64] / 4000 - 0.5) < 0.03 and abs(counts[256] / 4000 - 0.25) < 0.03
    again = build.phase_windows({64: 0.5, 128: 0.25, 256: 0.25}, seed=3)
    first = build.phase_windows({64: 0.5, 128: 0.25, 256: 0.25}, seed=3)
    assert [again() for _ in range(50)] == [first() for _ in range(50)]


@pytest.mark.slow  # a fresh interpreter imports torch
def test_step_counts_must_match_the_phases(build):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_models.py"), "--only", "dllm",
                             "--dllm-steps", "300"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"--dllm-steps 300: expected {len(build.DLLM_PHASES)} positive step counts" in result.stderr


@pytest.mark.slow  # a fresh interpreter imports torch
def test_a_later_phase_needs_the_one_before_it(build, tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_models.py"), "--only", "dllm",
                             "--from-phase", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert f"--from-phase 2: {tmp_path / '.tiny-dllm-phases' / 'phase1'} holds no finished phase 1" in result.stderr


@pytest.mark.slow  # a fresh interpreter imports torch
def test_the_agent_build_names_a_base_that_is_not_a_model(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_agent.py"), "--base", str(tmp_path),
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert f"--base {tmp_path}: expected a dLLM's model directory (with config.json)" in result.stderr
