"""Reading run directories for analysis: what notebooks/evaluate.ipynb and scripts/erils_experiments.py use.

A run directory (written by `dllm-rl train`) holds config.json, metrics.jsonl (one object per step, step 0 =
the evaluation before training) and samples.jsonl (sample completions with their source). These functions
return pandas DataFrames; the figures are `dllm_rl.plots`.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Iterable

import pandas as pd

from dllm_rl.errors import require

SOURCES = ("on_policy", "external")


def _jsonl(path: Path) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    return pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def load_run(run_dir: str | Path, name: str | None = None) -> dict:
    """{"name", "path", "config", "metrics", "samples"} of one run directory."""
    path = Path(run_dir)
    require((path / "metrics.jsonl").is_file(), f"{run_dir!r} is not a run directory (no metrics.jsonl)")
    config_file = path / "config.json"
    return {
        "name": name or path.name,
        "path": path,
        "config": json.loads(config_file.read_text()) if config_file.is_file() else {},
        # a run resumed after a crash may have logged a step twice: the later line is the one that counts
        "metrics": _jsonl(path / "metrics.jsonl").drop_duplicates("step", keep="last").reset_index(drop=True),
        "samples": _jsonl(path / "samples.jsonl"),
    }


def resolve_run_dir(run_dir: str | Path) -> Path:
    """A run directory given as typed: absolute, or relative to this process's working directory, or to the
    shell's (`$PWD`): a notebook executed by `jupyter nbconvert` runs in the notebook's folder, while the user
    typed the path from where they stand."""
    path = Path(run_dir).expanduser()
    if path.is_absolute():
        return path
    places = [Path.cwd(), *([Path(os.environ["PWD"])] if os.environ.get("PWD") else [])]
    found = next((place / path for place in places if (place / path / "metrics.jsonl").is_file()), None)
    require(found is not None,
            f"run directory {str(run_dir)!r} is not in {' nor in '.join(map(str, dict.fromkeys(places)))}"
            f" (no metrics.jsonl there); give a path relative to where you run the command, or an absolute one")
    return found


def load_runs(run_dirs: Iterable[str | Path]) -> list[dict]:
    """Each run directory (see `resolve_run_dir` for relative paths), loaded; empty entries are skipped."""
    return [load_run(resolve_run_dir(d)) for d in run_dirs if str(d).strip()]


def finished(run_dir: str | Path, steps: int) -> bool:
    """Whether the run directory has logged `steps` steps (what a sweep script skips)."""
    try:
        return int(load_run(run_dir)["metrics"]["step"].max()) >= steps
    except Exception:
        return False


def mean_spread(values: list[float], digits: int = 3) -> str:
    """"mean ± sample std" of `values` for a table ("-" for none, the value alone for one)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def series(run: dict, key: str) -> pd.Series:
    """One metric against step (steps where it was logged)."""
    df = run["metrics"]
    if key not in df:
        return pd.Series(dtype=float)
    return df.set_index("step")[key].dropna()


def reward_by_source(run: dict, window: int = 5) -> pd.DataFrame:
    """Per-step rewards of each source, smoothed by a rolling mean over `window` steps."""
    cols = {s: series(run, f"reward/{s}") for s in SOURCES}
    return pd.DataFrame({s: c.rolling(window, min_periods=1).mean() for s, c in cols.items() if len(c)})


def lengths_by_source(run: dict) -> pd.DataFrame:
    cols = {s: series(run, f"len/{s}") for s in SOURCES}
    return pd.DataFrame({s: c for s, c in cols.items() if len(c)})


def eval_table(run: dict) -> pd.DataFrame:
    """Every held-out evaluation of the run: step, greedy pass@1, and sampled pass@1 / best-of-k if logged."""
    df = run["metrics"]
    keys = [k for k in df.columns if k.startswith("eval/")]
    return df.dropna(subset=keys[:1])[["step", *keys]].reset_index(drop=True) if keys else pd.DataFrame()


def summary(runs: list[dict], first_steps: int = 10) -> pd.DataFrame:
    """One row per run: held-out metrics before and after training, mean on-policy reward over the first and
    the last `first_steps` steps."""
    rows = []
    for run in runs:
        evals, reward = eval_table(run), series(run, "reward/on_policy")
        row = {"run": run["name"]}
        if len(evals):
            for key in [k for k in evals.columns if k != "step"]:
                row[f"{key} start"], row[f"{key} end"] = evals[key].iloc[0], evals[key].iloc[-1]
        if len(reward):
            row["reward first"] = reward.iloc[:first_steps].mean()
            row["reward last"] = reward.iloc[-first_steps:].mean()
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def last_samples(run: dict, per_source: int = 3) -> pd.DataFrame:
    """The latest logged sample completions, `per_source` of each source."""
    df = run["samples"]
    if df.empty:
        return df
    last = df[df["step"] == df["step"].max()]
    return last.groupby("source", group_keys=False).head(per_source)[["source", "prompt", "completion", "reward"]]
