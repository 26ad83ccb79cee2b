"""Build the embedded default models in models/: a tiny dLLM policy and a stronger tiny AR external policy.

Both are trained by SFT on exact-solver data of Sudoku 4x4 and Countdown (compact prompts; see SFT_TASKS and
WITH_STEPS for how each model's answers are written), then evaluated on held-out test prompts; each
directory gets config, tokenizer, safetensors weights, eval.json and a model card (README.md).

The two models use different tokenizers on purpose (character-level for the dLLM, byte-level BPE with
single-digit tokens for the AR model), so that external rollouts really cross tokenizers. The dLLM is
trained less far than the AR model: it must leave RL headroom (DLLM_PHASES and its headroom rule), while the AR
model plays the stronger external policy.

models/tiny-dllm is DLLM_PHASES' build (seed 0, fp32, 108 minutes; its card): both tasks in the headroom band,
answers at 64, 128 and 256 tokens under protocol=d1. The model before it (greedy Sudoku 0.380, Countdown 0.175,
64-token windows) was the single-phase recipe of commit 9992aa5; numbers in the docs measured on it say so.

    python scripts/build_models.py                  # both models, as committed
    python scripts/build_models.py --only dllm --dllm-steps 300,100 --eval-prompts 50 --out /tmp/m   # quick look
    python scripts/build_models.py --only agent    # the agent (models/tiny-dllm-agent) from models/tiny-dllm
                                                   # (scripts/build_agent.py, which runs alone too)

What reads the dLLM's weights, to redo after a rebuild (in its own commit): tests/test_embedded_models.py's SUBSET
(and AGENT_SUBSET after scripts/build_agent.py), tests/rollout/test_block_cache.py's bounds, tests/test_learning.py's
steps (scripts/learning_check.py), the README's main-job output and models table, docs/estimators.md's protocol
table (scripts/protocol_table.py), docs/learning.md (scripts/diagnose_learning.py), docs/benchmarks.md's decoding
tables (scripts/bench_decoding.py), and the sweeps' kept runs (docs/long_runs/, docs/curation_benchmark/,
docs/bench_multi_turn/): their settings do not name the model, so move them aside before a sweep reruns.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import dllm_rl  # noqa: F401  (registers the native model with the Auto classes)
from dllm_rl.data import build_task
from dllm_rl.data.tokenizers import build_bpe_tokenizer, build_char_tokenizer, load_tokenizer
from dllm_rl.evaluate import evaluate_task
from dllm_rl.policy.adapters import wrap_model
from dllm_rl.policy.modeling import DiffusionLM, DiffusionLMConfig
from dllm_rl.policy.schedule import MaskingSchedule
from dllm_rl.precision import resolve_bf16
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.sft import (causal_batch, drop_overlong, causal_sft_loss, diffusion_batch, diffusion_sft_loss,
                         solver_examples, train_sft)

# The task settings the embedded models (and the default training run) use.
# Sudoku and Countdown, the tasks of the core method's experiments; the models are evaluated (and trained by
# RL) on the task defaults (Sudoku: 8-12 blanks). Their SFT data has easier puzzles (6-10 blanks).
TASKS = {"countdown": {}, "sudoku": {}}
# Per model. The dLLM's Countdown answers are "aligned" (solver_style): the numbers in the prompt's order, no
# brackets, a space before each operator, "83 -64 -4" for [83, 64, 4]; with its tokenizer writing every
# number below 100 as two digits (pad_single_digits), each digit of the answer then sits at one fixed
# distance from the same digit in the prompt. Copying the numbers is the part of Countdown this small
# bidirectional model failed to learn otherwise (1,500 steps each, 0-2% pass@1): free answers in
# characters; whole-number tokens (build_char_tokenizer(number_digits=2)) with in-order or aligned answers,
# where the copy is an identity over ~100 rare tokens (cross-entropy at the answer's numbers stayed at
# 2.4 nats). With two-digit padding and aligned answers, 300 Countdown-only steps already copy the numbers
# (0.1 nats per digit) and reach 18% pass@1; what is left to learn is the choice of operators. Measured again
# (Countdown-only, batch 64, lr 2e-3 cosine, greedy on 100 test prompts, window 64): 0.00 pass@1 at format rate
# 0.99-1.00 for aligned at 300 steps, free at 300, aligned_first at 300 and 800, and aligned_first at 800 with
# windows of 64/128/256 tokens (half the batches at 64; that model keeps format 0.99 decoding 128 and 256 tokens,
# where free at 300 steps, trained at 64 alone, wrote 0.58 at 128): this model reaches Countdown only late in a
# long annealed build (0.175 here at 1,500). A build with those windows, a context of 512, aligned_first and a
# constant lr 1e-3 (pass@1 on 64 test prompts every 100 steps) kept Countdown at 0.000-0.016 up to step 1,000
# while Sudoku jumped from 0.000 (step 700) to 0.109, 0.297, 0.406 (steps 800, 900, 1,000).
SFT_TASKS = {
    "dllm": {"countdown": {"solver_style": "aligned"}, "sudoku": {"blanks": [6, 10]}},
    "ar": {"countdown": {}, "sudoku": {"blanks": [6, 10]}},
}
# Which completions carry the solver's step trace. The AR model writes Countdown's steps before the answer;
# the dLLM answers directly (at this size it fails to learn the traces: 0% pass@1 on Countdown after 1,200
# steps), so external rollouts are longer than the dLLM's own, the situation ERILS's length control is for.
# Sudoku traces (one step per blank) made the AR model worse at 1,500 steps (12.5% against 33.5% without),
# so both answer Sudoku directly.
WITH_STEPS = {"dllm": {"countdown": False, "sudoku": False}, "ar": {"countdown": True, "sudoku": False}}
# Examples per task, as a share of --examples-per-task. The dLLM learns Sudoku in a sudden jump as its share
# grows (1,500 steps each; Countdown / Sudoku greedy pass@1): Sudoku share 0.5 -> 12.5% / 0.0%, 0.75 -> 17.5% /
# 38.0% (the model before the phased one, 04ca01e), 1.0 -> 7.0% / 60.5%.
SFT_SHARE = {"dllm": {"countdown": 1.0, "sudoku": 0.75}, "ar": {"countdown": 1.0, "sudoku": 1.0}}
GEN_LENGTH = 64  # the completion window of evaluation (and of the AR model's SFT)

# The dLLM's SFT runs in phases on one model, each with its own optimizer, schedule, data and windows:
# - phase 1 is the recipe that taught this model Countdown (window 64 alone, aligned answers; see SFT_TASKS) with
#   less Sudoku than the single-phase model's 0.75, which had Sudoku at 0.38: too far for RL to show anything;
# - phase 2 teaches what the protocols need and keeps what phase 1 learnt: completion windows of 64, 128 and 256
#   tokens (a batch's window drawn by these shares; the EOS fill after the answer is what the long windows add),
#   Countdown answers in `aligned_first` (aligned where the prompt's order allows one, else any order: every
#   solvable instance has an answer), a small constant lr. With `every`, the headroom rule evaluates the model
#   (greedy, HEADROOM_PROMPTS test prompts per task, window 64) every `every` steps from step `from` on, and
#   ends the phase at the first checkpoint with both tasks in HEADROOM, else keeps the checkpoint nearest to it;
#   the next phase starts from what the rule kept (phase 1's rule is there to catch Sudoku's jump in the band).
# Measured (build seed 0, greedy pass@1 on 64 test prompts, window 64, s.e. about 0.045 near 0.15):
# - long windows from the first step keep Countdown near zero: three 1,500-step builds (lr 2e-3 cosine, windows
#   64/128/256 at 50/25/25% or 70/15/15%, aligned or aligned_first) read 0.000-0.047 at every evaluation from step
#   500 on, against 0.175 for the window-64 build;
# - Sudoku's jump is not placed by the share: with windows 70/15/15 and Sudoku share 0.65 it came at steps 700-1,100
#   (0.078, 0.125, 0.172, 0.203, 0.359) with aligned_first and not by 1,500 with aligned answers;
# - 300 steps of phase 2's windows at lr 3e-4 (Sudoku share 0.75) on the old window-64 model kept Countdown at
#   0.09-0.22 (0.172 at 0 and 300) and Sudoku at 0.34-0.39, and made 128 and 256 decode under protocol=d1
#   (Countdown 0.109 / 0.109 / 0.062, Sudoku 0.219 / 0.266 / 0.281 at 64 / 128 / 256, format 1.000; the old model
#   wrote 0.000 at 128).
# - These phases, build seed 0, in fp32 (an AVX2-only CPU, 2.1-2.3 s a step at window 64): phase 1 ended at loss
#   0.082, Countdown 0.078 and Sudoku 0.000 (format 1.000 on both); phase 2 at lr 6e-4 (loss 0.68 at its step 100,
#   0.17 at 200) read Countdown 0.016, 0.016, 0.188, 0.016, 0.031 and Sudoku 0.000, 0.000, 0.016, 0.016, 0.000 at
#   its steps 50-250, where the run was stopped (no checkpoint in the band yet; phase 2 needs about 3.5 s a step
#   and 1.5 minutes an evaluation here). Countdown swings at this lr: the next try is phase 2 at 3e-4, as the probe.
# - models/tiny-dllm (these phases, build seed 0, fp32, 108 minutes): phase 1's rule (from step 900,
#   Sudoku share 0.6) read 0.031/0.031, 0.047/0.031 and 0.078/0.109 (Countdown/Sudoku) at steps 900, 1,050,
#   1,200 and ended the phase there; phase 2 at lr 3e-4 (loss 0.85 at its step 100, 0.10 at 600) kept Sudoku at
#   0.062-0.141 while Countdown sat at 0.016-0.031 from its step 150 to 550 and came back to 0.062 at 600 (Sudoku
#   0.109), the rule's only phase-2 checkpoint in the band. On 200 test prompts: Countdown 0.090 (format 0.980), Sudoku
#   0.070; under protocol=d1 (64 prompts) 0.062/0.062/0.062 and 0.078/0.062/0.078 at 64/128/256, format 1.000
#   everywhere. Its block cache agrees with the exact sampler on 97.0% (prefix, dual) and 98.0% (dual, refresh 4) of 32
#   greedy Sudoku rollouts' tokens; its first 32 test prompts: Countdown 4, Sudoku 3 right. tests/test_learning.py's
#   runs on it (fp32, 8 Sudoku prompts, their pinned steps and lr 1e-4; training reward starts near 0.08): rise over 5
#   steps mean_field -0.025, elbo +0.050, coupled -0.042, espo +0.108, ordered +0.092, left_to_right +0.054, spg -0.008,
#   ERILS +0.129 against the margin 0.10; ordered, left_to_right and ERILS still rising at their end. The tests now
#   score their pool with the fraction of blanks right, where every run clears its margin (docs/learning.md).
DLLM_PHASES = (
    {"steps": 1500, "lr": 2e-3, "schedule": "cosine", "warmup": 100, "windows": {64: 1.0},
     "countdown": "aligned", "sudoku_share": 0.6, "every": 150, "from": 900},
    {"steps": 600, "lr": 3e-4, "schedule": "constant", "warmup": 20, "windows": {64: 0.5, 128: 0.25, 256: 0.25},
     "countdown": "aligned_first", "sudoku_share": 1.0, "every": 50, "from": 150},
)
HEADROOM = (0.05, 0.2)  # greedy pass@1 the dLLM should start RL at on both tasks: mixed groups at group size 6
HEADROOM_PROMPTS = 64
CONTEXT = 512  # prompt (under 100 tokens with compact prompts) + the longest window, 256
D1_LENGTHS = (64, 128, 256)  # the card's protocol=d1 table


def sft_data(n_per_task: int, seed: int, model: str, share: dict | None = None, countdown: str | None = None):
    data = []
    for name, kwargs in SFT_TASKS[model].items():
        if name == "countdown" and countdown is not None:
            kwargs = {**kwargs, "solver_style": countdown}
        data += solver_examples(build_task(name, **kwargs), round(n_per_task * (share or SFT_SHARE[model])[name]),
                                seed, with_steps=WITH_STEPS[model][name])
    return data


def headroom_gap(evals: dict) -> float:
    """How far the tasks' pass@1 lie outside HEADROOM, summed (0: both inside)."""
    low, high = HEADROOM
    return sum(max(0.0, low - s["pass@1"], s["pass@1"] - high) for s in evals.values())


class HeadroomStop:
    """train_sft's after_step for a phase: every `every` steps from `start` on, evaluate; end the phase at the
    first checkpoint in HEADROOM, and remember the nearest one (its weights; the later of equals), which
    `keep_best` restores when none was inside."""

    def __init__(self, model, generator: TextGenerator, offset: int, every: int, start: int = 0, print_fn=print):
        self.model, self.generator, self.offset, self.every, self.print = model, generator, offset, every, print_fn
        self.start = start  # the first step evaluated: a phase learns what it is for before it may stop
        self.best: tuple[float, int, dict] | None = None  # (gap, step, weights) of the nearest checkpoint
        self.history: list[dict] = []

    def __call__(self, step: int) -> bool:
        if not self.every or step % self.every or step < self.start:
            return False
        self.model.eval()
        evals = evaluate_all(self.generator, HEADROOM_PROMPTS, "headroom", print_fn=lambda *_: None)
        self.model.train()
        gap, at = headroom_gap(evals), self.offset + step
        self.history.append({"step": at, **{t: s["pass@1"] for t, s in evals.items()}})
        self.print(f"headroom at step {at}: " + ", ".join(f"{t} {s['pass@1']:.3f}" for t, s in evals.items()))
        if self.best is None or gap <= self.best[0]:  # of equals the later: it has done more of the phase's work
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.best = (gap, at, state)
        return gap == 0.0

    def keep_best(self) -> int | None:
        """Load the nearest checkpoint's weights; return its step (None when nothing was evaluated)."""
        if self.best is None:
            return None
        self.model.load_state_dict(self.best[2])
        return self.best[1]


def evaluate_all(generator: TextGenerator, num_prompts: int, source: str, print_fn=print) -> dict:
    results = {}
    for name, kwargs in TASKS.items():
        summary, _ = evaluate_task(generator, build_task(name, **kwargs), num_prompts=num_prompts,
                                   num_samples=1, batch_size=64, seed=0, split="test", source=source,
                                   print_fn=print_fn)
        results[name] = summary
    return results


def model_card(path: Path, title: str, params: int, body: dict, evals: dict, command: str, seconds: float) -> None:
    rows = "\n".join(f"| {t} | {s['pass@1']:.3f} | {s['format_rate']:.3f} | {s['completion_tokens_mean']:.1f} |"
                     for t, s in evals.items())
    text = f"""# {title}

{body['what']}

- Parameters: {params:,}
- Architecture: {body['arch']}
- Tokenizer: {body['tokenizer']}
- Training data: exact-solver completions for the train splits of {', '.join(TASKS)} (compact prompts;
  Countdown with 3 numbers in 1-99 and a target in 1-100; Sudoku 4x4); {body['data']}.
- Training: {body['training']}
- Built with `{command}` in {seconds / 60:.1f} minutes on {platform.processor() or platform.machine()}
  ({torch.get_num_threads()} threads, torch {torch.__version__}).

## Accuracy on held-out test prompts (task defaults, greedy)

| task | pass@1 | format rate | mean completion tokens |
|---|---|---|---|
{rows}

Reproduce: `dllm-rl eval model={path.as_posix()} task=<task> num_prompts={evals[next(iter(evals))]['num_prompts']} rollout.gen_length={body['window']}`.
"""
    (path / "README.md").write_text(text)


def evaluate_and_save(out: Path, model, tokenizer, generator: TextGenerator, eval_prompts: int, log, start: float,
                      title: str, body: dict, command: str, extra: dict | None = None) -> dict:
    evals = evaluate_all(generator, eval_prompts, str(out))
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    if "CausalLM" in type(model).__name__:  # a serving engine (transformers serve) samples only where this says so
        model.generation_config.do_sample = True
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    record = {"evals": evals, "gen_length": generator.gen_length, "sft_log": log, "build_seconds": seconds,
              **(extra or {})}
    (out / "eval.json").write_text(json.dumps(record, indent=2) + "\n")
    model_card(out, title, model.num_parameters(), {**body, "window": generator.gen_length}, evals, command, seconds)
    return evals


def precision_of(log: list[dict]) -> str:
    """How the SFT forwards ran: logged by train_sft (bf16=auto autocasts only where bf16 is native)."""
    return ("bf16 autocast" if log[-1].get("bf16", resolve_bf16("auto"))
            else "fp32 (no native bf16 on the build machine)")


def reuse_built(out: Path, model_class):
    """(model, tokenizer, sft log, start time) of a model built before, for --eval-only: re-evaluating after
    a change of task defaults without retraining. The reported build time stays the training run's."""
    previous = json.loads((out / "eval.json").read_text())
    start = time.perf_counter() - previous.get("build_seconds", previous["sft_log"][-1]["seconds"])
    model = model_class.from_pretrained(out).eval()
    return model, load_tokenizer(str(out)), previous["sft_log"], start


def phase_windows(windows: dict, seed: int):
    """A sampler of SFT windows with the given shares, one draw per batch (its own seeded stream)."""
    rng, sizes, shares = random.Random(seed), list(windows), list(windows.values())
    return lambda: rng.choices(sizes, shares)[0]


def phase_dir(out: Path, number: int) -> Path:
    """Where phase `number` saves the model it ended with: beside the model's directory, not in it (the model's
    directory is what is committed; .gitignore leaves these out)."""
    return out.parent / f".{out.name}-phases" / f"phase{number}"


def build_dllm(out: Path, steps: list[int], n_per_task: int, eval_prompts: int, seed: int, command: str,
               eval_only: bool = False, phases: tuple = DLLM_PHASES, from_phase: int = 1) -> dict:
    """SFT in `phases` (their step counts replaced by `steps`); with from_phase > 1, start from the model phase
    from_phase - 1 ended with, saved under phase_dir(out, n) (a phase is rerun without its predecessors)."""
    start = time.perf_counter()
    tokenizer = build_char_tokenizer(model_max_length=CONTEXT, pad_single_digits=True)
    config = DiffusionLMConfig(vocab_size=len(tokenizer), hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                               max_position_embeddings=CONTEXT, mask_token_id=tokenizer.mask_token_id,
                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                               bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = DiffusionLM(config)
    schedule = MaskingSchedule()
    phases = [{**phase, "steps": n} for phase, n in zip(phases, steps)]
    log, stopped_at, headroom = [], None, []
    done = 0  # the model's SFT steps so far: a phase the headroom rule ended counts up to the checkpoint it kept
    if eval_only:
        model, tokenizer, log, start = reuse_built(out, DiffusionLM)
        previous = json.loads((out / "eval.json").read_text())
        stopped_at, headroom = previous.get("headroom_step"), previous.get("headroom", [])
    elif from_phase > 1:
        previous = phase_dir(out, from_phase - 1)
        if not (previous / "phase.json").is_file():  # written last: the phase finished
            raise SystemExit(f"--from-phase {from_phase}: {previous} holds no finished phase "
                             f"{from_phase - 1}; build it first (--from-phase {from_phase - 1} or 1)")
        model = DiffusionLM.from_pretrained(previous)
        log = json.loads((previous / "sft_log.json").read_text())
        done = json.loads((previous / "phase.json").read_text())["step"]
    policy = wrap_model(model, "native", tokenizer)
    generator = TextGenerator(policy, tokenizer, gen_length=GEN_LENGTH, block_length=32, steps=GEN_LENGTH)
    for number, phase in enumerate(phases if not eval_only else [], start=1):
        if number < from_phase:
            continue
        data = drop_overlong(sft_data(n_per_task, seed, "dllm", {"countdown": 1.0, "sudoku": phase["sudoku_share"]},
                                      phase["countdown"]), tokenizer, GEN_LENGTH)
        window = phase_windows(phase["windows"], seed + number)

        def loss_fn(batch, noise):
            ids, mask, prompt_length = diffusion_batch(tokenizer, batch, window())
            return diffusion_sft_loss(policy, ids, mask, prompt_length, schedule, noise, weighting="masked_mean")

        stop = HeadroomStop(model, generator, done, phase["every"], phase.get("from", 0))
        model.train()
        phase_log = train_sft(loss_fn, model.parameters(), data, steps=phase["steps"], batch_size=64, lr=phase["lr"],
                              warmup=phase["warmup"], schedule=phase["schedule"], seed=seed + number - 1,
                              after_step=stop)
        log += [{**entry, "phase": number, "step": done + entry["step"]} for entry in phase_log]
        kept = stop.keep_best()
        done = kept if kept is not None else done + phase_log[-1]["step"]
        if kept is not None:
            stopped_at, headroom = kept, headroom + stop.history
        model.eval()
        model.save_pretrained(phase_dir(out, number))
        (phase_dir(out, number) / "sft_log.json").write_text(json.dumps(log) + "\n")
        (phase_dir(out, number) / "phase.json").write_text(json.dumps({"phase": number, "step": done}) + "\n")
    schedule.save_pretrained(out)
    recipe = "; ".join(
        f"phase {n}: up to {p['steps']} steps, lr {p['lr']:g} {p['schedule']}, windows "
        + "/".join(f"{w} ({share:.0%})" for w, share in p["windows"].items())
        + f", Countdown {p['countdown']}, Sudoku share {p['sudoku_share']:g}"
        + (f", headroom rule every {p['every']} steps" if p["every"] else "") for n, p in enumerate(phases, 1))
    evals = evaluate_and_save(out, model, tokenizer, generator, eval_prompts, log, start,
                              "tiny-dllm: the embedded masked-diffusion policy", {
        "what": "A small masked-diffusion LM (dllm-rl's native architecture) trained to be a weak policy "
                f"with room for RL: it starts both tasks' greedy pass@1 near {HEADROOM[0]:g}-{HEADROOM[1]:g}.",
        "arch": f"bidirectional transformer, 4 layers, hidden 256, 4 heads, SwiGLU 704, RoPE, RMSNorm, "
                f"context {CONTEXT}",
        "data": "answers only, no step traces; Countdown answers aligned with the prompt's list (numbers in its "
                "order, no brackets, a space before each operator: `83 -64 -4` for [83, 64, 4]) where one exists, "
                "and from the last phase on any-order answers for the others (`aligned_first`), so every "
                "solvable instance has an answer; Sudoku SFT puzzles have 6-10 blanks, easier than the 8-12 of "
                "the task default it is evaluated on",
        "tokenizer": "character-level (printable ASCII + special tokens), "
                     f"{len(tokenizer)} ids; pad, mask, eos, bos, unk; a standalone one-digit number is read "
                     "with a leading zero (4 as 04) and written back without it",
        "training": f"masked-diffusion SFT (linear schedule, mean CE over masked tokens: see "
                    f"`dllm_rl.sft.diffusion_sft_loss` for why not LLaDA's 1/t weight here), batches of 64 "
                    f"sequences, AdamW, {precision_of(log)}; {recipe}; "
                    + (f"the headroom rule kept step {stopped_at} (greedy pass@1 on {HEADROOM_PROMPTS} test "
                       "prompts per task, window 64: " + ", ".join(
                           f"{h['step']}: " + "/".join(f"{h[t]:.3f}" for t in TASKS) for h in headroom)
                       + f", {' / '.join(TASKS)})" if stopped_at is not None else "no headroom rule ran"),
    }, command, extra={"headroom_step": stopped_at, "headroom": headroom})
    d1_table(out, eval_prompts=HEADROOM_PROMPTS)
    return evals


def d1_table(out: Path, eval_prompts: int) -> None:
    """The card's protocol=d1 table: pass@1 at D1_LENGTHS with the tasks' compact prompts (d1's own
    instructions do not fit), appended to the card and written to eval.json."""
    import tempfile

    from dllm_rl import cli

    rows = []
    for task in TASKS:
        with tempfile.TemporaryDirectory() as tmp:
            code = cli.main(["eval", f"model={out}", f"task={task}", "protocol=d1",
                             "++protocol.task.prompt_style=compact",
                             "protocol.lengths=[" + ",".join(map(str, D1_LENGTHS)) + "]",
                             f"num_prompts={eval_prompts}", f"output_dir={tmp}"])
            if code != 0:
                raise SystemExit(f"dllm-rl eval protocol=d1 failed for {task} (exit {code})")
            summary = json.loads((Path(tmp) / "summary.json").read_text())
        for length in D1_LENGTHS:
            result = summary["lengths"][str(length)][task]
            rows.append({"task": task, "length": length, "pass@1": result["pass@1"],
                         "format_rate": result["format_rate"]})
    record = json.loads((out / "eval.json").read_text())
    (out / "eval.json").write_text(json.dumps({**record, "protocol_d1": rows}, indent=2) + "\n")
    lines = "\n".join(f"| {r['task']} | {r['length']} | {r['pass@1']:.3f} | {r['format_rate']:.3f} |" for r in rows)
    with open(out / "README.md", "a") as card:
        card.write(f"""
## Under protocol=d1 (greedy, {eval_prompts} test prompts per task, the tasks' compact prompts)

| task | length | pass@1 | format rate |
|---|---|---|---|
{lines}

Reproduce: `dllm-rl eval model={out.as_posix()} task=<task> protocol=d1 ++protocol.task.prompt_style=compact \
protocol.lengths=[{','.join(map(str, D1_LENGTHS))}] num_prompts={eval_prompts}`.
""")


def build_ar(out: Path, steps: int, n_per_task: int, eval_prompts: int, seed: int, command: str,
             eval_only: bool = False) -> dict:
    start = time.perf_counter()
    data = sft_data(n_per_task, seed, "ar")
    tokenizer = build_bpe_tokenizer([e.prompt + e.completion for e in data[:: max(1, len(data) // 5000)]],
                                    vocab_size=384, model_max_length=256)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)

    def loss_fn(batch, generator):
        ids, mask, labels = causal_batch(tokenizer, batch)
        return causal_sft_loss(model, ids, mask, labels)

    if eval_only:
        model, tokenizer, log, start = reuse_built(out, Qwen2ForCausalLM)
    else:
        model.train()
        log = train_sft(loss_fn, model.parameters(), data, steps=steps, batch_size=64, lr=2e-3, warmup=100, seed=seed)
        model.eval()
    generator = TextGenerator(model, tokenizer, gen_length=GEN_LENGTH)
    return evaluate_and_save(out, model, tokenizer, generator, eval_prompts, log, start,
                             "tiny-ar: the embedded external autoregressive policy", {
        "what": "A small Qwen2-architecture causal LM trained on the same tasks: the external policy whose "
                "rollouts ERILS mixes into the dLLM's RL (clearly stronger than the dLLM on both tasks).",
        "arch": "transformers Qwen2ForCausalLM, 4 layers, hidden 256, 4 heads, SwiGLU 704, tied embeddings",
        "data": "Countdown completions carry the solver's step trace before the answer, Sudoku answers only; "
                "Sudoku SFT puzzles have 6-10 blanks, easier than the 8-12 of the task default",
        "tokenizer": f"byte-level BPE trained on the SFT texts, digits split one by one, {len(tokenizer)} ids; "
                     "pad, mask, eos, bos, unk",
        "training": f"causal-LM SFT on completions, {steps} steps x 64 sequences, AdamW lr 2e-3 cosine, "
                    f"{precision_of(log)}; {len(data)} examples",
    }, command)


def main() -> None:
    from build_agent import add_agent_arguments, build_agent  # scripts/ is on the path when this runs as a script

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="models")
    parser.add_argument("--only", choices=["dllm", "ar", "agent"], default=None)
    add_agent_arguments(parser)
    parser.add_argument("--dllm-steps", default=",".join(str(p["steps"]) for p in DLLM_PHASES),
                        help="the dLLM's SFT steps, one count per phase of DLLM_PHASES, comma-separated")
    parser.add_argument("--from-phase", type=int, default=1,
                        help="rerun the dLLM's SFT from this phase on, from the model the phase before it saved "
                             "under <out>/.tiny-dllm-phases/phase<n>")
    parser.add_argument("--ar-steps", type=int, default=2000)
    parser.add_argument("--examples-per-task", type=int, default=20000)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-only", action="store_true", help="re-evaluate models already in --out (no training)")
    args = parser.parse_args()
    dllm_steps = [int(n) for n in str(args.dllm_steps).split(",")]
    if len(dllm_steps) != len(DLLM_PHASES) or min(dllm_steps) < 1:
        parser.error(f"--dllm-steps {args.dllm_steps}: expected {len(DLLM_PHASES)} positive step counts, one per "
                     f"phase of DLLM_PHASES, comma-separated (as {','.join(str(p['steps']) for p in DLLM_PHASES)})")
    if not 1 <= args.from_phase <= len(DLLM_PHASES):
        parser.error(f"--from-phase {args.from_phase}: expected a phase number from 1 to {len(DLLM_PHASES)}")
    # The command that rebuilds the models as they are: the script plus any setting that changes them.
    changed = [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
               if k in ("dllm_steps", "ar_steps", "examples_per_task", "eval_prompts", "seed",
                        "agent_steps", "agent_turns", "agent_eval_seeds")
               and v != parser.get_default(k)]
    command = " ".join(["python scripts/build_models.py", *changed])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {}
    if args.only in (None, "dllm"):
        results["tiny-dllm"] = build_dllm(Path(args.out) / "tiny-dllm", dllm_steps, args.examples_per_task,
                                          args.eval_prompts, args.seed, command, args.eval_only,
                                          from_phase=args.from_phase)
    if args.only in (None, "ar"):
        results["tiny-ar"] = build_ar(Path(args.out) / "tiny-ar", args.ar_steps, args.examples_per_task,
                                      args.eval_prompts, args.seed, command, args.eval_only)
    if args.only in (None, "agent"):  # after the dLLM it starts from
        print(json.dumps({"tiny-dllm-agent": build_agent(
            Path(args.out) / "tiny-dllm-agent", Path(args.out) / "tiny-dllm", args.agent_steps, args.agent_turns,
            args.agent_eval_seeds, args.seed, command, args.eval_only)}, indent=2))
    print(json.dumps({m: {t: round(s["pass@1"], 3) for t, s in r.items()} for m, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
