"""Evaluation: pass@1, unbiased pass@k, best-of-k, format rate and completion length per task.

`num_samples` completions are drawn for each of `num_prompts` held-out prompts. Each completion's seed is
derived from (seed, prompt index, sample index) alone, so results do not depend on the batch size.

- pass@k: the unbiased estimator of Chen et al. 2021 (arXiv 2107.03374), 1 - C(n-c, k) / C(n, k), with n
  samples of which c are correct, averaged over prompts.
- best-of-k: the mean over prompts of the best reward among the first k samples (with an exact verifier
  as the selector; equals pass@k's plug-in estimate when rewards are 0/1).

Writes `samples.jsonl` (one line per completion: task, uid, prompt, completion, reward, correct,
formatted, reason, num_tokens, sample, source, and from `dllm-rl eval` gen_length) and `summary.json` into
`output_dir`, when given. `dllm-rl eval` evaluates at each length of an evaluation protocol
(`dllm_rl.protocols`) in one call.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from tqdm import tqdm

from dllm_rl.data.task import Task, draw_examples, render_prompt
from dllm_rl.device import device_of
from dllm_rl.errors import ConfigError, check_ranges, require
from dllm_rl.seeds import derive_seed


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to n, plus n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def summarize(records: Sequence[dict[str, Any]], num_samples: int) -> dict[str, float]:
    by_prompt: dict[str, list[dict]] = {}
    for r in records:
        by_prompt.setdefault(r["uid"], []).append(r)
    groups = [sorted(g, key=lambda r: r["sample"]) for g in by_prompt.values()]
    summary = {"num_prompts": len(groups), "num_samples": num_samples}
    for k in ks_up_to(num_samples):
        summary[f"pass@{k}"] = sum(pass_at_k(len(g), sum(r["correct"] for r in g), k) for g in groups) / len(groups)
        summary[f"best_of_{k}"] = sum(max(r["reward"] for r in g[:k]) for g in groups) / len(groups)
    summary["reward_mean"] = sum(r["reward"] for r in records) / len(records)
    summary["format_rate"] = sum(r["formatted"] for r in records) / len(records)
    summary["completion_tokens_mean"] = sum(r["num_tokens"] for r in records) / len(records)
    return summary


def evaluate_task(
    generate: Callable[[list[str], list[int]], list],
    task: Task,
    *,
    num_prompts: int = 100,
    num_samples: int = 1,
    batch_size: int = 32,
    seed: int = 0,
    split: str = "test",
    prompts_key: str = "num_prompts",
    tokenizer=None,
    source: str = "",
    print_fn=print,
) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """Score `num_samples` completions for `num_prompts` prompts of `task`; returns (summary, records)."""
    require(num_samples > 0, f"num_samples must be positive, got {num_samples}")
    require(batch_size > 0, f"batch_size must be positive, got {batch_size}")
    examples = draw_examples(task, split, num_prompts, seed, prompts_key)
    jobs = [(i, j) for i in range(len(examples)) for j in range(num_samples)]
    records: list[dict[str, Any]] = []
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), desc=f"eval {task.name}", unit="sample", disable=None)
    for lo in range(0, len(jobs), batch_size):
        batch = jobs[lo : lo + batch_size]
        prompts = [render_prompt(task.prompt(examples[i]), tokenizer) for i, _ in batch]
        completions = generate(prompts, [derive_seed(seed, i, j) for i, j in batch])
        for (i, j), prompt, completion in zip(batch, prompts, completions):
            reward = task.reward(completion.text, examples[i])
            records.append({
                "task": task.name, "uid": examples[i].uid, "prompt": prompt, "completion": completion.text,
                "reward": reward.score, "correct": reward.correct, "formatted": reward.formatted,
                "reason": reward.reason, "num_tokens": completion.num_tokens, "sample": j, "source": source,
            })
        bar.update(len(batch))
    bar.close()
    summary = summarize(records, num_samples)
    summary["seconds"] = round(time.perf_counter() - start, 2)
    print_fn(f"eval {task.name} [{split}]: " + " ".join(
        f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items()))
    return summary, records


def write_results(output_dir: str, summaries: dict[str, dict], records: Sequence[dict], meta: dict,
                  lengths: dict[str, dict] | None = None) -> None:
    """samples.jsonl and summary.json, each written to a temporary name and renamed (never half-written).
    summary.json holds `meta`, `tasks` (task -> summary: one generation length) and, from `dllm-rl eval`,
    `lengths` (length -> task -> summary: every length of the protocol)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"meta": meta, "tasks": summaries, **({} if lengths is None else {"lengths": lengths})}
    for name, text in (("samples.jsonl", "".join(json.dumps(r) + "\n" for r in records)),
                       ("summary.json", json.dumps(summary, indent=2) + "\n")):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, out / name)


def run_eval(task: Task, *, model: str, kind: str = "auto", dtype: str = "float32", rollout: dict[str, Any],
             protocol: dict[str, Any] | None = None, num_prompts: int | None = 100, num_samples: int = 1,
             batch_size: int = 32, seed: int = 0, split: str = "test", chat: bool = True, output_dir: str | None = None,
             trust_remote_code: bool = False, device: str = "auto", print_fn=print) -> dict[str, Any]:
    """`dllm-rl eval`: load `model`, evaluate it on `task` at each of the protocol's lengths (`dllm_rl.protocols`;
    none: the rollout as given), print one table, and write samples.jsonl and summary.json. Returns the summary
    of each length. Every length is checked against the model's context before anything is generated."""
    import dataclasses

    from dllm_rl.data.task import SPLITS, describe_splits
    from dllm_rl.protocols import Protocol, environment
    from dllm_rl.rollout.generate import load_generator

    check_ranges(dict(num_prompts=num_prompts, num_samples=num_samples, batch_size=batch_size),
                 dict.fromkeys(("num_prompts", "num_samples", "batch_size"), "at_least_1"))
    require(split in SPLITS, f"split must be one of {SPLITS}, got {split!r}")
    protocol = Protocol(**(protocol or {}))
    runs = protocol.settings(rollout)
    note = describe_splits(task, needed=(split,))  # before the model loads
    if note:
        print_fn(note)
    generator = load_generator(model, kind=kind, dtype=dtype, trust_remote_code=trust_remote_code, device=device,
                               **runs[0])
    tokenizer = generator.tokenizer if chat else None
    check_context(generator, task, runs, protocol, split=split, num_prompts=num_prompts, seed=seed, tokenizer=tokenizer)
    summaries, records = {}, []
    for settings in runs:
        length = settings["gen_length"]
        summary, done = evaluate_task(
            dataclasses.replace(generator, **settings), task, num_prompts=num_prompts, num_samples=num_samples,
            batch_size=batch_size, seed=seed, split=split, tokenizer=tokenizer, source=model, print_fn=print_fn)
        summaries[length] = summary
        records += [{**r, "gen_length": length} for r in done]
    output_dir = output_dir or time.strftime("runs/eval-%Y%m%d-%H%M%S")
    meta = {"model": model, "task": task.name, "split": split, "seed": seed, "rollout": rollout,
            "protocol": dataclasses.asdict(protocol), "settings": runs,
            **environment(device_of(generator.model), dtype)}
    write_results(output_dir, {task.name: summaries[runs[0]["gen_length"]]} if len(runs) == 1 else {}, records, meta,
                  lengths={str(n): {task.name: s} for n, s in summaries.items()})
    print_fn(length_table(task.name, protocol.name, runs, summaries))
    print_fn(f"wrote {output_dir}/samples.jsonl and {output_dir}/summary.json")
    return summaries


def check_context(generator, task: Task, runs: list[dict[str, Any]], protocol, *, split: str, num_prompts: int | None,
                  seed: int, tokenizer) -> None:
    """Every length fits the model's context after the longest prompt evaluated: else a named error that says what
    to change (the lengths that fit, the compact prompts for a short-context model, a shorter window)."""
    context = getattr(generator.model, "context_length", None) if generator.is_diffusion else None
    if context is None:
        return
    examples = draw_examples(task, split, num_prompts, seed, "num_prompts")
    with quiet_tokenizer():  # a prompt longer than the context is what this check names, not a warning
        widest = max(len(generator.tokenizer(render_prompt(task.prompt(e), tokenizer), add_special_tokens=False)
                         ["input_ids"]) for e in examples)
    fits = [s["gen_length"] for s in runs if widest + s["gen_length"] <= context]
    for settings in runs:
        length = settings["gen_length"]
        if widest + length <= context:
            continue
        what = f"protocol={protocol.name}: length {length}" if protocol.name != "none" else f"rollout.gen_length={length}"
        hints = []
        if fits:
            hints.append(f"evaluate the lengths that fit with protocol.lengths={fits}")
        style = getattr(task, "prompt_style", "compact")
        if style != "compact":
            key = "protocol.task.prompt_style" if "prompt_style" in protocol.task else "task.prompt_style"
            hints.append(f"the {style} prompts (the paper's instructions and format) need a long-context model such as "
                         f"LLaDA-8B or Dream-7B; on a short-context model (the embedded ones) {key}=compact asks the "
                         f"question alone")
        elif protocol.name == "none" and context - widest >= 1:
            hints.append(f"set rollout.gen_length <= {context - widest}")
        if not hints:
            hints.append("no length fits this model: use a model with a longer context")
        raise ConfigError(f"{what} after the longest prompt of {widest} tokens exceeds the model's context of "
                          f"{context}; " + "; ".join(hints))


@contextlib.contextmanager
def quiet_tokenizer():
    """transformers' "sequence length is longer than the specified maximum" warning held back."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def length_table(task: str, protocol: str, runs: list[dict[str, Any]], summaries: dict[int, dict]) -> str:
    """One markdown table: a row per length (its steps and blocks), pass@k and best-of-k, format, tokens."""
    first = summaries[runs[0]["gen_length"]]
    ks = [k for k in first if k.startswith(("pass@", "best_of_"))]
    head = ["length", "steps", "block", *ks, "format", "tokens", "s"]
    lines = [f"{task}, protocol={protocol}", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for s in runs:
        r = summaries[s["gen_length"]]
        steps = "adaptive" if s.get("threshold") is not None or s.get("factor") is not None else s["steps"]
        cells = [s["gen_length"], steps, s["block_length"], *(f"{r[k]:.3f}" for k in ks), f"{r['format_rate']:.3f}",
                 f"{r['completion_tokens_mean']:.1f}", f"{r['seconds']:.0f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)
