"""notebooks/evaluate.ipynb runs on tiny runs' artefacts, as the README's command runs it, and is committed
without outputs; its figures (`dllm_rl.plots`) show what there is and keep runs apart."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib
import nbformat
import pytest
from nbclient import NotebookClient

from dllm_rl import analysis, plots
from dllm_rl.data import build_task
from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from tests.conftest import DigitPass

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "evaluate.ipynb"


def test_notebook_is_committed_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory, char_tokenizer):
    """runs/grpo and runs/erils (sampled evaluations, best-of-2), runs/greedy (greedy evaluations only)."""
    from tests.conftest import save_tiny_dllm

    root = tmp_path_factory.mktemp("notebook")
    model = save_tiny_dllm(root / "model", char_tokenizer)
    task = build_task("sudoku")
    common = dict(rollout={"gen_length": 40, "block_length": 40, "steps": 10, "temperature": 1.0},
                  likelihood={"name": "mean_field"}, algo={"advantage": "mean"}, prompts_per_step=2, group_size=2,
                  minibatch_size=4, steps=3, eval_every=1, eval_prompts=4, sample_every=1, tensorboard=False,
                  print_fn=lambda *_: None)
    for name, external, samples in (("grpo", {"name": "none"}, 2), ("erils", {"name": "solver"}, 2),
                                    ("greedy", {"name": "none"}, 0)):
        train(task, model=str(model), run_dir=str(root / "runs" / name), external=external, eval_samples=samples,
              mixing={"per_prompt": 1}, **common)
    # a multi-turn run: the counter environment of tests/conftest.py, short actions
    train(DigitPass(), model=str(model), run_dir=str(root / "runs" / "agent"), env={"name": "tests.conftest:Counter"},
          external={"name": "none"}, **{**common, "rollout": {**common["rollout"], "gen_length": 8, "block_length": 8,
                                                               "steps": 4}, "minibatch_size": 24})
    return root


def test_analysis_tables(tiny_runs):
    loaded = analysis.load_runs([tiny_runs / "runs" / "grpo", tiny_runs / "runs" / "erils"])
    table = analysis.summary(loaded)
    assert list(table.index) == ["grpo", "erils"] and "eval/best_of_2 end" in table.columns
    # every evaluation's per-prompt results are kept (held_out.jsonl): the gain comes with its paired s.e.
    gain = analysis.held_out_gain(loaded[0])
    assert gain["prompts"] == 4 and gain["start_step"] == 0 and gain["end_step"] == 3
    assert table.loc["grpo", "pass@1 gain"] == gain["gain"] and "reward last s.e." in table.columns
    assert list(analysis.reward_by_source(loaded[1]).columns) == ["on_policy", "external"]
    assert set(analysis.last_samples(loaded[1])["source"]) == {"on_policy", "external"}


def test_relative_run_paths_are_taken_from_where_the_user_stands(tiny_runs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the notebook's folder, say
    monkeypatch.setenv("PWD", str(tiny_runs))  # the shell the command was typed in
    assert analysis.resolve_run_dir("runs/grpo") == tiny_runs / "runs" / "grpo"
    with pytest.raises(ConfigError, match=rf"run directory 'runs/nope' is not in {tmp_path} nor in {tiny_runs}"):
        analysis.resolve_run_dir("runs/nope")


def test_figures_show_what_there_is_with_whole_steps_and_runs_apart(tiny_runs):
    runs = analysis.load_runs([tiny_runs / "runs" / n for n in ("grpo", "erils", "greedy")])
    greedy_only = plots.eval_figure(runs[2:])
    assert len(greedy_only.axes) == 1  # no empty best-of-k panel
    both = plots.eval_figure(runs)
    assert len(both.axes) == 2 and {line.get_label() for line in both.axes[1].lines} >= {"grpo best_of_2"}
    no_evals = [{**runs[0], "metrics": runs[0]["metrics"].drop(columns=[c for c in runs[0]["metrics"]
                                                                         if c.startswith("eval/")])}]
    assert plots.eval_figure(no_evals) is None
    for figure in (plots.reward_figure(runs), both, plots.length_figure(runs)):
        figure.canvas.draw()
        for ax in figure.axes:
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
            looks = [(line.get_color(), line.get_marker(), line.get_linestyle()) for line in ax.lines
                     if not line.get_label().startswith("_")]  # error bars' caps are unlabelled
            assert len(set(looks)) == len(looks)  # no two curves drawn alike
    held_out = both.axes[0]  # greedy pass@1 with error bars, on an axis from 0 (not zoomed into the noise)
    assert len(held_out.containers) == 3 and held_out.get_ylim()[0] == 0.0
    reward = plots.reward_figure(runs).axes[0]
    erils = [line for line in reward.lines if line.get_label().startswith("erils")]
    assert {line.get_linestyle() for line in erils} == {"-", "--"}  # on-policy solid, external dashed


def test_the_multi_turn_figure_plots_training_and_held_out_episodes(tiny_runs):
    runs = analysis.load_runs([tiny_runs / "runs" / n for n in ("grpo", "agent")])
    assert plots.episode_figure(runs[:1]) is None  # no environment played
    figure = plots.episode_figure(runs)
    assert [ax.get_title() for ax in figure.axes] == ["success", "turns per episode", "invalid actions"]
    metrics = runs[1]["metrics"]
    for ax, key in zip(figure.axes, ("pass@1", "turns", "invalid")):
        labels = {line.get_label(): line for line in ax.lines}
        assert set(labels) == {"agent training", "agent held-out"}
        held_out = labels["agent held-out"].get_ydata()
        assert list(held_out) == metrics[f"eval/{key}"].dropna().tolist() and len(held_out) == 4  # steps 0-3


def readme_notebook_command() -> str:
    match = re.search(r"`(DLLM_RL_RUNS=\S+ jupyter nbconvert [^`]+)`", (ROOT / "README.md").read_text())
    assert match, "the README names no notebook command"
    return match.group(1)


@pytest.mark.slow
def test_the_readme_notebook_command_runs_as_written(tiny_runs):
    """From a folder holding notebooks/ and the runs the command names (relative paths), with the tools the
    `notebook` extra installs: an HTML report with the three figures."""
    command = readme_notebook_command()
    names = re.match(r"DLLM_RL_RUNS=(\S+) ", command).group(1).split(",")
    where = tiny_runs / "user"
    (where / "notebooks").mkdir(parents=True)
    shutil.copy(NOTEBOOK, where / "notebooks")
    for name, run in zip(names, ("grpo", "erils")):
        shutil.copytree(tiny_runs / "runs" / run, where / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PWD": str(where)}
    result = subprocess.run(["bash", "-c", command], cwd=where, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    html = (where / "runs" / "evaluate.html").read_text()
    assert html.count("image/png") >= 3 and "external" in html and "Traceback" not in html
    assert not (where / "notebooks" / "evaluate.html").exists()  # nothing written beside the tracked notebook


@pytest.mark.slow
def test_notebook_executes_on_tiny_runs(tiny_runs, monkeypatch):
    monkeypatch.setenv("DLLM_RL_RUNS", ",".join(str(tiny_runs / "runs" / n)
                                                for n in ("grpo", "erils", "greedy", "agent")))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tiny_runs)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = json.dumps([o.get("data", {}).get("text/plain", o.get("text", "")) for o in outputs])
    assert "erils" in text and "external" in text
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4  # rewards, evaluations, episodes, lengths
