"""Supervised fine-tuning on solver-made task data: masked-diffusion SFT for the dLLM, causal-LM SFT for the
external autoregressive model. Used to build the embedded models in `models/`.

Masked-diffusion SFT follows LLaDA (arXiv 2502.09992, Sec. 2.3): the prompt is kept clean; every token of
the response window (the completion followed by EOS up to `gen_length`, so the model learns to end its
answer, as LLaDA pads responses with EOS) is masked with probability t ~ U[eps, 1], and the loss is the
cross-entropy on masked tokens weighted by 1/t, summed over the window and divided by its length.
Causal-LM SFT is next-token cross-entropy on the completion and its EOS only.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from dllm_rl.data.task import Solution, Task, render_completion, render_prompt, train_examples_up_to
from dllm_rl.errors import ConfigError, check_ranges, require
from dllm_rl.optim import lr_factor
from dllm_rl.policy.adapters import DiffusionPolicy
from dllm_rl.policy.schedule import MaskingSchedule
from dllm_rl.device import autocast as autocast_on, resolve_device
from dllm_rl.precision import resolve_bf16
from dllm_rl.rollout.sampler import left_pad


@dataclass(frozen=True)
class SFTExample:
    prompt: str
    completion: str


def worked_solution(task: Task, example) -> Solution | None:
    """What SFT trains on for one problem: the task's exact solver's answer and steps, or, for a task without a
    solver (GSM8K, MATH500 from files), the problem's reference solution split into its lines."""
    solution = task.solve(example)
    if solution is None and example.meta.get("solution"):
        lines = tuple(line.strip() for line in str(example.meta["solution"]).splitlines() if line.strip())
        solution = Solution(example.answer, lines)
    return solution


def solver_examples(task: Task, n: int, seed: int, with_steps: bool = True, tokenizer=None,
                    print_fn=print) -> list[SFTExample]:
    """The exact solver's completions (steps optional) for the first `n` train-split prompts of `task` it
    answers (a file task's reference solutions: `worked_solution`). A solver may decline prompts (Countdown's
    in_order and aligned `solver_style`: no answer in the prompt's order); more prompts are then drawn, up to
    8n, and the number declined is reported. A split smaller than `n` gives what it has."""
    if hasattr(task, "make"):  # a multi-turn environment (dllm_rl/envs/task.py): each solver turn is an example
        from dllm_rl.envs.task import solver_turns

        turns = solver_turns(task, n, seed, render=lambda text: render_prompt(text, tokenizer))
        require(len(turns) == n, f"env={task.config.name}: its solver played only {len(turns)} turns; {n} asked")
        return [SFTExample(prompt, action) for prompt, action in turns]
    out, drawn, size = [], 0, n
    while True:
        pool = train_examples_up_to(task, size, seed)  # a small train file: all of it
        n = min(n, len(pool))
        for ex in pool[drawn:]:   # a longer list starts with the shorter one
            drawn += 1
            solution = worked_solution(task, ex)
            if solution is None:
                continue
            if not with_steps:
                solution = type(solution)(solution.answer)
            out.append(SFTExample(render_prompt(task.prompt(ex), tokenizer),
                                  render_completion(solution, task.prompt_style)))
            if len(out) == n:
                break
        if len(out) == n or size == 8 * n or len(pool) < size:
            break
        size = min(8 * n, 2 * size)
    require(out or n == 0, f"task {task.name!r} has no exact solver or reference solutions to make SFT data from: "
            f"none for {drawn} prompts")
    require(len(out) == n, f"the {task.name!r} solver answered only {len(out)} of {drawn} prompts; {n} examples asked")
    declined = drawn - len(out)
    if declined:
        print_fn(f"{task.name}: the solver declined {declined} of {drawn} prompts, so {n} examples took {drawn}")
    return out


def drop_overlong(examples: Sequence[SFTExample], tokenizer, gen_length: int, print_fn=print) -> list[SFTExample]:
    """Keep the examples whose completion fits the dLLM's window; say how many were dropped."""
    lengths = [completion_tokens(tokenizer, e) for e in examples]
    kept = [e for e, n in zip(examples, lengths) if n <= gen_length]
    if len(kept) < len(examples):
        print_fn(f"dropped {len(examples) - len(kept)} of {len(examples)} examples longer than gen_length={gen_length}")
    require(kept, f"gen_length={gen_length}: no example fits (the shortest completion is {min(lengths)} tokens); "
            f"use gen_length=null (the window fitted to the examples), a larger gen_length, or with_steps=false "
            f"(answers without the solver's steps)")
    return kept


def completion_tokens(tokenizer, example: SFTExample) -> int:
    return len(tokenizer(example.completion, add_special_tokens=False)["input_ids"])


def fitted_window(examples: Sequence[SFTExample], tokenizer, multiple: int = 8) -> int:
    """The smallest multiple of `multiple` tokens that holds every completion and its EOS."""
    longest = max(completion_tokens(tokenizer, e) for e in examples) + 1
    return -(-longest // multiple) * multiple


# ------------------------------------------------------------------------------------------- batches


def diffusion_batch(tokenizer, examples: Sequence[SFTExample], gen_length: int, device: torch.device | str = "cpu"):
    """(ids_BL, attention_mask_BL, prompt_length) on `device`: left-padded prompts, then a window of
    `gen_length` holding the completion and EOS fill. Completions longer than the window are an error."""
    prompts = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    ids_BP, mask_BP = left_pad(prompts, tokenizer.pad_token_id, device)
    windows = []
    for e in examples:
        ids = tokenizer(e.completion, add_special_tokens=False)["input_ids"]
        require(len(ids) <= gen_length,
                f"completion of {len(ids)} tokens does not fit gen_length={gen_length}: {e.completion[:60]!r}")
        windows.append(ids + [tokenizer.eos_token_id] * (gen_length - len(ids)))
    window = torch.tensor(windows, dtype=torch.long, device=device).view(len(examples), gen_length)
    return (torch.cat([ids_BP, window], 1), torch.cat([mask_BP, torch.ones_like(window)], 1), ids_BP.shape[1])


def causal_batch(tokenizer, examples: Sequence[SFTExample], device: torch.device | str = "cpu"):
    """(ids_BL, attention_mask_BL, labels_BL) on `device`: right-padded prompt + completion + EOS; labels only
    on the completion and its EOS (-100 elsewhere)."""
    rows, labels = [], []
    for e in examples:
        p = tokenizer(e.prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(e.completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + c)
        labels.append([-100] * len(p) + c)
    width = max(map(len, rows))

    def padded(lists, fill):
        return torch.tensor([r + [fill] * (width - len(r)) for r in lists], dtype=torch.long, device=device)

    return padded(rows, tokenizer.pad_token_id), padded([[1] * len(r) for r in rows], 0), padded(labels, -100)


# ------------------------------------------------------------------------------------------- losses


def diffusion_sft_loss(policy: DiffusionPolicy, ids_BL, attention_mask_BL, prompt_length: int,
                       schedule: MaskingSchedule, generator: torch.Generator, weighting: str = "elbo") -> torch.Tensor:
    """Masked-diffusion SFT loss on the completion window.

    weighting="elbo": LLaDA's loss, sum over masked tokens of CE / p_mask(t), divided by B * C (an unbiased
    estimate of the negative ELBO, Eq. 3/5 of arXiv 2502.09992). weighting="masked_mean": the mean CE over
    the masked tokens of the batch (MaskGIT-style, no 1/t). The 1/t weight reaches 1/eps for lightly masked
    rows; at small batch sizes that variance slows learning a lot (measured: a 3M-parameter model on Sudoku
    4x4, 400 steps of 64, 1% pass@1 with "elbo" against 29% with "masked_mean"), so the embedded models
    are built with "masked_mean".
    """
    B, L = ids_BL.shape
    C = L - prompt_length
    t_B = schedule.sample_t(B, generator=generator)
    maskable_BL = torch.zeros_like(ids_BL, dtype=torch.bool)
    maskable_BL[:, prompt_length:] = True
    noisy_BL, is_masked_BL = schedule.add_noise(ids_BL, t_B, policy.mask_id, generator=generator,
                                                maskable_BL=maskable_BL)
    logits_BLV = policy.logits(noisy_BL, attention_mask_BL)
    ce_BL = F.cross_entropy(logits_BLV.float().transpose(1, 2), ids_BL, reduction="none") * is_masked_BL
    if weighting == "elbo":
        return (ce_BL / schedule.mask_prob(t_B)[:, None]).sum() / (B * C)
    if weighting == "masked_mean":
        return ce_BL.sum() / is_masked_BL.sum().clamp(min=1)
    raise ConfigError(f"weighting must be 'elbo' or 'masked_mean', got {weighting!r}")


def causal_sft_loss(model, ids_BL, attention_mask_BL, labels_BL) -> torch.Tensor:
    logits_BLV = model(input_ids=ids_BL, attention_mask=attention_mask_BL).logits
    return F.cross_entropy(logits_BLV[:, :-1].float().transpose(1, 2), labels_BL[:, 1:], ignore_index=-100)


# ------------------------------------------------------------------------------------------- the loop


def train_sft(
    loss_fn: Callable[[list[SFTExample], torch.Generator], torch.Tensor],
    parameters,
    examples: Sequence[SFTExample],
    *,
    steps: int,
    batch_size: int,
    lr: float = 1e-3,
    warmup: int = 100,
    schedule: str = "cosine",
    weight_decay: float = 0.01,
    grad_clip: float = 1.0,
    seed: int = 0,
    bf16: bool | str = "auto",
    log_every: int = 100,
    device: torch.device | str = "cpu",
    print_fn=print,
    log_fn: Callable[[dict[str, Any]], None] | None = None,
    after_step: Callable[[int], bool] | None = None,
) -> list[dict[str, Any]]:
    """AdamW with warmup, then cosine decay over `steps` minibatches drawn from `examples` (`schedule="constant"`:
    none, so a run of n steps is the first n steps of a longer one); returns the log. The masking noise comes from
    one generator on `device`, where the model runs. `after_step(steps_done)` runs after each optimizer step (it
    may evaluate the model, and then puts it back in train mode); returning True ends the training there."""
    require(steps > 0 and batch_size > 0, f"steps and batch_size must be positive, got {steps}, {batch_size}")
    require(len(examples) >= batch_size, f"need at least batch_size={batch_size} examples, got {len(examples)}")
    params = [p for p in parameters if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    rng = random.Random(seed)
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    log, running, start = [], [], time.perf_counter()
    use_bf16 = resolve_bf16(bf16, device)
    autocast = autocast_on(device, use_bf16)
    bar = tqdm(range(steps), desc="sft", unit="step", disable=None)

    def record(step_done: int) -> None:
        nonlocal running
        entry = {"step": step_done, "loss": sum(running) / max(1, len(running)),
                 "lr": optimizer.param_groups[0]["lr"], "seconds": round(time.perf_counter() - start, 1),
                 "bf16": use_bf16}
        log.append(entry)
        if log_fn is not None:
            log_fn({**entry, "bf16": float(use_bf16)})
        running = []
        bar.set_postfix(loss=f"{entry['loss']:.4f}")
        print_fn(f"sft step {entry['step']}/{steps} loss {entry['loss']:.4f} lr {entry['lr']:.2e} {entry['seconds']}s")

    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr * lr_factor(step, steps, schedule, warmup, floor=0.1)
        batch = rng.sample(list(examples), batch_size) if len(examples) < 4 * batch_size else [
            examples[rng.randrange(len(examples))] for _ in range(batch_size)]
        with autocast:
            loss = loss_fn(batch, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
        optimizer.step()
        running.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            record(step + 1)
        if after_step is not None and after_step(step + 1):
            if running:  # the log ends where the training does
                record(step + 1)
            break
    return log


def run_sft(task: Task, *, model: str, kind: str = "auto", output_dir: str | None = None, examples: int = 5000,
            with_steps: bool = True, gen_length: int | None = None, weighting: str = "elbo", steps: int = 200,
            batch_size: int = 32, lr: float = 1e-4, warmup: int = 20, seed: int = 0, bf16: bool | str = "auto",
            trust_remote_code: bool = False, device: str = "auto", log_every: int = 10, tensorboard: bool = True,
            print_fn=print) -> list[dict[str, Any]]:
    """`dllm-rl sft`: fine-tune a local dLLM (masked-diffusion SFT) or causal LM (causal SFT) on `device`, and save
    it to `output_dir` (a new directory; null: runs/sft-<task>-<time>) with its metrics.jsonl and TensorBoard
    events, as `train` writes them. `gen_length=None` fits the dLLM's window to the longest example."""
    from dllm_rl.rollout.generate import load_generator
    from dllm_rl.tracking import Tracker

    check_ranges(dict(examples=examples, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup, log_every=log_every),
                 {**dict.fromkeys(("examples", "steps", "batch_size", "log_every"), "at_least_1"), "lr": "positive",
                  "warmup": "non_negative"})
    if gen_length is not None:
        check_ranges(dict(gen_length=gen_length), {"gen_length": "at_least_1"})
    require(weighting in ("elbo", "masked_mean"), f"weighting must be 'elbo' or 'masked_mean', got {weighting!r}")
    resolve_bf16(bf16)
    device = resolve_device(device)
    out = Path(output_dir or time.strftime(f"runs/sft-{task.name}-%Y%m%d-%H%M%S"))
    require(not (out.exists() and (not out.is_dir() or any(out.iterdir()))),
            f"output_dir={str(out)!r} exists and is not empty; choose a new directory (sft never overwrites)")
    loaded = load_generator(model, kind=kind, trust_remote_code=trust_remote_code, device=device)
    tokenizer, net = loaded.tokenizer, loaded.model
    data = solver_examples(task, examples, seed, with_steps=with_steps, print_fn=print_fn)
    if loaded.is_diffusion:
        schedule = MaskingSchedule()
        if gen_length is None:
            gen_length = fitted_window(data, tokenizer)
            print_fn(f"gen_length={gen_length}: the window that holds the longest of {len(data)} examples")
        data = drop_overlong(data, tokenizer, gen_length, print_fn)

        def loss_fn(batch, generator):
            ids, mask, prompt_length = diffusion_batch(tokenizer, batch, gen_length, device)
            return diffusion_sft_loss(net, ids, mask, prompt_length, schedule, generator, weighting)

        module = net.model
    else:
        def loss_fn(batch, generator):
            ids, mask, labels = causal_batch(tokenizer, batch, device)
            return causal_sft_loss(net, ids, mask, labels)

        module = net
    require(len(data) >= batch_size, f"batch_size={batch_size}: larger than the {len(data)} examples there are; use "
            f"batch_size<={len(data)}")
    tracker = Tracker(out, tensorboard)
    module.train()
    try:
        log = train_sft(loss_fn, module.parameters(), data, steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                        seed=seed, bf16=bf16, log_every=log_every, device=device, print_fn=print_fn,
                        log_fn=lambda entry: tracker.log(entry["step"],
                                                         {k: v for k, v in entry.items() if k != "step"}))
    finally:
        tracker.close()
    module.eval()
    module.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print_fn(f"saved the fine-tuned model to {out} (metrics.jsonl and tensorboard/ beside it)")
    return log
