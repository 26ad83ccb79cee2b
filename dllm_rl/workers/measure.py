"""`dllm-rl plan measure=true`: the planner's numbers from a short training run with one synchronous rollout worker
on this machine (its GPU where there is one, as `dllm-rl train` places models): the learner's seconds of work per
step, the seconds to publish a version, the rollouts per step and one worker's rollouts per second."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dllm_rl.errors import RunStopped

TRAINING = ("perf/external_s", "perf/score_s", "perf/update_s")


def measure(steps: int, overrides: list[str], print_fn=print) -> dict[str, float]:
    """train_s, publish_s, batch, group_size and throughput (one worker) as measured, over steps 2..steps."""
    with tempfile.TemporaryDirectory(prefix="dllm-rl-plan-") as scratch:
        run = Path(scratch) / "run"
        command = [sys.executable, "-m", "dllm_rl.cli", "train", f"run_dir={run}", f"steps={steps}", "eval_every=0",
                   "checkpoint_every=0", "sample_every=0", "tensorboard=false", "workers.count=1",
                   "workers.max_staleness=0", *overrides]
        print_fn(f"measuring: {' '.join(command[2:])}")
        out = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
        if out.returncode != 0:
            raise RunStopped(f"the measuring run failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        config = json.loads((run / "config.json").read_text())
    steady = [m for m in lines if m.get("step", 0) > 1] or lines
    mean = lambda key: sum(m.get(key, 0.0) for m in steady) / len(steady)  # noqa: E731
    publish = mean("rollout/publish_s")
    generating = mean("perf/rollout_s") - publish  # a synchronous worker: the learner waits for exactly this
    rollouts = mean("rollouts/on_policy")
    return {"train_s": sum(mean(k) for k in TRAINING), "publish_s": publish, "batch": int(round(rollouts)),
            "group_size": int(config["group_size"]), "throughput": rollouts / max(generating, 1e-9)}
