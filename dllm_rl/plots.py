"""The evaluation notebook's figures (notebooks/evaluate.ipynb), from the tables of `dllm_rl.analysis`.

Each run keeps one colour and one marker across every figure, each source one line style (on-policy solid,
external dashed), so curves that lie on top of each other stay tellable apart; steps are whole numbers on
every axis; a panel is drawn only when there is something to put in it (no empty best-of-k panel for runs
evaluated greedily only). matplotlib is imported when a figure is made.
"""

from __future__ import annotations

import math

from dllm_rl import analysis

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = {"on_policy": "-", "external": "--"}


def _styles(runs: list[dict]) -> dict[str, dict]:
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {run["name"]: {"color": colours[i % len(colours)], "marker": MARKERS[i % len(MARKERS)]}
            for i, run in enumerate(runs)}


def _finish(ax, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _markevery(n: int) -> int:
    return max(1, n // 10)  # about ten markers per curve: enough to tell runs apart, few enough to see the line


def reward_figure(runs: list[dict], smooth: int = 5):
    """Training reward per source against step, smoothed over `smooth` steps."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = _styles(runs)
    for run in runs:
        for source, curve in analysis.reward_by_source(run, smooth).items():
            ax.plot(curve.index, curve.values, label=f"{run['name']} / {source}", alpha=0.85,
                    linestyle=LINESTYLES.get(source, ":"), markevery=_markevery(len(curve)), **styles[run["name"]])
            se = rolling_se(analysis.series(run, f"reward/{source}"), smooth)
            ax.fill_between(curve.index, curve - se, curve + se, color=styles[run["name"]]["color"], alpha=0.12)
    ax.set_ylim(bottom=min(0.0, ax.get_ylim()[0]))
    _finish(ax, f"reward (rolling mean of {smooth}, ± s.e.)")
    return fig


def rolling_se(values, window: int):
    """The standard error of each rolling mean over `window` steps (0 where it holds one value)."""
    return (values.rolling(window, min_periods=2).std() / values.rolling(window, min_periods=1).count() ** 0.5
            ).fillna(0.0)


def pass1_errors(run: dict, table) -> list[float]:
    """The standard error of each held-out greedy pass@1 in `table` (rows of `analysis.eval_table`): binomial,
    over the prompts of that evaluation (held_out.jsonl), or over the config's `eval_prompts` for a run without
    per-prompt records."""
    records, n = analysis.held_out_correct(run), run["config"].get("eval_prompts") or 0
    out = []
    for step, p in zip(table["step"], table["eval/pass@1"]):
        if int(step) in records:
            out.append(analysis.proportion_se(records[int(step)].values())[1])
        else:
            out.append(math.sqrt(p * (1 - p) / n) if n else 0.0)
    return out


def _pass1_axis(ax, tops: list[float]) -> None:
    """From 0, so that a change reads against the whole scale and not against a zoomed window of noise."""
    ax.set_ylim(0.0, min(1.0, max(tops, default=0.0) * 1.15 + 0.02))


def eval_figure(runs: list[dict]):
    """Held-out greedy pass@1, and beside it sampled pass@1 and best-of-k where any run logged them; None when
    no run was evaluated (eval_every=0)."""
    import matplotlib.pyplot as plt

    tables = {run["name"]: analysis.eval_table(run) for run in runs}
    tables = {name: t for name, t in tables.items() if not t.empty}
    if not tables:
        return None
    sampled = {name: [k for k in t.columns if k.startswith("eval/best_of") or k == "eval/sampled_pass@1"]
               for name, t in tables.items()}
    panels = 2 if any(sampled.values()) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    styles = _styles(runs)
    by_name = {run["name"]: run for run in runs}
    tops = []
    for name, table in tables.items():
        errors = pass1_errors(by_name[name], table)
        axes[0, 0].errorbar(table["step"], table["eval/pass@1"], yerr=errors, capsize=3, label=f"{name} (± s.e.)",
                            alpha=0.85, **styles[name])
        tops += [p + e for p, e in zip(table["eval/pass@1"], errors)]
        for j, key in enumerate(sampled[name]):
            axes[0, 1].plot(table["step"], table[key], label=f"{name} {key[5:]}", alpha=0.85,
                            linestyle=("-", "--", ":", "-.")[j % 4], **styles[name])
    axes[0, 0].set_title("greedy pass@1 (held-out)")
    _pass1_axis(axes[0, 0], tops)
    _finish(axes[0, 0], "accuracy")
    if panels == 2:
        axes[0, 1].set_title("sampled pass@1 and best-of-k (held-out)")
        _finish(axes[0, 1], "accuracy")
    return fig


def episode_figure(runs: list[dict], smooth: int = 5):
    """Multi-turn runs (`env=`): the training episodes' success (rolling mean, ± s.e.), turns per episode and share
    of invalid actions against step, solid; the held-out episodes' (one greedy episode per held-out seed) as
    markers joined by dashes. None when no run played an environment; held-out success with its interval is
    `eval_figure`'s greedy pass@1."""
    import matplotlib.pyplot as plt

    runs = [run for run in runs if "env/success" in run["metrics"]]
    if not runs:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    styles = _styles(runs)
    for run in runs:
        table = analysis.eval_table(run)
        for ax, key in zip(axes, ("success", "turns", "invalid")):
            values = analysis.series(run, f"env/{key}")
            curve = values.rolling(smooth, min_periods=1).mean()
            ax.plot(curve.index, curve.values, label=f"{run['name']} training", alpha=0.85,
                    markevery=_markevery(len(curve)), **styles[run["name"]])
            if key == "success":
                se = rolling_se(values, smooth)
                ax.fill_between(curve.index, curve - se, curve + se, color=styles[run["name"]]["color"], alpha=0.12)
            column = "eval/pass@1" if key == "success" else f"eval/{key}"
            if not table.empty and column in table:
                ax.plot(table["step"], table[column], linestyle="--", label=f"{run['name']} held-out", alpha=0.85,
                        **styles[run["name"]])
    for ax, (title, label) in zip(axes, (("success", f"success (rolling mean of {smooth}, ± s.e.)"),
                                         ("turns per episode", "turns"),
                                         ("invalid actions", "share of the turns"))):
        ax.set_title(title)
        _finish(ax, label)
    axes[0].set_ylim(0.0, 1.02)
    axes[2].set_ylim(0.0, 1.02)
    return fig


def length_figure(runs: list[dict]):
    """Mean completion length per source against step (tokens of the dLLM's vocabulary)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = _styles(runs)
    for run in runs:
        for source, curve in analysis.lengths_by_source(run).items():
            ax.plot(curve.index, curve.values, label=f"{run['name']} / {source}", alpha=0.85,
                    linestyle=LINESTYLES.get(source, ":"), markevery=_markevery(len(curve)), **styles[run["name"]])
    _finish(ax, "tokens (dLLM vocabulary)")
    return fig


def compare_figure(runs: list[dict], labels: list[str], window: int = 5):
    """`dllm-rl compare`'s figure: on-policy training reward (rolling mean over `window` steps, ± its standard
    error over those steps) and held-out greedy pass@1 (± its standard error) against step; one colour per arm,
    one line style per seed."""
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    arm_colour = {label: colours[i % len(colours)] for i, label in enumerate(dict.fromkeys(labels))}
    seeds = list(dict.fromkeys(run["config"].get("seed") for run in runs))
    styles = ("-", "--", ":", "-.")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    tops = []
    for run, label in zip(runs, labels):
        seed = run["config"].get("seed")
        style = dict(color=arm_colour[label], linestyle=styles[seeds.index(seed) % len(styles)])
        name = f"{label} / seed {seed}"
        reward = analysis.series(run, "reward/on_policy")
        if len(reward):
            mean, se = reward.rolling(window, min_periods=1).mean(), rolling_se(reward, window)
            left.plot(mean.index, mean.values, label=name, **style)
            left.fill_between(mean.index, mean - se, mean + se, color=style["color"], alpha=0.15)
        table = analysis.eval_table(run)
        if not table.empty:
            errors = pass1_errors(run, table)
            right.errorbar(table["step"], table["eval/pass@1"], yerr=errors, capsize=3, marker="o", label=name,
                           **style)
            tops += [p + e for p, e in zip(table["eval/pass@1"], errors)]
    left.set_title(f"on-policy training reward (rolling mean of {window}, ± s.e.)")
    right.set_title("held-out greedy pass@1 (± s.e.)")
    _pass1_axis(right, tops)
    left.set_ylim(bottom=min(0.0, left.get_ylim()[0]))
    _finish(left, "reward")
    _finish(right, "pass@1")
    return fig
