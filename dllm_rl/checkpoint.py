"""Checkpoints that survive being killed mid-write, and finding the last complete one.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding the model and its tokenizer (a model
directory that `dllm-rl eval model=...` loads),
`trainer_state.pt` (optimizer, LR schedule, RNG states, and the loop's own state: step, data position,
counters) and a `COMPLETE` marker written last. It is assembled under a temporary name and renamed into
place (an atomic rename on POSIX), then `checkpoints/latest` is rewritten the same way. A run killed at any
moment therefore leaves either the new checkpoint whole or the previous one as the latest.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

MARKER = "COMPLETE"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, model, optimizer, scheduler, state: dict[str, Any],
                    keep_last: int = 2, tokenizer=None) -> Path:
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    if tokenizer is not None:  # so that a checkpoint is a model directory `dllm-rl eval` can load
        tokenizer.save_pretrained(tmp)
    torch.save({
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "state": state,
    }, tmp / "trainer_state.pt")
    (tmp / MARKER).write_text(f"{step}\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write(root / "latest", final.name + "\n")
    for old in sorted(complete_checkpoints(run_dir))[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint named by `latest` if it is complete, else the newest complete one, else None."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MARKER).is_file():
            return named
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def load_trainer_state(path: Path, optimizer, scheduler) -> dict[str, Any]:
    """Restore optimizer, schedule and RNG from a checkpoint; returns the loop's state dict. (The model is
    loaded from the same directory with `from_pretrained` by the caller.)"""
    saved = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["torch_rng"])
    return saved["state"]
