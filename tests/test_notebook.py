"""notebooks/evaluate.ipynb runs on a tiny run's artefacts, and is committed without outputs."""

import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from dllm_rl import analysis
from dllm_rl.data import build_task
from dllm_rl.train import train

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "evaluate.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])


@pytest.mark.slow
def test_notebook_executes_on_tiny_runs(tmp_path, saved_model, monkeypatch):
    task = build_task("sudoku")
    common = dict(rollout={"gen_length": 40, "block_length": 40, "steps": 10, "temperature": 1.0},
                  likelihood={"name": "mean_field"}, algo={"advantage": "mean"}, prompts_per_step=2, group_size=2,
                  minibatch_size=4, steps=2, eval_every=1, eval_prompts=4, eval_samples=2, sample_every=1,
                  tensorboard=False, print_fn=lambda *_: None)
    runs = []
    for name, external in (("grpo", {"name": "none"}), ("erils", {"name": "solver"})):
        run = tmp_path / name
        train(task, model=saved_model, run_dir=str(run), external=external, mixing={"per_prompt": 1}, **common)
        runs.append(str(run))

    loaded = analysis.load_runs(runs)
    table = analysis.summary(loaded)
    assert list(table.index) == ["grpo", "erils"] and "eval/best_of_2 end" in table.columns
    assert list(analysis.reward_by_source(loaded[1]).columns) == ["on_policy", "external"]
    assert set(analysis.last_samples(loaded[1])["source"]) == {"on_policy", "external"}

    monkeypatch.setenv("DLLM_RL_RUNS", ",".join(runs))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = json.dumps([o.get("data", {}).get("text/plain", o.get("text", "")) for o in outputs])
    assert "erils" in text and "external" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3  # rewards, evaluations, lengths
