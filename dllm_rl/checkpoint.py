"""Checkpoints that survive being killed mid-write, and finding the last complete one.

A checkpoint is a directory `checkpoints/step_NNNNNN/` holding
- the model and its tokenizer (a Hugging Face model directory that `dllm-rl eval model=...` loads; under
  ZeRO-3 the full weights are gathered for the write),
- `deepspeed/`: DeepSpeed's states, sharded per rank at ZeRO >= 1 (module, fp32 master weights, optimizer);
  `dllm-rl export` consolidates them,
- `reference/` when the KL reference is synced during training (`ref_sync_every`),
- `trainer_state.pt`: the LR schedule, the loop's own state (step, data position, counters), and the ZeRO
  stage and world size it was written with (tensors and plain values only: it loads with `weights_only=True`),
- `rng_rank<R>.pt`: each rank's global random state, its CPU's and its GPUs' (what dropout draws from),
- `MANIFEST.json`: the size and SHA-256 of every other file,
- a `COMPLETE` marker written last.
It is assembled under a temporary name and renamed into place by rank 0 (an atomic rename on POSIX), then
`checkpoints/latest` is rewritten the same way. A run killed at any moment therefore leaves either the new
checkpoint whole or the previous one as the latest. All ranks must see the run directory (a shared
filesystem across nodes).

Resuming (`resumable_checkpoint`) takes the newest complete checkpoint whose files match their manifest and
whose pickles hold nothing but tensors, plain values and the few DeepSpeed records on an allow-list
(`vet_pickles`): a damaged newest checkpoint (a truncated file, a flipped bit) falls back to the previous
complete one with a warning, and a file that would run code when unpickled is refused by name. DeepSpeed
itself unpickles its states with `weights_only=False`, so every file is vetted before DeepSpeed reads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from dllm_rl.engine import CHECKPOINT_TAG, Engine, barrier, deepspeed_state_classes
from dllm_rl.errors import ConfigError, RunStopped

MARKER = "COMPLETE"
MANIFEST = "MANIFEST.json"


def atomic_write(path: Path, text: str) -> None:
    """Write `text` to `path` so that a kill leaves the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: str | Path, step: int, engine: Engine, scheduler, state: dict[str, Any],
                    keep_last: int = 2, tokenizer=None, reference=None) -> Path:
    """Every rank calls this; rank 0 writes the shared files and publishes the checkpoint. A write that fails
    (a full disk, no permission) removes the half-written directory and stops the run with a message that names
    the directory; the previous checkpoint and `latest` are untouched."""
    world = engine.world
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    try:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        barrier(world)
        torch.save(rng_state(), tmp / f"rng_rank{world.rank}.pt")  # before rank 0's manifest (barriers follow)
        engine.save_checkpoint(tmp)
        engine.save_model(tmp, tokenizer)  # so that a checkpoint is a model directory `dllm-rl eval` can load
        if reference is not None:
            engine.save_model(tmp / "reference", tokenizer, module=reference)
        if world.is_main:
            torch.save({
                "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(),
                "state": state,
                "stage": engine.stage,
                "world_size": world.size,
            }, tmp / "trainer_state.pt")
            write_manifest(tmp)
            (tmp / MARKER).write_text(f"{step}\n")
    except (OSError, RuntimeError) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        free = shutil.disk_usage(root if root.is_dir() else Path(run_dir)).free / 2**30
        raise RunStopped(f"could not write checkpoint {final.name} in {root}: "
                         f"{str(error).strip().splitlines()[0][:200]} "
                         f"({free:.2f} GiB free there; a full disk shows as 'No space left on device' or 'unexpected "
                         f"pos'). The previous checkpoint and checkpoints/latest are unchanged: make room, then resume "
                         f"with resume={run_dir}") from error
    if world.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write(root / "latest", final.name + "\n")
        for old in sorted(complete_checkpoints(run_dir))[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier(world)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob("step_*") if (p / MARKER).is_file()) if root.is_dir() else []


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint named by `latest` if it is complete, else the newest complete one, else None. A damaged
    pointer (not a `step_NNNNNN` name) is skipped with a warning, as a damaged checkpoint is."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        try:
            name = pointer.read_text().strip()
        except (UnicodeDecodeError, OSError):
            name = None
        if name is None or not re.fullmatch(r"step_\d+", name):
            warnings.warn(f"{pointer} is damaged (it names no checkpoint); taking the newest complete checkpoint")
        elif (root / name / MARKER).is_file():
            return root / name
    complete = complete_checkpoints(run_dir)
    return complete[-1] if complete else None


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # in chunks: a weights file need not fit in memory (hashlib.file_digest is 3.11+)
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    """MANIFEST.json: {relative path: [bytes, sha256]} of every file of the checkpoint but the marker."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name not in (MARKER, MANIFEST))
    manifest = {p.relative_to(directory).as_posix(): [p.stat().st_size, _sha256(p)] for p in files}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def damage(directory: Path) -> str | None:
    """What is wrong with a checkpoint's files against its manifest, or None when they all match (a checkpoint
    written before manifests existed has none, and is taken as it is)."""
    file = directory / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{MANIFEST} is not valid JSON"
    for name, (size, digest) in manifest.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes where {size} were written"
        if _sha256(path) != digest:
            return f"{name} does not match the checksum it was written with"
    return None


def vet_pickles(directory: Path) -> None:
    """Unpickle every `.pt` file of a checkpoint the safe way (`weights_only=True`, the allow-list above) before
    anything unpickles it the unsafe way; a file that needs any other Python object is a named error."""
    with torch.serialization.safe_globals(deepspeed_state_classes()):
        for path in sorted(directory.rglob("*.pt")):
            try:
                # mmap: the tensors stay on disk (torch's zip format only; a legacy pickle is read whole)
                torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
            except pickle.UnpicklingError as error:
                raise ConfigError(
                    f"{path}: refusing to load it: it holds Python objects a dllm-rl checkpoint does not "
                    f"({str(error).splitlines()[0][:200]}); unpickling it could run code. Resume only from "
                    f"checkpoints you wrote, or export the weights of one you trust with another tool") from None


def resumable_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint that is intact: its files match the manifest and its pickles pass
    `vet_pickles`. A damaged one is skipped with a warning that names what is wrong; None if there is none."""
    candidates = complete_checkpoints(run_dir)[::-1]
    named = latest_checkpoint(run_dir)
    if named is not None:
        candidates = [named] + [c for c in candidates if c != named]
    for checkpoint in candidates:
        why = damage(checkpoint)
        if why is None:
            try:
                vet_pickles(checkpoint)
                return checkpoint
            except ConfigError:
                raise
            except Exception as error:  # a truncated or corrupt file that torch cannot read at all
                why = f"a file cannot be read ({type(error).__name__}: {str(error).splitlines()[0][:200]})"
        warnings.warn(f"{checkpoint} is damaged ({why}); trying the complete checkpoint before it")
    return None


def load_trainer_state(path: Path, engine: Engine, scheduler) -> dict[str, Any]:
    """Restore the engine (weights, optimizer), the schedule and the RNG from a checkpoint; returns the loop's
    state dict. The ZeRO stage and the number of ranks must be those the checkpoint was written with."""
    if not (path / CHECKPOINT_TAG).is_dir():
        raise ConfigError(f"{path} has no {CHECKPOINT_TAG}/ states (written by an older dllm-rl?); start a new run "
                          f"from its model directory with model={path}")
    saved = torch.load(path / "trainer_state.pt", weights_only=True, map_location="cpu")
    if (saved["stage"], saved["world_size"]) != (engine.stage, engine.world.size):
        raise ConfigError(
            f"{path} was written at ZeRO stage {saved['stage']} with {saved['world_size']} rank(s); this run has "
            f"stage {engine.stage} with {engine.world.size}. Resume with the same deepspeed stage and ranks, or "
            f"`dllm-rl export checkpoint={path} output_dir=...` and start a new run from the exported model")
    engine.load_checkpoint(path)
    scheduler.load_state_dict(saved["scheduler"])
    own = path / f"rng_rank{engine.world.rank}.pt"
    if own.is_file():
        set_rng_state(torch.load(own, weights_only=True, map_location="cpu"))
    else:  # written before every rank saved its own: rank 0's CPU state
        torch.set_rng_state(saved["torch_rng"])
    return saved["state"]


def rng_state() -> dict[str, Any]:
    """This process's global random state: the CPU generator's and every visible GPU's. Only what draws from the
    global state needs it (dropout, e.g. LoRA's); every other draw of a run comes from seeded generators."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
