"""`dllm-rl compare <run> <run> ...`: runs of one task side by side, with their intervals, and a plot.

Runs are grouped into arms by what their configs set differently (the seed, the run directory and `resume`
aside): `external=none` against `external=solver`, say. Two tables:

- per run: training reward over its first and last `window` steps (each mean ± its standard error over steps),
  greedy held-out pass@1 at the first and the last evaluation (± the binomial standard error) and the gain
  between them, with its standard error paired over the prompts (held_out.jsonl);
- per arm against the first run's arm (the baseline): the difference of the final held-out pass@1, paired by
  seed (runs of one seed evaluate the same held-out prompts). Over two or more seeds the standard error is the
  spread of the per-seed differences over sqrt(seeds); with one seed, the per-prompt paired standard error of
  that seed's runs (which says nothing about the seed-to-seed spread: the table says which it is). Beside it,
  the training reward of the last `window` steps, arm minus baseline, paired by seed and step (runs of one seed
  train on the same prompts at each step): against a baseline run at `lr` near 0, what training changed on the
  very prompts it trained on, with the prompts' own difficulty paired away.

The figure has the training reward (rolling mean, ± its standard error) and held-out pass@1 (± its standard
error) against step, one colour per arm and one line style per seed.
"""

from __future__ import annotations

from json import dumps
from typing import Any

from dllm_rl import analysis
from dllm_rl.errors import ConfigError, output_file, require

IGNORED = ("seed", "run_dir", "resume")  # what may differ between runs of one arm


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def arm_labels(runs: list[dict]) -> list[str]:
    """Each run's arm: the config values in which the runs differ (seed, run_dir and resume aside), as
    key=value; "all" when they differ in nothing else. A whole group that differs is named by its `name`."""
    flat = [flatten(run["config"]) for run in runs]
    keys = sorted({k for f in flat for k in f} - set(IGNORED))
    differing = [k for k in keys if len({dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    # a group that changed as a whole (likelihood=ordered) is said by its name, not by each of its keys
    named = {k.rpartition(".")[0] for k in differing if k.endswith(".name")}
    shown = [k for k in differing if k.endswith(".name") or k.rpartition(".")[0] not in named]
    shown = [k for k in shown if not any(k.startswith(f"{g}.") and not k.endswith(".name") for g in named)]
    labels = []
    for f in flat:
        parts = [f"{k[:-5] if k.endswith('.name') else k}={f.get(k)}" for k in shown]
        labels.append(" ".join(parts) or "all")
    return labels


def run_row(run: dict, window: int) -> dict[str, Any]:
    """One run's numbers: its training reward early and late, its held-out pass@1 at start and end and the gain."""
    reward = analysis.series(run, "reward/on_policy")
    row: dict[str, Any] = {"run": str(run["path"]), "seed": run["config"].get("seed"),
                           "steps": int(run["metrics"]["step"].max()) if len(run["metrics"]) else 0}
    if len(reward) >= 2:
        n = min(window, len(reward) // 2)
        (row["reward_first"], row["reward_first_se"]), (row["reward_last"], row["reward_last_se"]) = (
            analysis.mean_se(reward.iloc[:n]), analysis.mean_se(reward.iloc[-n:]))
        row["reward_window"] = n
    gain = analysis.held_out_gain(run)
    if gain is not None:
        row.update({f"held_out_{k}": v for k, v in gain.items()})
    return row


def reward_difference(runs: dict[Any, dict], base_runs: dict[Any, dict], window: int) -> dict[str, Any] | None:
    """The on-policy training reward of the last `window` steps, arm minus baseline, paired by seed and step (runs
    of one seed draw the same prompts at each step, curation aside): over two or more seeds, the spread of the
    per-seed means; with one seed, the spread over its steps."""
    per_seed, steps = {}, {}
    for seed in [s for s in runs if s in base_runs]:
        a, b = (analysis.series(r, "reward/on_policy") for r in (runs[seed], base_runs[seed]))
        both = sorted(set(a.index) & set(b.index))[-window:]
        if both:
            steps[seed] = [float(a[s] - b[s]) for s in both]
            per_seed[seed] = sum(steps[seed]) / len(steps[seed])
    if not per_seed:
        return None
    if len(per_seed) >= 2:
        diff, se = analysis.mean_se(list(per_seed.values()))
        return {"reward_difference": diff, "reward_se": se, "reward_se_from": f"over {len(per_seed)} seeds"}
    (seed, values), = steps.items()
    diff, se = analysis.mean_se(values)
    return {"reward_difference": diff, "reward_se": se, "reward_se_from": f"one seed, paired over its last "
                                                                          f"{len(values)} steps"}


def arm_differences(runs: list[dict], labels: list[str], window: int = 10) -> list[dict[str, Any]]:
    """Each arm against the baseline arm (the first run's), paired by seed: the final held-out pass@1 and the
    training reward of the last `window` steps."""
    finals: dict[str, dict[Any, tuple[float, dict[str, int]]]] = {}
    by_arm: dict[str, dict[Any, dict]] = {}
    for run, label in zip(runs, labels):
        by_arm.setdefault(label, {})[run["config"].get("seed")] = run
        evals = analysis.held_out_correct(run)
        if evals:
            last = evals[max(evals)]
            finals.setdefault(label, {})[run["config"].get("seed")] = (sum(last.values()) / len(last), last)
    base = labels[0]
    out = []
    for label in [lb for lb in dict.fromkeys(labels) if lb != base]:
        row: dict[str, Any] = {"arm": label, "baseline": base, "seeds": [s for s in by_arm[label] if s in by_arm[base]]}
        if not row["seeds"]:
            out.append({**row, "note": "no seed in common with the baseline"})
            continue
        row.update(reward_difference(by_arm[label], by_arm[base], window) or {})
        seeds = [s for s in finals.get(label, {}) if s in finals.get(base, {})]
        if seeds:
            per_seed = {s: finals[label][s][0] - finals[base][s][0] for s in seeds}
            if len(seeds) >= 2:
                diff, se = analysis.mean_se(list(per_seed.values()))
                how = f"over {len(seeds)} seeds"
            else:
                diff, se, n = analysis.paired_difference(finals[base][seeds[0]][1], finals[label][seeds[0]][1])
                how = f"one seed, paired over its {n} prompts"
            row.update({"per_seed": per_seed, "difference": diff, "se": se, "se_from": how})
        out.append(row)
    return out


def fmt(row: dict, key: str, signed: bool = False) -> str:
    if key not in row:
        return "-"
    value = f"{row[key]:+.3f}" if signed else f"{row[key]:.3f}"
    return f"{value} ± {row[key + '_se']:.3f}"


def tables(rows: list[dict], labels: list[str], differences: list[dict]) -> str:
    """The two tables as text."""
    lines = ["| run | arm | seed | steps | training reward first -> last | held-out pass@1 start | end | gain |",
             "|---|---|---|---|---|---|---|---|"]
    for row, label in zip(rows, labels):
        reward = (f"{fmt(row, 'reward_first')} -> {fmt(row, 'reward_last')}" if "reward_first" in row else "-")
        lines.append(f"| {row['run']} | {label} | {row['seed']} | {row['steps']} | {reward} | "
                     f"{fmt(row, 'held_out_start')} | {fmt(row, 'held_out_end')} | "
                     f"{fmt(row, 'held_out_gain', signed=True)} |")
    if not any("held_out_gain" in row for row in rows):
        lines.append("(no run has two held-out evaluations: eval_every=0, or a run from before held_out.jsonl)")
    if differences:
        lines += ["", "| arm | against | final held-out pass@1 difference | s.e. from | per seed | training reward "
                  "difference, last steps | s.e. from |", "|---|---|---|---|---|---|---|"]
        for d in differences:
            if not d["seeds"]:
                lines.append(f"| {d['arm']} | {d['baseline']} | - | {d['note']} | | - | |")
                continue
            held_out = (f"{d['difference']:+.3f} ± {d['se']:.3f} | {d['se_from']} | "
                        + ", ".join(f"{s}: {v:+.3f}" for s, v in d["per_seed"].items()) if "difference" in d
                        else "- | no held-out evaluations in common |")
            reward = (f"{d['reward_difference']:+.3f} ± {d['reward_se']:.3f} | {d['reward_se_from']}"
                      if "reward_difference" in d else "- |")
            lines.append(f"| {d['arm']} | {d['baseline']} | {held_out} | {reward} |")
    return "\n".join(lines)


def compare(runs: list[str], plot: str | None = "compare.png", json: str | None = None, window: int = 10,
            print_fn=print) -> dict[str, Any]:
    """Compare the run directories `runs` (see the module docstring); returns the tables as data."""
    require(isinstance(runs, list) and len(runs) >= 1 and all(isinstance(r, str) and r for r in runs),
            f"runs={runs!r}: expected one or more run directories (dllm-rl compare runs/a runs/b ...)")
    require(isinstance(window, int) and window >= 1, f"window={window!r}: expected a whole number of steps >= 1")
    files = {key: output_file(value, key) for key, value in (("json", json), ("plot", plot)) if value}  # before work
    loaded = analysis.load_runs(runs)
    tasks = {str(run["path"]): run["config"].get("task", {}).get("name") for run in loaded}
    if len(set(tasks.values())) > 1:
        raise ConfigError("compare takes runs of one task; these differ: "
                          + ", ".join(f"{path} ({task})" for path, task in tasks.items()))
    labels = arm_labels(loaded)
    rows = [run_row(run, window) for run in loaded]
    differences = arm_differences(loaded, labels, window)
    print_fn(tables(rows, labels, differences))
    out = {"runs": [{**row, "arm": label} for row, label in zip(rows, labels)], "differences": differences}
    if plot:
        from dllm_rl.plots import compare_figure

        compare_figure(loaded, labels, window=min(5, window)).savefig(files["plot"], dpi=120, bbox_inches="tight")
        print_fn(f"figure: {plot}")
    if json:
        files["json"].write_text(dumps(out, indent=2, default=str) + "\n")
        print_fn(f"tables: {json}")
    return out
