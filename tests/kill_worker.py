"""Run by tests/test_kill.py: a run straight through, then the same run SIGKILLed at random points over TRIALS
attempts, each resumed by the next, then finished. Every attempt is a forked child, so the imports are paid once;
this parent never computes with torch itself (forking after that would be unsafe).

Kill points, drawn with a seeded generator: after a random delay, inside a metrics or samples write (half a line
written), and inside a checkpoint write (half the trainer state, half the manifest, or after the checkpoint is in
place but before `latest` names it). Writes OUT/attempts.json: each attempt's kill point and exit status.

usage: kill_worker.py OUT MODEL SEED TRIALS
"""

import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

import dllm_rl.checkpoint as ckpt  # noqa: E402
import dllm_rl.tracking as tracking  # noqa: E402
from dllm_rl.train import train  # noqa: E402
from tests.conftest import DigitShare  # noqa: E402

STEPS = 8
OPTIONS = dict(
    rollout={"gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0},
    likelihood={"name": "mean_field"}, algo={"advantage": "mean", "beta": 0.0},
    prompts_per_step=2, group_size=4, minibatch_size=8, steps=STEPS, checkpoint_every=2, keep_checkpoints=2,
    eval_every=4, eval_prompts=4, sample_every=1, tensorboard=False, lr=1e-3, warmup=0, external={"name": "none"},
    print_fn=lambda *_: None,
)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def half_write(path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text[: len(text) // 2])
    die()


def arm(kill: dict) -> None:
    """Install the kill point in this (child) process."""
    where, step = kill["where"], kill.get("step")
    if where == "metrics":
        real = tracking.Tracker.log

        def log(self, at, metrics):
            if at == step:
                half_write(self.run_dir / "metrics.jsonl", json.dumps({"step": at, **metrics}) + "\n")
            real(self, at, metrics)

        tracking.Tracker.log = log
    elif where == "samples":
        real_samples = tracking.Tracker.samples

        def samples(self, at, rows):
            if at == step:
                half_write(self.run_dir / "samples.jsonl", "".join(json.dumps({"step": at, **r}) + "\n" for r in rows))
            real_samples(self, at, rows)

        tracking.Tracker.samples = samples
    elif where == "trainer_state":
        real_save = ckpt.torch.save

        def save(obj, path, *args, **kwargs):
            if isinstance(obj, dict) and "torch_rng" in obj and obj["state"]["step"] == step:
                Path(path).write_bytes(b"\x80\x02half")
                die()
            return real_save(obj, path, *args, **kwargs)

        ckpt.torch.save = save
    elif where == "manifest":
        real_manifest = ckpt.write_manifest

        def write_manifest(directory):
            if (directory / "trainer_state.pt").is_file() and f"{step:06d}" in directory.name:
                (directory / ckpt.MANIFEST).write_text('{"files": {"model.safet')
                die()
            return real_manifest(directory)

        ckpt.write_manifest = write_manifest
    elif where == "latest":
        real_atomic = ckpt.atomic_write

        def atomic_write(path, text):
            if path.name == "latest" and text.strip() == f"step_{step:06d}":
                die()
            return real_atomic(path, text)

        ckpt.atomic_write = atomic_write


def attempt(run: Path, resume: bool, kill: dict | None, limit_s: float = 300) -> int:
    """One forked training attempt; returns its exit status (negative: the signal that ended it)."""
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            if kill is not None:
                arm(kill)
            train(DigitShare(), model=MODEL, **({"resume": str(run)} if resume else {"run_dir": str(run)}), **OPTIONS)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    begin = time.monotonic()
    delay = kill.get("delay_s") if kill else None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        elapsed = time.monotonic() - begin
        if (delay is not None and elapsed > delay) or elapsed > limit_s:
            os.kill(pid, signal.SIGKILL)
            delay = None
        time.sleep(0.01)


def main(out: Path, seed: int, trials: int) -> None:
    begin = time.monotonic()
    assert attempt(out / "straight", resume=False, kill=None) == 0
    duration = time.monotonic() - begin
    rng = random.Random(seed)
    wheres = ["time", "metrics", "samples", "trainer_state", "manifest", "latest"]
    # every kind of kill point at least once, then random ones
    plan = wheres + [rng.choice(wheres) for _ in range(max(0, trials - len(wheres)))]
    rng.shuffle(plan)
    run, log = out / "killed", []
    for i, where in enumerate(plan[:trials]):
        done = ckpt.latest_checkpoint(run) if run.is_dir() else None
        start = int(done.name.removeprefix("step_")) if done is not None else 0  # where a resume would begin
        if start == STEPS:
            break  # a timed kill came too late: the run is complete
        kill = {"where": where, "from": start}
        if where == "time":
            kill["delay_s"] = round(rng.uniform(0.05, 0.7) * duration * (STEPS - start) / STEPS, 2)
        elif where == "metrics":
            kill["step"] = rng.randint(start + (start > 0), STEPS)  # step 0 is the evaluation before training
        elif where == "samples":
            kill["step"] = rng.randint(start + 1, STEPS)
        else:
            kill["step"] = rng.choice(range(start + 2, STEPS + 1, 2))
        # a resume where the run directory exists (an attempt killed before it made one starts the run again)
        status = attempt(run, resume=run.is_dir(), kill=kill)
        log.append({**kill, "status": status})
    log.append({"where": "finish", "status": attempt(run, resume=run.is_dir(), kill=None)})
    (out / "attempts.json").write_text(json.dumps({"straight_s": duration, "attempts": log}, indent=1))


if __name__ == "__main__":
    MODEL = sys.argv[2]
    main(Path(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4]))
