"""What a resumed run may change, decided in one place for `dllm-rl train resume=...` and `train(resume=...)`.

A run's config.json is its effective config: written when the run starts, and rewritten (atomically) by every
resume that changes it, so a change made once lasts for every later resume. A resume compares the config it is
given with config.json, key by key (groups flattened to `group.key`):

- a change that alters nothing the remaining steps compute is applied freely: how long the run goes on
  (`steps`, unless the learning-rate schedule depends on it, as `lr_schedule=cosine` does), what it logs and
  evaluates, how often it checkpoints, the collective timeout (`RESUME_SAFE_KEYS`);
- any other change (the model, the group size, the window, a source, the seed, a ZeRO stage, ...) would not
  continue the checkpoint's run: it is refused by name unless `allow_changes` is given; then it is applied, and
  recorded with the time in the run's changes.jsonl;
- a change of the LoRA adapter's shape (`lora.r`, `lora.target_modules`, switching LoRA on or off) cannot be
  applied to a checkpoint that holds the old adapter and its optimizer state: it is refused even with
  `allow_changes`, and the error says how to start a new run from the checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dllm_rl.checkpoint import atomic_write
from dllm_rl.errors import ConfigError, require
from dllm_rl.optim import LR_SCHEDULES, lr_factor

# What a resumed run may change because nothing a step computes reads it (`steps`: see `steps_change_nothing`).
RESUME_SAFE_KEYS = ("steps", "eval_every", "eval_prompts", "eval_samples", "eval_external_samples", "checkpoint_every",
                    "keep_checkpoints", "sample_every", "tensorboard", "max_bad_steps", "deepspeed.timeout_s",
                    "trust_remote_code",
                    "external.trust_remote_code",  # consent, given again by whoever resumes (cli.consent_given)
                    "logger.name", "logger.project", "logger.entity", "logger.run_name", "logger.tags", "logger.mode",
                    # where rollouts are generated: the same rollouts either way (dllm_rl/workers/remote.py)
                    "workers.count", "workers.address", "workers.threads", "workers.cpus", "workers.timeout_s",
                    "workers.object_store_mb", "workers.max_staleness")
# What no resume can change, not even with allow_changes: the shape of the trained adapter, whose weights and
# optimizer state the checkpoint holds (switching LoRA on or off included). A new run from the checkpoint can.
ADAPTER_SHAPE_KEYS = ("lora.r", "lora.target_modules")
NOT_COMPARED = ("resume", "run_dir")
# Paths a run reads, recorded absolute in config.json so that a resume (and eval, export) from another working
# directory finds them
PATH_KEYS = ("model", "external.path", "task.train_file", "task.test_file")  # where the run is, not what it computes
CONFIG = "config.json"


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"rollout": {"steps": 32}} -> {"rollout.steps": 32}; lists and other values are leaves."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(saved: dict[str, Any], requested: dict[str, Any]) -> dict[str, list[Any]]:
    """{key: [saved value, requested value]} for every key whose value differs (a key only one side has counts,
    with None on the other), `resume` and `run_dir` left out."""
    old, new = flatten(saved), flatten(requested)
    keys = [k for k in dict.fromkeys([*old, *new]) if k not in NOT_COMPARED]
    return {k: [old.get(k), new.get(k)] for k in keys if old.get(k) != new.get(k)}


def steps_change_nothing(old_steps: Any, new_steps: Any, config: dict[str, Any]) -> bool:
    """Whether a new `steps` leaves every step's learning rate as it was (the constant schedule ignores the
    total; the cosine one spreads its decay over it)."""
    schedule, warmup = config.get("lr_schedule", "constant"), config.get("warmup", 0)
    if not (isinstance(old_steps, int) and isinstance(new_steps, int) and schedule in LR_SCHEDULES
            and isinstance(warmup, int)):
        return False
    return all(lr_factor(s, old_steps, schedule, warmup) == lr_factor(s, new_steps, schedule, warmup)
               for s in range(min(old_steps, new_steps)))


def pools_change_nothing(key: str, requested: dict[str, Any]) -> bool:
    """Whether a change of `workers.pools` leaves the rollouts as they were: where no pool decodes otherwise than
    the run's rollout sampler, any worker makes the same rollouts, so how many there are and where does not matter."""
    pools = (requested.get("workers") or {}).get("pools") or {}
    alike = all(not (spec or {}).get("sampler") for spec in pools.values() if isinstance(spec, dict))
    return ".sampler" not in key and alike


def run_changing(changes: dict[str, list[Any]], requested: dict[str, Any]) -> dict[str, list[Any]]:
    """The changes that would alter what the remaining steps compute."""
    def safe(key: str, old: Any, new: Any) -> bool:
        if key == "steps":
            return steps_change_nothing(old, new, requested)
        if key.startswith("workers.pools"):
            return pools_change_nothing(key, requested)
        return key in RESUME_SAFE_KEYS
    return {k: v for k, v in changes.items() if not safe(k, *v)}


def with_absolute_paths(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with every `PATH_KEYS` value that names an existing file or directory made absolute."""
    out = json.loads(json.dumps(config, default=str))
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and Path(node[leaf]).expanduser().exists():
            node[leaf] = str(Path(node[leaf]).expanduser().resolve())
    return out


def read_run_config(run_dir: str | Path) -> dict[str, Any] | None:
    """A run directory's config.json, or None where the run has none (it stopped before writing it). `resume`
    given a checkpoint or a file is a named error."""
    run = Path(run_dir)
    if (run / "COMPLETE").is_file() or (run / "deepspeed").is_dir():
        raise ConfigError(f"resume={str(run_dir)!r} is a checkpoint; resume takes its run directory, "
                          f"resume={run.parents[1]} (it continues from the newest intact checkpoint)")
    require(run.is_dir(), f"resume={str(run_dir)!r}: no such run directory")
    file = run / CONFIG
    if not file.is_file():
        return None
    try:
        saved = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"resume={str(run_dir)!r}: {file} is not a run config ({error})") from None
    require(isinstance(saved, dict) and "steps" in saved,
            f"resume={str(run_dir)!r}: {file} is not a config written by dllm-rl train")
    return saved


def decide_resume(run_dir: str | Path, requested: dict[str, Any], allow_changes: bool = False) -> dict[str, Any]:
    """Compare `requested` (the whole config the resumed run will use) with the run's config.json. Returns
    {"changes": all of them, "run_changing": those that need `allow_changes`}; raises a ConfigError naming the
    first run-changing change when it is not allowed."""
    saved = read_run_config(run_dir)
    changes = {} if saved is None else config_changes(saved, requested)
    refuse_adapter_reshape(run_dir, changes, saved or {})
    changing = run_changing(changes, requested)
    if changing and not allow_changes:
        key, (old, new) = next(iter(changing.items()))
        why = (f"would change the learning rate of every remaining step (lr_schedule="
               f"{requested.get('lr_schedule')!r} spreads over the steps)" if key == "steps"
               else "would change the run rather than continue it")
        raise ConfigError(f"resume: {key} was {old!r} in this run; {new!r} {why}. Add allow_changes=true to "
                          f"change {sorted(changing)} anyway (recorded in {Path(run_dir) / 'changes.jsonl'})")
    return {"changes": changes, "run_changing": changing}


def refuse_adapter_reshape(run_dir: str | Path, changes: dict[str, list[Any]], saved: dict[str, Any]) -> None:
    """A named error, before anything loads, for a change of the adapter's shape (`ADAPTER_SHAPE_KEYS`) in a run
    that has or gets an adapter; it says how to start a new run from the checkpoint instead."""
    from dllm_rl.checkpoint import latest_checkpoint

    lora_r = changes.get("lora.r", [flatten(saved).get("lora.r")] * 2)
    if not any(isinstance(r, int) and r > 0 for r in lora_r):
        return
    for key in [k for k in ADAPTER_SHAPE_KEYS if k in changes]:
        old, new = changes[key]
        what = ("switches LoRA off" if key == "lora.r" and not new
                else "switches LoRA on" if key == "lora.r" and not old
                else "changes the adapter's shape")
        checkpoint = latest_checkpoint(run_dir) or Path(run_dir) / "checkpoints" / "step_NNNNNN"
        raise ConfigError(f"resume: {key} was {old!r} in this run; {new!r} {what}, and the checkpoint holds the "
                          f"trained weights and optimizer state of the old one, which no resume can reshape (not even "
                          f"with allow_changes=true). Start a new run from the checkpoint instead: dllm-rl train "
                          f"model={checkpoint} {key}={new} run_dir=<a new directory> (a LoRA checkpoint loads as its "
                          f"base with the adapter merged; lora.r=0 trains all of it, lora.r>0 a fresh adapter on top)")


def write_run_config(run_dir: str | Path, config: dict[str, Any]) -> None:
    """The run's effective config, as config.json (atomically: a kill leaves the old one or the new one)."""
    atomic_write(Path(run_dir) / CONFIG, json.dumps(config, indent=2, default=str) + "\n")


def record_resume(run_dir: str | Path, requested: dict[str, Any], decision: dict[str, Any]) -> None:
    """After a resume that changes the config: config.json rewritten, and the changes appended to
    changes.jsonl (`changes`: those that needed allow_changes; `safe`: the others). Rank 0 only."""
    if not decision["changes"]:
        return
    saved = read_run_config(run_dir) or {}
    write_run_config(run_dir, {**requested, **{k: saved.get(k, requested.get(k)) for k in NOT_COMPARED}})
    safe = {k: v for k, v in decision["changes"].items() if k not in decision["run_changing"]}
    with open(Path(run_dir) / "changes.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%d %H:%M:%S"), "changes": decision["run_changing"],
                            "safe": safe}, default=str) + "\n")
