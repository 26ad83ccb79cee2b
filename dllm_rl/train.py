"""`dllm-rl train`: GRPO for a masked-diffusion policy, one step a pipeline of stages read top to bottom.

One step (`run_steps` below; the stages are in `dllm_rl/collect.py`, `dllm_rl/stages.py` and `dllm_rl/learner.py`,
with the `StepBatch` that flows between them):

    choose prompts -> generate on-policy rollouts -> verify -> external rollouts (ERILS) -> advantages
    -> old/reference log-probs -> update -> metrics, held-out evaluation, checkpoint

Without external rollouts this is diffu-GRPO (d1, arXiv 2504.12216). Who owns what:
- `TrainConfig` (`dllm_rl/train_config.py`): every option, checked by name, type and range before anything is
  loaded; its defaults are configs/train.yaml's;
- `dllm_rl/collect.py`, `dllm_rl/stages.py`, `dllm_rl/learner.py`: each stage, testable alone
  (`dllm_rl/curation/`: which prompts get rollouts and how many, which rows teach); the estimator, advantage, KL,
  loss aggregation and the ERILS options are built once here from their configs (`build_estimator`,
  `build_mixer`, `split_algo`);
- `DataParallel` (`dllm_rl/data_parallel.py`): which prompt groups and rows are this rank's, stand-in rows, the
  single-process minibatch plan, the global loss normaliser, and every cross-rank decision; the loop names no rank;
- `Engine` (`dllm_rl/engine/`): DeepSpeed; one `update(loss)` does backward, the non-finite checks and the step;
- `dllm_rl/checkpoint.py`: atomic checkpoints and exact resume; `dllm_rl/tracking.py`: metrics and samples.
`dllm_rl/run_setup.py` sets the run up (process group, models, engine, stages); this module runs the loop and
writes the summary.

How it departs from d1:
- every random draw (rollout noise, estimator masks, prompt order, minibatches) is a function of (seed, step,
  row), so a resumed run repeats the uninterrupted one exactly and N ranks repeat one process. The exception is
  dropout (LoRA's), which draws from the global RNG: seeded from (seed, rank) and saved per rank with every
  checkpoint, so a resumed run still repeats the uninterrupted one, but N ranks draw other dropout masks than
  one process (old and reference log-probs are scored without dropout);
- with one inner iteration and one minibatch, the old log-probs are the current ones detached (the ratio is
  exactly 1; this saves one scoring pass), as in d1's own implementation;
- a step without a learning signal (every group's rewards equal, or every row with a non-zero advantage given
  loss weight 0 by the sampler correction) skips the update instead of letting AdamW's moments and weight decay
  move the weights (`policy/no_signal`).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from dllm_rl.checkpoint import latest_checkpoint, save_checkpoint
from dllm_rl.collect import StepBatch
from dllm_rl.data.task import Task
from dllm_rl.device import default_device
from dllm_rl.engine import peers_answering, stop_together
from dllm_rl.errors import Interrupted
from dllm_rl.run_setup import Run, setup
from dllm_rl.stages import sample_rows, step_metrics
from dllm_rl.step import AFTER_UPDATE, BEFORE_UPDATE, UPDATE, StepParts
from dllm_rl.tracking import PhaseTimer, console_line
from dllm_rl.train_config import TrainConfig
from dllm_rl.workers.pipe import run_piped_step


def train(task: Task, *, saved_config: dict[str, Any] | None = None, allow_changes: bool = False,
          print_fn=tqdm.write, **options) -> dict[str, float]:
    """Run GRPO (with ERILS external rollouts unless `external.name` is none) on `task`, on every rank of the
    process group (one process without a launcher). `options` are TrainConfig's fields (configs/train.yaml's
    keys); `saved_config`, the whole resolved config, is written to the run's config.json (without it, the
    options and the task's name). With `resume`, a change that would alter the run is refused unless
    `allow_changes` (dllm_rl/resume.py). Returns the last step's metrics, averaged over ranks."""
    cfg = TrainConfig.from_options(options)
    gpu = default_device()
    # the global RNG, which only dropout draws from, is the run's own: seeded from (seed, rank), saved with
    # checkpoints, and the caller's state is back when the run ends
    with stop_together(), torch.random.fork_rng(devices=[gpu.index] if gpu.type == "cuda" else []):
        run = setup(task, cfg, print_fn, saved_config, allow_changes)
        try:
            metrics = run_steps(run)
        finally:  # rollout workers (and a Ray this run started) stop with the run, however it ends
            close_rollouts(run)
    run.tracker.close()
    if run.parts.dp.world.is_main:
        run.print_fn(run_summary(run.run_dir))
    return metrics


def run_steps(run: Run) -> dict[str, float]:
    """The loop: each step's stages, then metrics, samples, evaluation and checkpoint."""
    cfg, dp = run.cfg, run.parts.dp
    if run.state["step"] == 0 and cfg.eval_every > 0:
        with peers_answering(lambda: "the evaluation before step 1", lambda: resume_hint(run)):
            before = run.held_out()
        run.tracker.log(0, before)
        run.tracker.held_out(0, run.held_out.correct)
        run.print_fn(console_line(0, cfg.steps, before))
    metrics: dict[str, float] = {}
    bar = progress_bar(run)
    with StopRequest() as stop, bar:
        for step in bar:
            timer = PhaseTimer()
            with peers_answering(lambda: f"the {timer.current} phase of step {step + 1}", lambda: resume_hint(run)):
                batch, metrics = run_step(run.parts, step, timer)
                timer.current = "evaluation, logging and checkpoint"
                record_step(run, step, batch, metrics)
                stopping = dp.any(stop.requested)  # a collective too: a peer lost here is named like the others
                if stopping:  # every rank stops after the same step, with a checkpoint of it where the run keeps any
                    done = step + 1
                    if cfg.checkpoint_every > 0 and not checkpoint_due(cfg, done):
                        checkpoint(run, done)
            if stopping:
                raise Interrupted(f"interrupted after step {step + 1} of {cfg.steps}; " + (
                    "checkpoint_every=0 keeps no checkpoint, so the run cannot be resumed" if cfg.checkpoint_every == 0
                    else f"the checkpoint of step {step + 1} is written: continue with resume={run.run_dir}"))
    return metrics


def run_step(parts: StepParts, step: int, timer: PhaseTimer) -> tuple[StepBatch, dict[str, float]]:
    """One step: the rollouts, then the stages of dllm_rl/step.py in order, each timed (with `workers.pipe`, each
    group's stages as it arrives: dllm_rl/workers/pipe.py)."""
    if parts.piped:
        return run_piped_step(parts, step, timer)
    with timer("rollout"):
        batch = parts.collect(step)  # choose prompts, allocate, generate, select, verify (rounds: dynamic sampling)
    for stage in BEFORE_UPDATE:
        with timer(stage.phase):
            stage.run(parts, batch)
    with timer(UPDATE.phase):
        update_metrics = parts.learner.update(batch)
        for stage in AFTER_UPDATE:
            stage.run(parts, batch)
    return batch, step_metrics(batch, update_metrics, timer.metrics(), parts.dp)


def rollout_stage(run: Run):
    """What generates the rollouts: the collect stage's rollouts, or an asynchronous collect stage itself."""
    return getattr(run.parts.collect, "rollouts", run.parts.collect)


def policy_version(run: Run) -> int:
    """The policy version published to rollout workers so far (0 with in-process rollouts)."""
    return getattr(rollout_stage(run), "version", run.state.get("policy_version", 0))


def drawn_ahead(run: Run) -> dict[str, Any]:
    """With asynchronous rollouts, where a resume draws prompts again (dllm_rl/workers/pipelined.py)."""
    resume_state = getattr(rollout_stage(run), "resume_state", None)
    if resume_state is None:
        return {}
    where = resume_state()
    return {"data_position": where["position"], "trained_after": where["trained_after"]}


def close_rollouts(run: Run) -> None:
    """Stop what produces rollouts: the rollout workers, and an external source's threads and connections."""
    for owner in (rollout_stage(run), run.mixer.source if run.mixer is not None else None):
        close = getattr(owner, "close", None)
        if close is not None:
            close()


def resume_hint(run: Run) -> str:
    """Where an interrupted run continues from: its newest intact checkpoint, and the resume command."""
    checkpoint = latest_checkpoint(run.run_dir)
    where = (f"the last checkpoint is step {int(checkpoint.name.split('_')[-1])}" if checkpoint is not None
             else "no checkpoint was written yet (a resume starts again from step 0)")
    return f"{where}; continue with resume={run.run_dir}"


def record_step(run: Run, step: int, batch: StepBatch, metrics: dict[str, float]) -> None:
    """After the update: the loop's state, held-out evaluation, the logs, the console line and, when one is due,
    a checkpoint."""
    cfg, state, learner, done = run.cfg, run.state, run.parts.learner, step + 1
    state.update(step=done, data_position=run.prompts.position, trained_after=run.prompts.trained_after(),
                 bad_steps=learner.bad_steps,
                 external_baseline=run.mixer.baseline if run.mixer is not None else 0.0,
                 curation=run.parts.curation.state_dict(), policy_version=policy_version(run))
    state.update(drawn_ahead(run))  # asynchronous rollouts draw prompts ahead of the step
    if cfg.eval_every > 0 and (done % cfg.eval_every == 0 or done == cfg.steps):
        metrics.update(run.held_out())
        run.tracker.held_out(done, run.held_out.correct)
    run.tracker.log(done, metrics)
    if cfg.sample_every > 0 and (step % cfg.sample_every == 0 or done == cfg.steps):
        run.tracker.samples(done, sample_rows(batch))
    run.print_fn(console_line(done, cfg.steps, metrics))
    if checkpoint_due(cfg, done):
        checkpoint(run, done)


def checkpoint_due(cfg, done: int) -> bool:
    """Whether the run keeps a checkpoint of step `done` (every `checkpoint_every` steps, and the last)."""
    return cfg.checkpoint_every > 0 and (done % cfg.checkpoint_every == 0 or done == cfg.steps)


def checkpoint(run: Run, done: int) -> None:
    """A checkpoint of the run after step `done` (every rank calls it)."""
    learner = run.parts.learner
    synced = learner.reference.model if learner.reference is not None and run.cfg.ref_sync_every > 0 else None
    save_checkpoint(run.run_dir, done, learner.engine, learner.scheduler, dict(run.state),
                    keep_last=run.cfg.keep_checkpoints, tokenizer=run.learned.tokenizer, reference=synced)


class StopRequest:
    """Ctrl-C (SIGINT) asks the loop to stop at the end of the current step, after a checkpoint of it (where the
    run keeps checkpoints: checkpoint_every > 0); a second Ctrl-C stops at once. Only the main thread can catch signals; elsewhere nothing is installed."""

    def __init__(self) -> None:
        self.requested = False
        self.previous = None
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self.handle)

    def handle(self, signum, frame) -> None:
        if self.requested:
            self.release()
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    def release(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def progress_bar(run: Run) -> tqdm:
    """The steps left, as a progress bar on rank 0 (the other ranks iterate silently)."""
    return tqdm(range(run.state["step"], run.cfg.steps), initial=run.state["step"], total=run.cfg.steps,
                desc="train", unit="step", disable=None if run.parts.dp.world.is_main else True)


def run_summary(run_dir: Path, window: int = 10) -> str:
    """The closing lines of a run: training reward early against late (the first and last `window` steps, or
    the two halves of a shorter run, each mean ± its standard error over steps), held-out accuracy at every
    evaluation, and the greedy held-out gain from the first evaluation to the last with its standard error paired
    over the prompts (dllm_rl/analysis.py)."""
    from dllm_rl.analysis import eval_table, held_out_gain, load_run, mean_se, series

    run = load_run(run_dir)
    reward, evals = series(run, "reward/on_policy"), eval_table(run)
    steps = int(run["metrics"]["step"].max())
    lines = [f"run {run_dir}: {steps} step{'s' if steps != 1 else ''}"]

    def interval(values) -> str:
        mean, se = mean_se(values)
        return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} ± {se:.3f}"

    if len(reward) == 1:
        lines.append(f"  on-policy training reward: {reward.iloc[0]:.3f} (1 step)")
    elif len(reward):
        n = min(window, len(reward) // 2)  # never the same steps on both sides
        lines.append(f"  on-policy training reward: {interval(reward.iloc[:n])} ({steps_named('first', n)}) -> "
                     f"{interval(reward.iloc[-n:])} ({steps_named('last', n)})")
    external = series(run, "reward/external")
    if len(external):
        lines.append(f"  external rows per step: {series(run, 'external/rows').mean():.1f}, "
                     f"their mean reward {external.mean():.3f}")
    # a provenance side that holds every held-out prompt (the external source solves all, or none) is pass@1 again
    fraction = evals["eval/external_solved_fraction"] if "eval/external_solved_fraction" in evals else None
    whole = {"eval/pass1_external_solved": fraction is not None and bool((fraction == 1).all()),
             "eval/pass1_external_failed": fraction is not None and bool((fraction == 0).all())}
    for key in [k for k in evals.columns if (k in ("eval/pass@1", "eval/sampled_pass@1")
                or k.startswith(("eval/best_of", "eval/pass1_external_"))) and not whole.get(k)]:
        values = " -> ".join(f"{v:.3f}" for v in evals[key])
        lines.append(f"  held-out {key[5:]} at steps {', '.join(map(str, evals['step']))}: {values}")
    gain = held_out_gain(run)
    if gain is not None:
        ratio = f", {gain['gain'] / gain['gain_se']:+.1f} s.e." if gain["gain_se"] > 0 else ""
        lines.append(f"  held-out greedy pass@1 ({gain['prompts']} prompts), step {gain['start_step']} -> "
                     f"{gain['end_step']}: {gain['start']:.3f} ± {gain['start_se']:.3f} -> {gain['end']:.3f} ± "
                     f"{gain['end_se']:.3f}, gain {gain['gain']:+.3f} ± {gain['gain_se']:.3f} (paired over "
                     f"prompts{ratio})")
    return "\n".join(lines)


def steps_named(which: str, n: int) -> str:
    return f"{which} step" if n == 1 else f"{which} {n} steps"
