"""External sources, the cross-tokenizer bridge and length control."""

import json
from pathlib import Path

import pytest
import torch

from dllm_rl.data import build_task
from dllm_rl.data.tokenizers import load_tokenizer
from dllm_rl.errors import ConfigError
from dllm_rl.external.bridge import bridge, control_length, select, window_row
from dllm_rl.external.sources import CausalLMSource, JsonlSource, SolverSource, build_source

TINY_AR = str(Path(__file__).resolve().parents[2] / "models" / "tiny-ar")


@pytest.fixture(scope="module")
def ar_tokenizer():
    return load_tokenizer(TINY_AR, "model")


def test_cross_tokenizer_round_trip(char_tokenizer, ar_tokenizer):
    text = "12*5=60\n60+7=67\n<answer>12*5+7</answer>"
    ar_ids = ar_tokenizer(text, add_special_tokens=False)["input_ids"]
    from_ar = ar_tokenizer.decode(ar_ids, skip_special_tokens=True)
    assert from_ar == text
    b = bridge(from_ar, char_tokenizer)
    assert b.lost == "" and b.text == text and len(b.ids) == len(text)  # one id per character
    assert len(ar_ids) < len(b.ids)  # the two vocabularies really differ


def test_unrepresentable_characters_are_reported(char_tokenizer):
    b = bridge("x = 3 × 4 → 12é", char_tokenizer)
    assert b.lost == "".join(sorted("×→é"))
    assert bridge("plain ascii", char_tokenizer).lost == ""


def test_window_row_fills_with_eos():
    assert window_row([5, 6], 4, eos_id=2) == [5, 6, 2, 2]
    with pytest.raises(ConfigError):
        window_row([5, 6, 7], 2, eos_id=2)


def test_length_rules(char_tokenizer):
    sudoku = build_task("sudoku")
    ex = sudoku.examples("train", 1, 0)[0]
    good = f"<answer>{ex.answer}</answer>"  # 33 characters
    long_good = "thinking " * 4 + good  # 69 characters, still correct
    items = [bridge(t, char_tokenizer) for t in (long_good, good)]
    score = lambda text: sudoku.reward(text, ex)  # noqa: E731

    kept, counts = control_length(items, score, rule="drop", window=40, tokenizer=char_tokenizer)
    assert [k for k, _, _ in kept] == [1] and counts == {"too_long": 1, "truncated": 0}

    kept, counts = control_length(items, score, rule="truncate", window=40, tokenizer=char_tokenizer)
    assert counts["truncated"] == 1 and len(kept[0][1].ids) == 40 and kept[0][1].truncated
    assert not kept[0][2].correct  # re-verified on the cut text: the answer is gone
    assert kept[1][2].correct

    kept, _ = control_length(items, score, rule="none", window=40, tokenizer=char_tokenizer)
    assert len(kept[0][1].ids) == 69 and kept[0][2].correct

    assert select([30, 10, 20], 2, "shortest") == [1, 2]
    assert select([30, 10, 20], 2, "drop") == [0, 1]


def test_solver_source_controls_length_and_is_correct():
    for name in ("sudoku", "countdown"):
        task = build_task(name)
        examples = task.examples("train", 5, 0)
        short = SolverSource(trace_steps=0).rollouts(task, examples, 2, [[0, 1]] * 5)
        full = SolverSource(trace_steps=-1).rollouts(task, examples, 1, [[0]] * 5)
        for ex, s, f in zip(examples, short, full):
            assert len(s) == 2 and s[0].text == s[1].text and s[0].behaviour_logp == 0.0
            assert task.reward(s[0].text, ex).correct and task.reward(f[0].text, ex).correct
            assert len(f[0].text) > len(s[0].text)


def test_jsonl_source(tmp_path):
    task = build_task("countdown")
    examples = task.examples("train", 2, 0)
    path = tmp_path / "ext.jsonl"
    path.write_text("".join(json.dumps({"uid": examples[0].uid, "completion": f"c{i}", "behaviour_logp": -i}) + "\n"
                            for i in range(3)))
    got = JsonlSource(str(path)).rollouts(task, examples, 2, [[7, 8], [9, 10]])
    assert len(got[0]) == 2 and {r.text for r in got[0]} <= {"c0", "c1", "c2"} and got[1] == []
    assert got == JsonlSource(str(path)).rollouts(task, examples, 2, [[7, 8], [9, 10]])  # seeded choice
    path.write_text('{"uid": "a", "completion": "x"}\n{"uid": 3}\n')
    with pytest.raises(ConfigError, match=r"ext.jsonl:2: expected an object with string fields"):
        JsonlSource(str(path))
    with pytest.raises(ConfigError, match="expected a JSONL file"):
        JsonlSource(str(tmp_path / "missing.jsonl"))


def test_build_source_names_bad_keys():
    with pytest.raises(ConfigError, match="unknown external.name 'oracle'"):
        build_source("oracle")
    with pytest.raises(ConfigError, match="unknown config key 'external.trace'"):
        build_source("solver", trace=3)


@pytest.mark.slow
def test_causal_lm_source_records_behaviour_logp():
    task = build_task("countdown")
    examples = task.examples("train", 3, 0)
    source = CausalLMSource(TINY_AR, temperature=1.0, max_new_tokens=48)
    seeds = [[11, 12], [13, 14], [15, 16]]
    got = source.rollouts(task, examples, 2, seeds)
    assert [len(g) for g in got] == [2, 2, 2]
    assert got == source.rollouts(task, examples, 2, seeds)  # deterministic given the seeds
    for rows in got:
        for r in rows:
            assert r.source == "causal_lm" and r.behaviour_logp < 0 and "<answer>" in r.text
    # the behaviour log-prob equals a teacher-forced score, by the model, of the sampled tokens and the EOS
    from dllm_rl.data.task import render_prompt

    model, tok = source.generator.model, source.generator.tokenizer
    prompt_text = render_prompt(task.prompt(examples[0]), tok)
    sample = source.generator.sample([prompt_text], [seeds[0][0]])
    ids = sample.completion_BC[0].tolist()
    completion = ids[: ids.index(tok.eos_token_id) + 1]
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).sum()
    assert got[0][0].behaviour_logp == pytest.approx(float(expected), abs=1e-3)


@pytest.mark.slow
def test_causal_lm_source_speculative_rollouts_are_the_plain_ones_in_fewer_forwards():
    """SRT on the embedded tiny-ar: greedy rollouts equal plain greedy ones; sampled rollouts do not depend on the
    tree (the same seeds give the same rows before and after it has learned the prompts), and the second round
    drafts from the first."""
    task = build_task("countdown")
    examples = task.examples("train", 4, 0)
    seeds = [[21 + 2 * i, 22 + 2 * i] for i in range(4)]
    greedy_plain = CausalLMSource(TINY_AR, temperature=0.0, max_new_tokens=48).rollouts(task, examples, 1, seeds)
    greedy_spec = CausalLMSource(TINY_AR, temperature=0.0, max_new_tokens=48, draft_tokens=6)
    same_rollouts(greedy_spec.rollouts(task, examples, 1, seeds), greedy_plain)
    same_rollouts(greedy_spec.rollouts(task, examples, 1, seeds), greedy_plain)  # now drafted from the first round
    assert greedy_spec.step_metrics()["spec_acceptance"] > 0.8  # a 4-token context may recur with another ending

    source = CausalLMSource(TINY_AR, temperature=1.0, max_new_tokens=48, draft_tokens=6, draft_history=4)
    first = source.rollouts(task, examples, 2, seeds)
    cold = source.step_metrics()
    assert cold == {"spec_acceptance": 0.0, "spec_tokens_per_forward": 1.0, "spec_forwards": 33.0}  # empty trees
    second = source.rollouts(task, examples, 2, seeds)
    warm = source.step_metrics()
    same_rollouts(second, first)  # the same seeds, the same rollouts, whatever the trees hold
    assert set(source.trees.trees) == {ex.uid for ex in examples}
    assert all(len(t) == 4 for t in source.trees.trees.values())
    assert warm["spec_acceptance"] > 0.7 and warm["spec_tokens_per_forward"] > 3  # measured 0.84 and 4.8
    assert warm["spec_forwards"] < cold["spec_forwards"] / 2
    # the behaviour log-prob is still the sampled tokens' log-probability, EOS included
    from dllm_rl.data.task import render_prompt

    model, tok = source.generator.model, source.generator.tokenizer
    prompt = tok(render_prompt(task.prompt(examples[1]), tok), add_special_tokens=False)["input_ids"]
    completion = tok(first[1][0].text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None]).sum()
    assert first[1][0].behaviour_logp == pytest.approx(float(expected), abs=1e-3)


@pytest.mark.slow
def test_causal_lm_source_samples_the_same_rows_with_and_without_drafts():
    """At temperature 1 (the default) `draft_tokens=0` and `draft_tokens=4` are one sampling rule: the same seeds
    give the same rows, before the trees have learned anything and after; a capacity smaller than the prompts'
    rollouts drops trees and changes nothing either."""
    task = build_task("countdown")
    examples = task.examples("train", 4, 0)
    seeds = [[31 + 3 * i, 32 + 3 * i, 33 + 3 * i] for i in range(4)]
    plain = CausalLMSource(TINY_AR, temperature=1.0, max_new_tokens=40)
    drafted = CausalLMSource(TINY_AR, temperature=1.0, max_new_tokens=40, draft_tokens=4)
    small = CausalLMSource(TINY_AR, temperature=1.0, max_new_tokens=40, draft_tokens=4, draft_capacity=60)
    expected = plain.rollouts(task, examples, 3, seeds)
    for round_ in range(2):
        same_rollouts(drafted.rollouts(task, examples, 3, seeds), expected)
        same_rollouts(small.rollouts(task, examples, 3, seeds), expected)
    assert drafted.step_metrics()["spec_acceptance"] > 0.5  # the second round drafted from the first
    assert len(small.trees) < len(examples) and (small.trees.tokens <= 60 or len(small.trees) == 1)


def same_rollouts(got, expected):
    """The same texts; behaviour log-probs equal up to rounding (a multi-token forward sums in another order)."""
    assert [[r.text for r in rows] for rows in got] == [[r.text for r in rows] for rows in expected]
    for rows, expected_rows in zip(got, expected):
        for r, e in zip(rows, expected_rows):
            assert r.behaviour_logp == pytest.approx(e.behaviour_logp, abs=1e-4)
