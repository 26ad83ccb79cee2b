import re

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

from dllm_rl.data import build_task
from dllm_rl.data.task import Solution
from dllm_rl.errors import ConfigError
from dllm_rl.policy.schedule import MaskingSchedule
from dllm_rl.sft import (
    SFTExample, causal_batch, causal_sft_loss, diffusion_batch, diffusion_sft_loss, solver_examples, train_sft,
)


def test_diffusion_batch_layout(char_tokenizer):
    ex = [SFTExample("ab\n", "<answer>1</answer>"), SFTExample("abcd\n", "x")]
    ids, mask, P = diffusion_batch(char_tokenizer, ex, gen_length=20)
    assert ids.shape == (2, 5 + 20) and P == 5
    assert mask[0].tolist() == [0, 0] + [1] * 23
    assert char_tokenizer.decode(ids[0, 2:5]) == "ab\n"
    window = ids[0, P:].tolist()
    n = len("<answer>1</answer>")
    assert char_tokenizer.decode(window[:n]) == "<answer>1</answer>"
    assert window[n:] == [char_tokenizer.eos_token_id] * (20 - n)  # EOS fill, as LLaDA's SFT


def test_causal_batch_labels_only_the_completion(char_tokenizer):
    ids, mask, labels = causal_batch(char_tokenizer, [SFTExample("ab", "c"), SFTExample("a", "bcd")])
    eos = char_tokenizer.eos_token_id
    c, b, d = (char_tokenizer.convert_tokens_to_ids(t) for t in "cbd")
    assert labels[0].tolist() == [-100, -100, c, eos, -100]  # right padding is ignored
    assert labels[1].tolist() == [-100, b, c, d, eos]
    assert mask[0].tolist() == [1, 1, 1, 1, 0]


def test_diffusion_loss_equals_a_slow_reference(tiny_policy, char_tokenizer):
    ids, mask, P = diffusion_batch(char_tokenizer, [SFTExample("ab\n", "12"), SFTExample("a\n", "345")], 8)
    schedule = MaskingSchedule()
    loss = diffusion_sft_loss(tiny_policy, ids, mask, P, schedule, torch.Generator().manual_seed(3))
    # Replay the same draws: t per row, then one uniform per position; mask a completion token iff u < t.
    g = torch.Generator().manual_seed(3)
    t = schedule.sample_t(2, generator=g)
    total = 0.0
    noisy, masked = schedule.add_noise(ids, t, tiny_policy.mask_id, generator=g,
                                       maskable_BL=torch.arange(ids.shape[1]) >= P)
    assert not masked[:, :P].any()  # the prompt is never masked
    logits = tiny_policy.logits(noisy, mask)
    for b in range(2):
        for i in range(P, ids.shape[1]):
            if masked[b, i]:
                total += F.cross_entropy(logits[b, i], ids[b, i]).item() / t[b].item()
    torch.testing.assert_close(loss.item(), total / (2 * 8), rtol=1e-5, atol=1e-6)


def test_masked_mean_weighting_is_the_mean_ce_over_masked_tokens(tiny_policy, char_tokenizer):
    ids, mask, P = diffusion_batch(char_tokenizer, [SFTExample("ab\n", "12"), SFTExample("a\n", "345")], 8)
    schedule = MaskingSchedule()
    loss = diffusion_sft_loss(tiny_policy, ids, mask, P, schedule, torch.Generator().manual_seed(3), "masked_mean")
    g = torch.Generator().manual_seed(3)
    t = schedule.sample_t(2, generator=g)
    noisy, masked = schedule.add_noise(ids, t, tiny_policy.mask_id, generator=g,
                                       maskable_BL=torch.arange(ids.shape[1]) >= P)
    ce = F.cross_entropy(tiny_policy.logits(noisy, mask).float().transpose(1, 2), ids, reduction="none")
    torch.testing.assert_close(loss, ce[masked].mean())
    with pytest.raises(ValueError, match="weighting must be 'elbo' or 'masked_mean', got 'uniform'"):
        diffusion_sft_loss(tiny_policy, ids, mask, P, schedule, torch.Generator(), "uniform")


def test_solver_examples_draw_past_declined_prompts_and_name_a_task_without_solver():
    free = solver_examples(build_task("countdown"), 30, 0, with_steps=False, print_fn=lambda *_: None)
    assert [e.prompt for e in free] == [build_task("countdown").prompt(x)
                                        for x in build_task("countdown").examples("train", 30, 0)]
    said = []
    kept = solver_examples(build_task("countdown", solver_style="in_order"), 30, 0, with_steps=False,
                           print_fn=said.append)
    assert len(kept) == 30 and len({e.prompt for e in kept}) == 30
    drawn = int(said[0].split(" took ")[1])
    assert drawn > 30 and said[0].startswith(f"countdown: the solver declined {drawn - 30} of {drawn} prompts")
    kept_prompts = [e.prompt for e in kept]
    first = [e.prompt for e in free if e.prompt in kept_prompts]  # the first 30 prompts it answers come first
    assert 0 < len(first) < 30 and kept_prompts[: len(first)] == first

    class NoSolver:
        name = "gsm8k"
        prompt_style = "compact"
        examples = build_task("countdown").examples
        prompt = staticmethod(lambda ex: ex.question)
        solve = staticmethod(lambda ex: None)

    with pytest.raises(ConfigError, match="task 'gsm8k' has no exact solver or reference solutions to make SFT data "
                                          "from: none for 40 prompts"):
        solver_examples(NoSolver(), 5, 0)                  # 5, then 10, 20 and 40 (8n) prompts drawn
    firsts, late = {x.uid for x in NoSolver.examples("train", 3, 0)}, NoSolver()
    late.solve = lambda ex: None if ex.uid in firsts else Solution("1")
    said = []
    assert len(solver_examples(late, 3, 0, print_fn=said.append)) == 3     # all of the first 3 declined
    assert said == ["gsm8k: the solver declined 3 of 6 prompts, so 3 examples took 6"]


@pytest.mark.slow
def test_sft_loss_falls_for_both_model_kinds(char_tokenizer, make_dllm):
    data = solver_examples(build_task("arithmetic", digits=1, num_operands=2), 60, 0)
    policy = make_dllm(hidden=64)
    schedule = MaskingSchedule()
    policy.model.train()
    log = train_sft(lambda batch, g: diffusion_sft_loss(policy, *diffusion_batch(char_tokenizer, batch, 32),
                                                        schedule, g),
                    policy.model.parameters(), data, steps=60, batch_size=16, lr=3e-3, warmup=5, log_every=20,
                    print_fn=lambda *_: None)
    assert log[-1]["loss"] < 0.8 * log[0]["loss"]

    config = Qwen2Config(vocab_size=len(char_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    ar = Qwen2ForCausalLM(config)
    log = train_sft(lambda batch, g: causal_sft_loss(ar, *causal_batch(char_tokenizer, batch)), ar.parameters(), data,
                    steps=60, batch_size=16, lr=3e-3, warmup=5, log_every=20, print_fn=lambda *_: None)
    assert log[-1]["loss"] < 0.5 * log[0]["loss"]


def test_a_constant_schedule_run_is_the_prefix_of_a_longer_one_and_after_step_can_end_it(char_tokenizer, make_dllm):
    """With no decay, the weights after n steps of a longer run are those of an n-step run (so a run stopped by
    `after_step`, say when an evaluation says so, is reproduced by its step count), and `after_step` ends a run
    where it says, with its log ending there."""
    data = solver_examples(build_task("arithmetic", digits=1, num_operands=2), 40, 0, with_steps=False,
                           print_fn=lambda *_: None)
    schedule = MaskingSchedule()

    def run(steps, after_step=None):
        policy = make_dllm(hidden=32)
        policy.model.train()
        log = train_sft(lambda batch, g: diffusion_sft_loss(policy, *diffusion_batch(char_tokenizer, batch, 24),
                                                            schedule, g),
                        policy.model.parameters(), data, steps=steps, batch_size=8, lr=3e-3, warmup=2,
                        schedule="constant", log_every=2, print_fn=lambda *_: None, after_step=after_step)
        return log, [p.detach().clone() for p in policy.model.parameters()]

    short_log, short = run(5)  # past the warm-up, where a decaying rate would differ between 5 and 8 steps
    seen = []
    long_log, stopped = run(8, after_step=lambda done: seen.append(done) or done == 5)
    assert seen == [1, 2, 3, 4, 5] and [e["step"] for e in long_log] == [2, 4, 5] == [e["step"] for e in short_log]
    assert all(torch.equal(a, b) for a, b in zip(short, stopped))
    _, longer = run(6)
    assert not all(torch.equal(a, b) for a, b in zip(short, longer))


MATH_ROWS = {
    "gsm8k": [{"question": f"What is {i} + {i}?", "answer": f"Add {i} and {i}.\nThat is {2 * i}.\n#### {2 * i}"}
              for i in range(1, 5)],
    "math500": [{"problem": f"Compute ${i} \\cdot 3$.", "solution": f"Multiply: ${i} \\cdot 3 = {3 * i}$.",
                 "answer": str(3 * i)} for i in range(1, 5)],
}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["sudoku", "countdown", "arithmetic", "gsm8k", "math500"])
def test_sft_runs_with_its_defaults_on_every_task_writes_metrics_and_never_overwrites(task, tmp_path, capsys):
    """Sudoku's solver completions with steps do not fit a 64-token window: the default window is fitted to the
    examples. GSM8K and MATH500 (no solver) train on the files' reference solutions."""
    import json

    from dllm_rl import cli

    extra = []
    if task in MATH_ROWS:
        train_file = tmp_path / "train.jsonl"
        train_file.write_text("".join(json.dumps(row) + "\n" for row in MATH_ROWS[task]))
        extra = [f"task.train_file={train_file}"]
    out = tmp_path / "sft"
    args = ["sft", f"task={task}", "steps=4", "batch_size=2", "examples=8", "log_every=2", f"output_dir={out}", *extra]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    assert "examples longer than" not in printed and re.search(r"gen_length=\d+: the window that holds", printed)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in logged] == [2, 4] and all(m["loss"] > 0 for m in logged)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "model.safetensors").is_file()
    before = (out / "model.safetensors").read_bytes()
    assert cli.main(args) == 2
    assert f"output_dir='{out}' exists and is not empty; choose a new directory" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before


def test_a_window_no_example_fits_says_what_to_set(char_tokenizer):
    from dllm_rl.sft import drop_overlong

    with pytest.raises(ConfigError, match=r"gen_length=4: no example fits \(the shortest completion is 9 tokens\); "
                                          r"use gen_length=null .* or with_steps=false"):
        drop_overlong([SFTExample("p", "123456789"), SFTExample("q", "1234567890")], char_tokenizer, 4,
                      print_fn=lambda *_: None)
