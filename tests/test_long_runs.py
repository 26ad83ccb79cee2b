"""The long-run comparison's plumbing (scripts/long_runs.py) on a 2-step budget: it runs each arm, keeps each
finished run's numbers, skips kept runs, and writes the table, the JSON and the plot (not the numbers' values)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def test_the_long_run_table_is_regenerated_by_its_command(tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "long_runs.py"), "--tasks", "sudoku", "--arms", "grpo",
               "erils+bandit", "--seeds", "0", "--steps", "2", "--eval-every", "1", "--eval-prompts", "4",
               "--jobs", "1", "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "long.json"),
               "--plot", str(tmp_path / "long.png"), "--keep", str(tmp_path / "keep"),
               "prompts_per_step=2", "group_size=2", "train_pool=4", "rollout.steps=16", "eval_samples=1",
               "eval_external_samples=1"]
    first = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    record = json.loads((tmp_path / "long.json").read_text())
    assert record["missing"] == [] and {r["arm"] for r in record["runs"]} == {"grpo", "erils+bandit"}
    for run in record["runs"]:
        assert [e["step"] for e in run["evals"]] == [0, 1, 2] and run["rollouts"] > 0 and run["seconds"] > 0
    bandit = next(r for r in record["runs"] if r["arm"] == "erils+bandit")
    assert bandit["external_rollouts"] > 0 and "eval/pass1_external_solved" in bandit["end"]
    assert "| sudoku | erils+bandit | 1 |" in record["table"] and (tmp_path / "long.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "keep" / "sudoku").iterdir()) == ["erils+bandit-s0.json", "grpo-s0.json"]
    # a second call runs nothing: every run is kept
    again = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "running" not in again.stdout
    assert json.loads((tmp_path / "long.json").read_text())["table"] == record["table"]
