"""Reading run directories for analysis: what notebooks/evaluate.ipynb and scripts/erils_experiments.py use.

A run directory (written by `dllm-rl train`) holds config.json, metrics.jsonl (one object per step, step 0 =
the evaluation before training), samples.jsonl (sample completions with their source) and held_out.jsonl (each
held-out evaluation's greedy result per prompt). These functions return pandas DataFrames, and the intervals
every comparison is reported with (`mean_se`, `proportion_se`, `paired_difference`); the figures are
`dllm_rl.plots`.
"""

from __future__ import annotations

import json
import math
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
    require((path / "metrics.jsonl").is_file(), f"'{run_dir}' is not a run directory (no metrics.jsonl)")
    config_file = path / "config.json"
    return {
        "name": name or path.name,
        "path": path,
        "config": json.loads(config_file.read_text()) if config_file.is_file() else {},
        # a run resumed after a crash may have logged a step twice: the later line is the one that counts
        "metrics": _jsonl(path / "metrics.jsonl").drop_duplicates("step", keep="last").reset_index(drop=True),
        "samples": _jsonl(path / "samples.jsonl"),
        "held_out": _jsonl(path / "held_out.jsonl").drop_duplicates("step", keep="last").reset_index(drop=True)
        if (path / "held_out.jsonl").is_file() else pd.DataFrame(),
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


def mean_se(values) -> tuple[float, float]:
    """(mean, standard error of the mean) of `values` (sample standard deviation / sqrt(n); 0 for one value)."""
    values = [float(v) for v in values]
    require(len(values) > 0, "mean_se of no values")
    if len(values) == 1:
        return values[0], 0.0
    return statistics.mean(values), statistics.stdev(values) / math.sqrt(len(values))


def proportion_se(correct) -> tuple[float, float]:
    """(p, its binomial standard error sqrt(p (1 - p) / n)) of a list of 0/1 outcomes (one per prompt)."""
    correct = [float(c) for c in correct]
    require(len(correct) > 0, "proportion_se of no outcomes")
    p = sum(correct) / len(correct)
    return p, math.sqrt(p * (1 - p) / len(correct))


def paired_difference(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, int]:
    """(mean of after - before, its standard error, n) over the keys both have: two evaluations of the same
    prompts (uid -> 0/1), or two runs paired by seed. The pairing removes the spread between prompts, so a change
    is measured against how much the prompts themselves changed, not against the spread of the two means."""
    keys = [k for k in before if k in after]
    require(len(keys) > 0, "paired_difference: no prompt (or seed) in common")
    mean, se = mean_se([after[k] - before[k] for k in keys])
    return mean, se, len(keys)


def held_out_correct(run: dict) -> dict[int, dict[str, int]]:
    """step -> {uid: 0/1}: every held-out evaluation's greedy result per prompt (held_out.jsonl)."""
    df = run.get("held_out")
    if df is None or df.empty:
        return {}
    return {int(row.step): dict(zip(row.uid, row.correct)) for row in df.itertuples()}


def held_out_gain(run: dict) -> dict[str, float] | None:
    """Greedy held-out pass@1 before and after the run with their standard errors, and the gain with its
    standard error paired over the prompts (None without two evaluations): {"start", "start_se", "end", "end_se",
    "gain", "gain_se", "prompts", "start_step", "end_step"}."""
    evals = held_out_correct(run)
    if len(evals) < 2:
        return None
    first, last = min(evals), max(evals)
    (start, start_se), (end, end_se) = proportion_se(evals[first].values()), proportion_se(evals[last].values())
    gain, gain_se, n = paired_difference(evals[first], evals[last])
    return {"start": start, "start_se": start_se, "end": end, "end_se": end_se, "gain": gain, "gain_se": gain_se,
            "prompts": n, "start_step": first, "end_step": last}


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
    """One row per run: held-out metrics before and after training (greedy pass@1 with its standard error, and
    its gain with the standard error paired over the prompts where held_out.jsonl has them), mean on-policy
    reward over the first and the last `first_steps` steps with their standard errors over steps."""
    rows = []
    for run in runs:
        evals, reward = eval_table(run), series(run, "reward/on_policy")
        row = {"run": run["name"]}
        if len(evals):
            for key in [k for k in evals.columns if k != "step"]:
                row[f"{key} start"], row[f"{key} end"] = evals[key].iloc[0], evals[key].iloc[-1]
        gain = held_out_gain(run)
        if gain is not None:
            row.update({"pass@1 start s.e.": gain["start_se"], "pass@1 end s.e.": gain["end_se"],
                        "pass@1 gain": gain["gain"], "pass@1 gain s.e. (paired)": gain["gain_se"]})
        if len(reward):
            n = min(first_steps, max(1, len(reward) // 2))
            (row["reward first"], row["reward first s.e."]), (row["reward last"], row["reward last s.e."]) = (
                mean_se(reward.iloc[:n]), mean_se(reward.iloc[-n:]))
        rows.append(row)
    return pd.DataFrame(rows).set_index("run")


def last_samples(run: dict, per_source: int = 3) -> pd.DataFrame:
    """The latest logged sample completions, `per_source` of each source."""
    df = run["samples"]
    if df.empty:
        return df
    last = df[df["step"] == df["step"].max()]
    return last.groupby("source", group_keys=False).head(per_source)[["source", "prompt", "completion", "reward"]]
