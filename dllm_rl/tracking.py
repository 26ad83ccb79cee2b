"""Where a run's numbers go: one readable console line per step, metrics.jsonl, TensorBoard, samples.jsonl.

Metric keys are namespaced (`reward/on_policy`, `reward/external`, `loss/policy`, `perf/rollout_s`, ...). Only rank 0 writes;
other ranks get a tracker that does nothing, so the loop never asks which rank it is on.

A resumed run continues from its checkpoint's step k, so the logs are first cut back to step k (`resume_step`):
lines of later steps, which the resumed run writes again, and a partial last line left by a kill in the middle
of a write are dropped, and TensorBoard purges its events after k. Every step then appears once.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any, Iterator

# The console line: (metric key, label, format); missing keys are skipped.
CONSOLE_FIELDS = [
    ("reward/on_policy", "reward", "{:.3f}"), ("reward/accuracy", "acc", "{:.3f}"),
    ("reward/external", "ext", "{:.3f}"), ("external/rows", "ext_rows", "{:.0f}"), ("loss/kl", "kl", "{:.4f}"),
    ("policy/clip_frac", "clip", "{:.3f}"), ("len/on_policy", "len", "{:.1f}"), ("eval/pass@1", "eval", "{:.3f}"),
    ("perf/rollout_s", "roll", "{:.1f}s"), ("perf/external_s", "ext_s", "{:.1f}s"), ("perf/score_s", "score", "{:.1f}s"),
    ("perf/update_s", "upd", "{:.1f}s"),
]


def console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if key in metrics and isinstance(metrics[key], (int, float)) and math.isfinite(metrics[key]):
            parts.append(f"{label} {fmt.format(metrics[key])}")
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


class Tracker:
    def __init__(self, run_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            for name in ("metrics.jsonl", "samples.jsonl"):
                cut_back(self.run_dir / name, resume_step)
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        with open(self.run_dir / "samples.jsonl", "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


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
        self._writer = None

    def log(self, step, metrics):
        pass

    def samples(self, step, rows):
        pass


def run_header(run_dir: Path, world_size: int, device, bf16: bool | str, autocast: bool, config: dict,
               start: str) -> str:
    """What a run says at its start, before its progress: where it writes, from where it starts, the device, the
    precision `bf16=auto` resolved to, and the whole config (as config.json holds it)."""
    import yaml

    processes = f"{world_size} process{'es' if world_size > 1 else ''}"
    precision = "bf16 autocast" if autocast else "fp32"
    why = {("auto", True): "bf16=auto: this device computes in bf16 natively",
           ("auto", False): "bf16=auto: this device has no native bf16"}.get((str(bf16), autocast), f"bf16={bf16}")
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=110).rstrip()
    lines = [f"run {run_dir} ({start})", f"  device: {device}, {processes}",
             f"  precision: {precision} ({why})", f"  config ({Path(run_dir) / 'config.json'}):"]
    return "\n".join(lines + [f"    {line}" for line in body.splitlines()])
