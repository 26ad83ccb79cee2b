"""`dllm-rl train`: GRPO for a masked-diffusion policy, readable top to bottom.

One step: draw B prompts -> G denoising rollouts each (per-row seeds) -> verifiable rewards -> with ERILS,
external rollouts for the triggered prompts (`dllm_rl/external/`) -> advantages per source -> old and
reference log-probs under stored mask seeds -> mu inner iterations over minibatches of the clipped surrogate
(+ beta * KL) -> optimizer steps. Without external rollouts this is diffu-GRPO (d1, arXiv 2504.12216); the
estimator, advantage, KL, loss aggregation and the ERILS options are chosen by name from the tables in
`dllm_rl.likelihood.estimators`, `dllm_rl.algo` and `dllm_rl.external`. The step's rows live in
`dllm_rl.buffer.Rows`, one per source.

How it departs from d1:
- every random draw (rollout noise, estimator masks, prompt order) is a function of (seed, step, row), so
  a resumed run repeats the uninterrupted one exactly;
- with one inner iteration and one minibatch, the old log-probs are the current ones detached (the ratio is
  exactly 1; this saves one scoring pass), as in d1's own implementation;
- a step whose groups all have zero reward variance (no learning signal) skips the update instead of
  letting weight decay move the weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import re
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dllm_rl.algo.advantages import ADVANTAGE_FNS, compute_advantages
from dllm_rl.algo.losses import aggregation_units, grpo_loss
from dllm_rl.buffer import Rows, inert_rows, loss_inputs, rank_plan, num_minibatches
from dllm_rl.seeds import derive_seed
from dllm_rl.optim import lr_factor
from dllm_rl.checkpoint import latest_checkpoint, load_trainer_state, save_checkpoint
from dllm_rl.data.task import Example, Task, render_prompt
from dllm_rl.errors import ConfigError, check_kwargs, pick, require
from dllm_rl.engine import (ENGINE_OPTIONS, Engine, all_gather_objects, all_sum, any_rank, broadcast_object,
                             deepspeed_config, gather_tensor, init_distributed, mean_metrics, on_gpu,
                             partitioned_loading)
from dllm_rl.evaluate import evaluate_task
from dllm_rl.external.mixer import build_mixer
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.policy.adapters import hidden_size_of, load_policy
from dllm_rl.precision import resolve_bf16
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.rollout.sampler import completion_mask, completion_texts
from dllm_rl.tracking import NullTracker, Tracker, console_line


# Metrics that count rows or prompts: added up over data-parallel ranks (every other metric is averaged).
COUNTS = tuple(f"external/{k}" for k in ("candidates", "too_long", "truncated", "unrepresentable", "incorrect",
                                         "prompts", "rows"))


class PromptStream:
    """Train prompts in a fresh seeded order every epoch; `position` (prompts consumed) is all its state."""

    def __init__(self, examples: list[Example], seed: int, position: int = 0):
        require(examples, "the task's train split is empty")
        self.examples, self.seed, self.position = examples, seed, position

    def next(self, count: int) -> list[Example]:
        out = []
        for _ in range(count):
            epoch, index = divmod(self.position, len(self.examples))
            order = list(range(len(self.examples)))
            random.Random(f"{self.seed}|epoch{epoch}").shuffle(order)
            out.append(self.examples[order[index]])
            self.position += 1
        return out


def check_train_args(group_size: int, prompts_per_step: int, inner_iterations: int, minibatch_size: int,
                     steps: int, lr: float, likelihood: dict, algo: dict) -> None:
    require(group_size >= 2, f"group_size must be >= 2 (advantages compare rollouts of a prompt), got {group_size}")
    require(prompts_per_step >= 1, f"prompts_per_step must be >= 1, got {prompts_per_step}")
    require(inner_iterations >= 1, f"inner_iterations must be >= 1, got {inner_iterations}")
    require(minibatch_size >= 1, f"minibatch_size must be >= 1, got {minibatch_size}")
    require(steps >= 1, f"steps must be >= 1, got {steps}")
    require(lr > 0, f"lr must be > 0, got {lr}")
    require(algo.get("eps_low", 1) > 0, f"algo.eps_low must be > 0, got {algo.get('eps_low')}")
    require(algo.get("eps_high", 1) > 0, f"algo.eps_high must be > 0, got {algo.get('eps_high')}")
    require(algo.get("beta", 0) >= 0, f"algo.beta must be >= 0, got {algo.get('beta')}")


def require_cpu_accelerator() -> None:
    """The trainer keeps its batches on the CPU; DeepSpeed would move the model to a GPU where there is one."""
    require(not on_gpu(), "dllm-rl train runs on the CPU for now (its batches are not placed on GPUs yet); this "
            "machine has a GPU, so set DS_ACCELERATOR=cpu to train on its CPU")


def train(
    task: Task,
    *,
    model: str,
    rollout: dict[str, Any],
    likelihood: dict[str, Any],
    algo: dict[str, Any],
    external: dict[str, Any] | None = None,
    mixing: dict[str, Any] | None = None,
    deepspeed: dict[str, Any] | None = None,
    run_dir: str | None = None,
    resume: str | None = None,
    steps: int = 30,
    prompts_per_step: int = 8,
    group_size: int = 6,
    inner_iterations: int = 1,
    minibatch_size: int = 48,
    lr: float = 5e-5,
    lr_schedule: str = "constant",
    warmup: int = 0,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    bf16: bool | str = "auto",
    seed: int = 0,
    train_pool: int = 5000,
    eval_every: int = 10,
    eval_prompts: int = 64,
    eval_samples: int = 0,
    checkpoint_every: int = 10,
    keep_checkpoints: int = 2,
    sample_every: int = 5,
    ref_sync_every: int = 0,
    max_bad_steps: int = 5,
    tensorboard: bool = True,
    config: dict[str, Any] | None = None,
    print_fn=tqdm.write,
) -> dict[str, float]:
    """Run GRPO (with ERILS external rollouts unless `external.name` is none) on `task` from the dLLM at
    `model`, on every rank of the process group (one process without a launcher); returns the last step's
    metrics, averaged over ranks."""
    check_train_args(group_size, prompts_per_step, inner_iterations, minibatch_size, steps, lr, likelihood, algo)
    require(eval_samples >= 0, f"eval_samples must be >= 0, got {eval_samples}")
    advantage = algo.get("advantage", "mean")
    pick(ADVANTAGE_FNS, advantage, "algo.advantage")
    loss_options = {k: v for k, v in algo.items() if k not in ("name", "advantage")}
    check_kwargs(grpo_loss, loss_options, "algo")
    estimator = build_estimator(likelihood)
    mixer = build_mixer(external, mixing, estimator)
    if mixer is not None:
        loss_options["shaping_gamma"] = mixer.config.shaping_gamma
    ds_options = {k: v for k, v in (deepspeed or {}).items() if k != "name"}
    timeout_s = ds_options.pop("timeout_s", 600)
    unknown = sorted(set(ds_options) - set(ENGINE_OPTIONS))
    require(not unknown, f"unknown config key(s) {['deepspeed.' + k for k in unknown]}; valid keys under 'deepspeed': "
            f"{sorted(ENGINE_OPTIONS + ('timeout_s',))}")
    deepspeed_config(**ds_options)  # bad stage / offload values fail here, before any process group exists
    use_bf16 = resolve_bf16(bf16)

    require_cpu_accelerator()
    world = init_distributed(timeout_s)  # rank 0 of 1 without a launcher
    main = world.is_main
    print_fn = print_fn if main else (lambda *_: None)
    # ---- this rank's share: whole prompt groups, so group statistics never cross ranks
    require(prompts_per_step % world.size == 0, f"prompts_per_step={prompts_per_step} must be divisible by the "
            f"number of ranks ({world.size}): each rank takes whole prompt groups")
    B, G = prompts_per_step // world.size, group_size
    first, N = world.rank * B, B * G  # global index of this rank's first prompt; its rollouts
    minibatches = num_minibatches(prompts_per_step * G, minibatch_size)
    require(minibatches <= N, f"minibatch_size={minibatch_size} makes {minibatches} minibatches per inner "
            f"iteration, but a rank holds {N} rollouts; use minibatch_size >= {math.ceil(prompts_per_step * G / N)}")
    run_dir = Path(broadcast_object(str(resume or run_dir or time.strftime(f"runs/{task.name}-%Y%m%d-%H%M%S")),
                                    world))
    tracker = Tracker(run_dir, tensorboard=tensorboard) if main else NullTracker()
    checkpoint = latest_checkpoint(run_dir) if resume else None
    require(resume is None or checkpoint is not None,
            f"resume={resume!r}: no complete checkpoint in {run_dir}/checkpoints")

    # ---- model, reference, engine (ZeRO-3 loads both partitioned)
    ds_config = deepspeed_config(**ds_options, grad_clip=grad_clip, world_size=world.size,
                                 micro_batch_size=math.ceil(minibatch_size / world.size),
                                 hidden_size=hidden_size_of(model))
    reference_path = checkpoint / "reference" if checkpoint is not None else None
    with partitioned_loading(ds_config):
        policy, tokenizer = load_policy(model)
        reference_net = None
        if loss_options.get("beta", 0.0) > 0:  # the frozen starting policy (synced every ref_sync_every steps)
            source = reference_path if reference_path is not None and reference_path.is_dir() else model
            reference_net = load_policy(str(source), kind=policy.kind)[0].model
    net = policy.model.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, steps, lr_schedule, warmup))
    engine = Engine(net, optimizer, world, ds_config)
    policy = dataclasses.replace(policy, model=engine.ds)
    reference = None if reference_net is None else dataclasses.replace(policy, model=engine.reference(reference_net))
    state = {"step": 0, "data_position": 0, "bad_steps": 0, "external_baseline": 0.0}
    if checkpoint is not None:
        state = {**state, **load_trainer_state(checkpoint, engine, scheduler)}
        print_fn(f"resumed from {checkpoint} at step {state['step']}")
    elif config is not None and main:
        (run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if mixer is not None:
        mixer.baseline = state["external_baseline"]

    prompts = PromptStream(task.examples("train", train_pool, seed), seed, state["data_position"])
    sampler_settings = {k: v for k, v in rollout.items() if k != "name"}
    generator = TextGenerator(policy, tokenizer, **sampler_settings)
    greedy = TextGenerator(policy, tokenizer, **{**sampler_settings, "temperature": 0.0})
    eos_id = policy.eos_id
    max_length = getattr(net.config, "max_position_embeddings", None)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16)
    aggregation = loss_options.get("aggregation", "token")
    importance = mixer is not None and mixer.config.correction == "is"
    reuse_current = inner_iterations == 1 and minibatches == 1 and not importance
    stand_ins = world.size > 1  # a rank short of a source's rows scores a stand-in (buffer.inert_rows)
    require(not (stand_ins and engine.stage == 3 and mixer is not None and mixer.config.length_rule == "none"),
            f"mixing.length_rule=none with deepspeed stage 3 on {world.size} ranks: a rank without external rows "
            f"scores a stand-in of the dLLM's window while the others score wider rows, so their forwards (and "
            f"ZeRO-3's collectives) would differ; use mixing.length_rule=drop, truncate or shortest")

    def gather(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        return gather_tensor(t, world)

    def evaluate(step: int) -> dict[str, float]:
        """Greedy pass@1 on held-out prompts; with eval_samples = k, also k samples at the rollout temperature.
        Every rank evaluates the same prompts (identical results): ZeRO-3 needs all ranks in the gather."""
        net.eval()
        with autocast, engine.gathered():
            summary, _ = evaluate_task(greedy, task, num_prompts=eval_prompts, batch_size=64, seed=seed,
                                       tokenizer=tokenizer, print_fn=lambda *_: None)
            out = {"eval/pass@1": summary["pass@1"], "eval/reward": summary["reward_mean"],
                   "eval/format_rate": summary["format_rate"], "eval/len": summary["completion_tokens_mean"]}
            if eval_samples > 0:
                sampled, _ = evaluate_task(generator, task, num_prompts=eval_prompts, num_samples=eval_samples,
                                           batch_size=64, seed=seed, tokenizer=tokenizer, print_fn=lambda *_: None)
                out.update({"eval/sampled_pass@1": sampled["pass@1"],
                            f"eval/best_of_{eval_samples}": sampled[f"best_of_{eval_samples}"]})
        net.train()
        return out

    def mask_seeds(source: str, rows: int, offset: int) -> list[list[int]]:
        """One estimator seed per (inner iteration, global row): old, reference and current policy share them."""
        tag = () if source == "on_policy" else (source,)
        return [[derive_seed(seed, "mask", step, it, *tag, offset + n) for n in range(rows)]
                for it in range(inner_iterations)]

    def bad_update(step: int) -> None:
        state["bad_steps"] += 1
        warnings.warn(f"step {step}: non-finite loss or gradient; update skipped ({state['bad_steps']} in a row)")
        if state["bad_steps"] >= max_bad_steps:
            raise RuntimeError(f"stopping: {state['bad_steps']} non-finite updates in a row "
                               f"(max_bad_steps={max_bad_steps})")

    if state["step"] == 0 and eval_every > 0:
        before = evaluate(0)
        tracker.log(0, before)
        print_fn(console_line(0, steps, before))

    metrics: dict[str, float] = {}
    bar = tqdm(range(state["step"], steps), initial=state["step"], total=steps, desc="train", unit="step",
               disable=None if main else True)
    for step in bar:
        t0 = time.perf_counter()
        # ---- 1. prompts (this rank's slice of the step's), on-policy rollouts, rewards
        examples = prompts.next(prompts_per_step)[first:first + B]
        prompt_texts = [render_prompt(task.prompt(ex), tokenizer) for ex in examples]
        net.eval()
        with autocast, engine.gathered():
            samples = generator.sample([t for t in prompt_texts for _ in range(G)],
                                       [derive_seed(seed, "rollout", step, first * G + n) for n in range(N)])
        net.train()
        completions = completion_texts(tokenizer, samples.completion_BC, eos_id)
        rewards = [task.reward(text, examples[n // G]) for n, text in enumerate(completions)]
        on = Rows("on_policy", samples.sequences_BL, samples.attention_mask_BL, samples.prompt_length,
                  completion_mask(samples.completion_BC, eos_id), samples.unmask_step_BC,
                  torch.arange(B).repeat_interleave(G), rewards, completions, version=step, estimator=estimator)
        on.mask_seeds = mask_seeds("on_policy", N, first * G)
        rewards_BG = on.rewards_N.view(B, G)
        t1 = time.perf_counter()

        # ---- 2. external rollouts (ERILS) and every row's advantage
        ext, ext_metrics, counts = None, {}, [0] * world.size
        if mixer is None:
            on.adv_N = compute_advantages(rewards_BG, advantage).reshape(N)
        else:
            correct_BG = torch.tensor([r.correct for r in rewards]).view(B, G)
            with autocast:
                ext, ext_metrics = mixer.rows(step=step, seed=seed, task=task, examples=examples,
                                              prompt_texts=prompt_texts, correct_BG=correct_BG, tokenizer=tokenizer,
                                              window=generator.gen_length, eos_id=eos_id, max_length=max_length,
                                              prompt_offset=first,
                                              widest=lambda n: max(all_gather_objects(n, world)))
            mixer.assign_advantages(on, ext, rewards_BG, advantage, gather=gather)
            counts = all_gather_objects(len(ext) if ext is not None else 0, world)
            if ext is not None:
                ext.mask_seeds = mask_seeds("external", len(ext), sum(counts[:world.rank]))
            elif stand_ins and any(counts):
                ext = inert_rows(on, "external", mixer.estimator)
        parts = [on] + ([ext] if ext is not None else [])
        real_ext = ext if ext is not None and not ext.inert else None
        t2 = time.perf_counter()

        # ---- 3. old and reference log-probs under the stored mask seeds
        with torch.no_grad(), autocast:
            for part in parts:
                part.old_logp = [None if reuse_current else part.score_all(policy, it)
                                 for it in range(inner_iterations)]
                part.ref_logp = [None if reference is None else part.score_all(reference, it)
                                 for it in range(inner_iterations)]
        if importance:
            ext_metrics.update(mixer.importance_weights(real_ext, gather))
        t3 = time.perf_counter()

        # ---- 4. mu inner iterations of minibatch updates (every rank makes the same number of steps)
        # every rank draws the single-process minibatch plan over all ranks' rows and keeps its own
        global_sizes, starts, local_sizes = [N * world.size], [first * G], [N]
        if len(parts) > 1:
            global_sizes, starts, local_sizes = (global_sizes + [sum(counts)], starts + [sum(counts[:world.rank])],
                                                 local_sizes + [counts[world.rank]])
        informative = any_rank(any(bool((part.adv_N != 0).any()) for part in parts), world)
        mix = mixer.config.minibatch_mix if mixer is not None else "stratified"
        loss_metrics: list[dict[str, float]] = []
        updates = 0
        for it in range(inner_iterations) if informative else []:
            shuffle = torch.Generator().manual_seed(derive_seed(seed, "minibatch", step, it))
            for picks in rank_plan(global_sizes, starts, local_sizes, minibatches, mix, shuffle):
                with autocast:
                    inputs, padded = loss_inputs(parts, picks, policy, it, reuse_current, pad_empty=stand_ins)
                loss, lm = grpo_loss(**inputs, **loss_options)
                if world.size > 1:  # weigh by this rank's share of the minibatch's units (tokens or rows)
                    units = aggregation_units(inputs["mask_NC"], aggregation)
                    total = all_sum([units - (padded if aggregation == "constant" else 0)], world)[0]
                    share = world.size * units / total if total > 0 else 0.0
                    loss = loss * share  # the mean over ranks is then the loss over all ranks' rows
                    lm = {**lm, "loss/policy": lm["loss/policy"] * share, "loss/kl": lm["loss/kl"] * share}
                if any_rank(not bool(torch.isfinite(loss)), world):
                    bad_update(step)
                    continue
                engine.backward(loss)
                grad_norm = engine.step()
                if grad_norm is None:
                    bad_update(step)
                    continue
                state["bad_steps"] = 0
                updates += 1
                loss_metrics.append({**lm, "policy/grad_norm": grad_norm})
        with warnings.catch_warnings():  # a step without an update still advances the schedule, on purpose
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            scheduler.step()
        if reference is not None and ref_sync_every > 0 and (step + 1) % ref_sync_every == 0:
            engine.sync_reference(reference.model)
        t4 = time.perf_counter()

        # ---- 5. metrics (averaged over ranks), samples, evaluation, checkpoint
        metrics = {
            **source_metrics(on), **(source_metrics(real_ext) if real_ext is not None else {}), **ext_metrics,
            "reward/accuracy": sum(r.correct for r in rewards) / N,
            "reward/format": sum(r.formatted for r in rewards) / N,
            "reward/zero_std_groups": float((rewards_BG.std(-1) == 0).float().mean()),
            "policy/updates": float(updates),
            "policy/lr": scheduler.get_last_lr()[0],
            "perf/rollout_s": t1 - t0, "perf/external_s": t2 - t1, "perf/score_s": t3 - t2,
            "perf/update_s": t4 - t3,
            "perf/tokens_per_s": float(on.lengths_N.sum()) / max(t1 - t0, 1e-9),
        }
        for key in loss_metrics[0] if loss_metrics else []:
            metrics[key] = sum(m[key] for m in loss_metrics) / len(loss_metrics)
        metrics = mean_metrics(metrics, world, summed=COUNTS)
        state.update(step=step + 1, data_position=prompts.position,
                     external_baseline=mixer.baseline if mixer is not None else 0.0)
        if eval_every > 0 and ((step + 1) % eval_every == 0 or step + 1 == steps):
            metrics.update(evaluate(step + 1))
        tracker.log(step + 1, metrics)
        if sample_every > 0 and (step % sample_every == 0 or step + 1 == steps):
            tracker.samples(step + 1, sample_rows(on, prompt_texts, every=G)
                            + sample_rows(real_ext, prompt_texts, every=1))
        print_fn(console_line(step + 1, steps, metrics))
        if checkpoint_every > 0 and ((step + 1) % checkpoint_every == 0 or step + 1 == steps):
            synced_reference = reference.model if reference is not None and ref_sync_every > 0 else None
            save_checkpoint(run_dir, step + 1, engine, scheduler, dict(state), keep_last=keep_checkpoints,
                            tokenizer=tokenizer, reference=synced_reference)
    bar.close()
    tracker.close()
    if main:
        print_fn(run_summary(run_dir))
    return metrics


def run_summary(run_dir: Path, window: int = 10) -> str:
    """The closing lines of a run: training reward early against late, held-out accuracy before and after."""
    from dllm_rl.analysis import eval_table, load_run, series

    run = load_run(run_dir)
    reward, evals = series(run, "reward/on_policy"), eval_table(run)
    lines = [f"run {run_dir}: {int(run['metrics']['step'].max())} steps"]
    if len(reward):
        lines.append(f"  on-policy training reward: {reward.iloc[:window].mean():.3f} (first {min(window, len(reward))} "
                     f"steps) -> {reward.iloc[-window:].mean():.3f} (last {min(window, len(reward))})")
    external = series(run, "reward/external")
    if len(external):
        lines.append(f"  external rows per step: {series(run, 'external/rows').mean():.1f}, "
                     f"their mean reward {external.mean():.3f}")
    for key in [k for k in evals.columns if k in ("eval/pass@1", "eval/sampled_pass@1") or k.startswith("eval/best_of")]:
        values = " -> ".join(f"{v:.3f}" for v in evals[key])
        lines.append(f"  held-out {key[5:]} at steps {', '.join(map(str, evals['step']))}: {values}")
    return "\n".join(lines)


def source_metrics(rows: Rows) -> dict[str, float]:
    """reward/<source>, len/<source> and adv/<source> (mean advantage) for one source's rows."""
    return {f"reward/{rows.source}": float(rows.rewards_N.mean()), f"len/{rows.source}": float(rows.lengths_N.mean()),
            f"adv/{rows.source}": float(rows.adv_N.mean())}


def sample_rows(rows: Rows | None, prompt_texts: list[str], every: int) -> list[dict[str, Any]]:
    """Every `every`-th row of a source as a samples.jsonl record."""
    if rows is None:
        return []
    return [{"source": rows.source, "version": rows.version, "prompt": prompt_texts[int(rows.prompt_N[n])],
             "completion": rows.texts[n], "reward": rows.rewards[n].score, "reason": rows.rewards[n].reason,
             "advantage": float(rows.adv_N[n])} for n in range(0, len(rows), every)]
