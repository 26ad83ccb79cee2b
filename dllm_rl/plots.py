"""The evaluation notebook's figures (notebooks/evaluate.ipynb), from the tables of `dllm_rl.analysis`.

Each run keeps one colour and one marker across every figure, each source one line style (on-policy solid,
external dashed), so curves that lie on top of each other stay tellable apart; steps are whole numbers on
every axis; a panel is drawn only when there is something to put in it (no empty best-of-k panel for runs
evaluated greedily only). matplotlib is imported when a figure is made.
"""

from __future__ import annotations

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
    _finish(ax, f"reward (rolling mean of {smooth})")
    return fig


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
    for name, table in tables.items():
        axes[0, 0].plot(table["step"], table["eval/pass@1"], label=name, alpha=0.85, **styles[name])
        for j, key in enumerate(sampled[name]):
            axes[0, 1].plot(table["step"], table[key], label=f"{name} {key[5:]}", alpha=0.85,
                            linestyle=("-", "--", ":", "-.")[j % 4], **styles[name])
    axes[0, 0].set_title("greedy pass@1 (held-out)")
    _finish(axes[0, 0], "accuracy")
    if panels == 2:
        axes[0, 1].set_title("sampled pass@1 and best-of-k (held-out)")
        _finish(axes[0, 1], "accuracy")
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
