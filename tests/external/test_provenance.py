"""Provenance in evaluation: held-out pass@1 split by whether the external policy solves the prompt."""

import json
from dataclasses import dataclass
from contextlib import nullcontext

import pytest

from dllm_rl.data import build_task
from dllm_rl.data.task import draw_examples
from dllm_rl.external.provenance import external_solves, split_pass1
from dllm_rl.external.sources import JsonlSource, SolverSource
from dllm_rl.held_out import HeldOut
from dllm_rl.train import train

SUDOKU = build_task("sudoku")
SOLVER = SolverSource()


def record(uid, correct):
    return {"uid": uid, "correct": correct}


def test_split_pass1_by_hand():
    solved = {"a": True, "b": True, "c": False, "d": False, "e": False}
    records = [record("a", True), record("b", False), record("c", True), record("d", True), record("e", False)]
    assert split_pass1(records, solved) == pytest.approx(
        {"eval/external_solved_fraction": 2 / 5, "eval/pass1_external_solved": 1 / 2,
         "eval/pass1_external_failed": 2 / 3})
    # a side with no prompt is not logged (no 0/0)
    assert split_pass1(records[:2], solved) == {"eval/external_solved_fraction": 1.0, "eval/pass1_external_solved": 0.5}


def write_source(path, entries):
    """A JSONL external source: (example, completion text) per line."""
    path.write_text("".join(json.dumps({"uid": ex.uid, "completion": text}) + "\n" for ex, text in entries))
    return JsonlSource(str(path))


def test_external_solves_asks_the_source_and_judges_with_the_tasks_reward(tmp_path):
    ex = SUDOKU.examples("test", 4, 0)
    right = [SOLVER.completion(SUDOKU, e) for e in ex]
    # 0: right; 1: wrong; 2: nothing stored; 3: one wrong and one right completion (any of the samples counts)
    source = write_source(tmp_path / "ext.jsonl", [(ex[0], right[0]), (ex[1], right[0]), (ex[3], "no answer"),
                                                   (ex[3], right[3])])
    solved = external_solves(source, SUDOKU, ex, samples=2, seed=0)
    assert solved == {ex[0].uid: True, ex[1].uid: False, ex[2].uid: False, ex[3].uid: True}
    assert all(external_solves(SOLVER, SUDOKU, ex, samples=1, seed=0).values())


@dataclass
class Completion:
    text: str
    num_tokens: int = 1


def test_held_out_splits_greedy_pass1_by_provenance():
    examples = draw_examples(SUDOKU, "test", 4, 0, "eval_prompts")
    good = {examples[i].uid: SOLVER.completion(SUDOKU, examples[i]) for i in (0, 1, 3)}
    by_prompt = {SUDOKU.prompt(e): e.uid for e in examples}

    def greedy(prompts, seeds):  # solves prompts 0, 1, 3
        return [Completion(good.get(by_prompt[p], "no answer")) for p in prompts]

    solved = {examples[0].uid: True, examples[1].uid: False, examples[2].uid: True, examples[3].uid: False}
    held_out = HeldOut(greedy, greedy, SUDOKU, None, 4, 0, 0, nullcontext, external_solved=solved)
    assert [e.uid for e in held_out.examples()] == [e.uid for e in examples]
    out = held_out()
    assert out["eval/pass@1"] == 0.75
    assert out["eval/pass1_external_solved"] == 0.5 and out["eval/pass1_external_failed"] == 1.0
    assert out["eval/external_solved_fraction"] == 0.5
    assert "eval/pass1_external_solved" not in HeldOut(greedy, greedy, SUDOKU, None, 4, 0, 0, nullcontext)()


def test_a_run_with_an_external_source_logs_the_split(saved_model, tmp_path):
    held_out = draw_examples(SUDOKU, "test", 4, 0, "eval_prompts")
    train_examples = SUDOKU.examples("train", 8, 0)
    # the source solves every train prompt, and held-out prompts 0 and 2 only
    entries = [(e, SOLVER.completion(SUDOKU, e)) for e in train_examples + held_out[0:3:2]]
    write_source(tmp_path / "ext.jsonl", entries + [(held_out[1], "no answer")])
    lines = []
    run = tmp_path / "run"
    train(SUDOKU, model=saved_model, run_dir=str(run), external={"name": "jsonl", "path": str(tmp_path / "ext.jsonl")},
          rollout={"gen_length": 48, "block_length": 48, "steps": 12, "temperature": 1.0},
          likelihood={"name": "mean_field"}, prompts_per_step=2, group_size=2, minibatch_size=4, train_pool=8,
          eval_every=1, eval_prompts=4, eval_external_samples=1, tensorboard=False, steps=1, print_fn=lines.append)
    assert any("solves 2 of 4 held-out prompts (1 sample each)" in line for line in lines)
    evals = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval/pass@1" in m]
    assert len(evals) == 2  # before step 1 and after it
    for m in evals:
        assert m["eval/external_solved_fraction"] == 0.5
        both = 0.5 * m["eval/pass1_external_solved"] + 0.5 * m["eval/pass1_external_failed"]
        assert both == pytest.approx(m["eval/pass@1"])
