import json

import pytest

from dllm_rl.data import build_task
from dllm_rl.evaluate import evaluate_task, ks_up_to, pass_at_k, summarize, write_results
from dllm_rl.rollout.generate import TextGenerator


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)   # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    assert ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(4) == [1, 2, 4] and ks_up_to(1) == [1]


def test_summarize_hand_records():
    def rec(uid, sample, reward, correct, formatted=True, num_tokens=10):
        return dict(uid=uid, sample=sample, reward=reward, correct=correct, formatted=formatted, num_tokens=num_tokens)
    records = [rec("a", 0, 0.0, False), rec("a", 1, 1.0, True),
               rec("b", 0, 0.5, False, False, 20), rec("b", 1, 0.0, False)]
    s = summarize(records, 2)
    assert s["pass@1"] == pytest.approx((0.5 + 0.0) / 2)
    assert s["pass@2"] == pytest.approx((1.0 + 0.0) / 2)
    assert s["best_of_1"] == pytest.approx((0.0 + 0.5) / 2)   # first sample's reward
    assert s["best_of_2"] == pytest.approx((1.0 + 0.5) / 2)
    assert s["format_rate"] == 0.75 and s["completion_tokens_mean"] == 12.5


def test_results_do_not_depend_on_batch_size(tiny_policy, char_tokenizer, tmp_path):
    task = build_task("arithmetic")
    generator = TextGenerator(tiny_policy, char_tokenizer, gen_length=16, block_length=8, steps=8, temperature=1.0)
    runs = [evaluate_task(generator, task, num_prompts=5, num_samples=3, batch_size=b, seed=4, print_fn=lambda *_: None)
            for b in (1, 4, 15)]
    for summary, records in runs[1:]:
        assert records == runs[0][1] and summary == {**runs[0][0], "seconds": summary["seconds"]}
    assert len({r["completion"] for r in runs[0][1]}) > 1
    summary, records = runs[0]
    write_results(str(tmp_path), {"arithmetic": summary}, records, {"model": "tiny"})
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) == 15 and json.loads(lines[0])["task"] == "arithmetic"
    assert json.loads((tmp_path / "summary.json").read_text())["tasks"]["arithmetic"]["num_prompts"] == 5
