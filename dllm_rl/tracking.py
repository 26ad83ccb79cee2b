"""Where a run's numbers go: one readable console line per step, metrics.jsonl, TensorBoard, samples.jsonl.

Metric keys are namespaced (`reward/on_policy`, `reward/external`, `loss/policy`, `perf/rollout_s`, ...). Only rank 0
writes; other ranks get a tracker that does nothing, so the loop never asks which rank it is on.

A resumed run continues from its checkpoint's step k, so the logs are first cut back to step k (`resume_step`):
lines of later steps, which the resumed run writes again, and a partial last line left by a kill in the middle
of a write are dropped, and TensorBoard purges its events after k. Every step then appears once.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

# The console line: (metric key, label, format); missing keys are skipped.
CONSOLE_FIELDS = [
    ("env/success", "success", "{:.3f}"), ("env/turns", "turns", "{:.1f}"), ("env/invalid", "invalid", "{:.2f}"),
    ("reward/on_policy", "reward", "{:.3f}"), ("reward/accuracy", "acc", "{:.3f}"),
    ("reward/external", "ext", "{:.3f}"), ("external/rows", "ext_rows", "{:.0f}"), ("loss/kl", "kl", "{:.4f}"),
    ("policy/clip_frac", "clip", "{:.3f}"), ("len/on_policy", "len", "{:.1f}"), ("eval/pass@1", "eval", "{:.3f}"),
    ("perf/rollout_s", "roll", "{:.1f}s"), ("perf/external_s", "ext_s", "{:.1f}s"),
    ("perf/score_s", "score", "{:.1f}s"), ("perf/update_s", "upd", "{:.1f}s"),
]
QUIET_AT_ZERO = {"kl", "ext_s", "score"}  # left out where they print as zero (beta 0, no external rows, no scoring)


def console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """One line per step: the fields that say something (`acc` only where it differs from `reward`, i.e. with a
    format bonus; kl and the external and scoring times only where they are not zero)."""
    parts, shown = [f"step {step}/{total}"], {}
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            text = fmt.format(metrics[key])
            if label in QUIET_AT_ZERO and float(text.rstrip("s")) == 0:
                continue
            if label == "acc" and text == shown.get("reward"):
                continue
            shown[label] = text
            parts.append(f"{label} {text}")
    return " | ".join(parts)


class PhaseTimer:
    """Wall-clock seconds per named phase of a step: `with timer("rollout"): ...` adds to `perf/rollout_s`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.current: str | None = None  # the phase running now (what a failure report names)

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start, self.current = time.perf_counter(), phase
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"perf/{phase}_s": s for phase, s in self.seconds.items()}


LOGGERS = {"tensorboard": {}, "wandb": {"project": "dllm-rl", "entity": None, "run_name": None, "tags": [],
                                         "mode": "online"}}
WANDB_MODES = ("online", "offline", "disabled")


def check_logger(options: dict[str, Any]) -> dict[str, Any]:
    """The `logger` group by name, keys and values; returns it with its defaults."""
    from dllm_rl.errors import ConfigError, pick, require

    name = options.get("name", "tensorboard")
    defaults = pick(LOGGERS, name, "logger")
    given = {k: v for k, v in options.items() if k != "name"}
    for key in sorted(set(given) - set(defaults)):
        raise ConfigError(f"logger.{key}: not a key of logger={name} (its keys: {sorted(defaults) or 'none'})")
    merged = {**defaults, **given}
    if name == "wandb":
        require(merged["mode"] in WANDB_MODES, f"logger.mode={merged['mode']!r}: expected one of {list(WANDB_MODES)}")
        require(isinstance(merged["tags"], (list, tuple)) and all(isinstance(t, str) for t in merged["tags"]),
                f"logger.tags={merged['tags']!r}: expected a list of strings")
        require(isinstance(merged["project"], str) and merged["project"],
                f"logger.project={merged['project']!r}: expected a project name")
    return {"name": name, **merged}


class WandbSink:
    """A W&B run beside the run directory's own logs: the metrics under the same keys and steps as
    metrics.jsonl, sampled completions as a table per logged step. Its files go to <run_dir>/wandb; a resumed
    run continues the same W&B run (its id is kept in <run_dir>/wandb_run_id)."""

    def __init__(self, run_dir: Path, options: dict[str, Any], config: dict[str, Any] | None):
        try:
            import wandb
        except ImportError:
            from dllm_rl.errors import ConfigError

            raise ConfigError("logger=wandb needs the wandb package: pip install wandb "
                              "(or the `wandb` extra)") from None
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        self.wandb = wandb
        self.run = wandb.init(project=options["project"], entity=options["entity"], tags=list(options["tags"]),
                              name=options["run_name"] or run_dir.name, mode=options["mode"], dir=str(run_dir),
                              id=run_id, resume="allow", config=config or {},
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        if rows:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            table = self.wandb.Table(columns=["step", *columns],
                                     data=[[step, *[row.get(c) for c in columns]] for row in rows])
            self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracker:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None,
                 logger: dict[str, Any] | None = None, config: dict[str, Any] | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            for name in ("metrics.jsonl", "samples.jsonl", "held_out.jsonl"):
                cut_back(self.run_dir / name, resume_step)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)
        logger = check_logger(logger or {})
        self._wandb = WandbSink(self.run_dir, logger, config) if logger["name"] == "wandb" else None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(step, metrics)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")
        if self._wandb is not None:
            self._wandb.samples(step, rows)

    def held_out(self, step: int, correct: dict[str, int] | None) -> None:
        """One held-out evaluation's greedy result per prompt (uid -> 0/1) into held_out.jsonl: what paired
        standard errors between evaluations and between runs are computed from (dllm_rl/analysis.py)."""
        if correct is not None:
            with open(self.run_dir / "held_out.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "uid": list(correct), "correct": list(correct.values())}) + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.close()


def cut_back(path: Path, step: int) -> None:
    """Keep the lines of a JSONL log up to `step`; drop later steps and lines that do not parse (a partial last
    line). Rewritten under a temporary name and renamed, so a kill now loses nothing either."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


class NullTracker(Tracker):
    """What non-zero ranks get: every call does nothing."""

    def __init__(self, *args, **kwargs):
        self._writer = self._wandb = None

    def log(self, step, metrics):
        pass

    def samples(self, step, rows):
        pass

    def held_out(self, step, correct):
        pass


def run_header(run_dir: Path, world_size: int, device, bf16: bool | str, autocast: bool, config: dict,
               start: str, decided: list[str] = ()) -> str:
    """What a run says at its start, before its progress: where it writes, from where it starts, the device, the
    precision `bf16=auto` resolved to, what other `auto` settings became (`decided`), and the whole config (as
    config.json holds it)."""
    import yaml

    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    precision = "bf16 autocast" if autocast else "fp32"
    why = {("auto", True): "bf16=auto: this device computes in bf16 natively",
           ("auto", False): "bf16=auto: this device has no native bf16"}.get((str(bf16), autocast), f"bf16={bf16}")
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=110).rstrip()
    lines = [f"run {run_dir} ({start})", f"  device: {device}, {processes}",
             f"  precision: {precision} ({why})", *(f"  {line}" for line in decided),
             f"  config ({Path(run_dir) / 'config.json'}):"]
    return "\n".join(lines + [f"    {line}" for line in body.splitlines()])
