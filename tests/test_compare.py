"""`dllm-rl compare`: runs grouped into arms by their configs, held-out numbers with hand-computed standard errors,
arms paired by seed, a figure, and runs of different tasks refused by name."""

import json

import pytest

from dllm_rl import cli
from dllm_rl.compare import arm_labels, compare
from dllm_rl.errors import ConfigError


def write_run(path, *, seed, external="none", task="sudoku", before=(0, 0, 1, 0), after=(1, 0, 1, 1), rewards=(0.2,) * 4):
    path.mkdir(parents=True)
    config = {"task": {"name": task, "blanks": [8, 12]}, "seed": seed, "run_dir": str(path), "resume": None,
              "lr": 1e-4, "external": {"name": external, "per_prompt": 2 if external != "none" else None}}
    (path / "config.json").write_text(json.dumps(config))
    metrics = [{"step": 0, "eval/pass@1": sum(before) / len(before)}]
    metrics += [{"step": s + 1, "reward/on_policy": r} for s, r in enumerate(rewards)]
    metrics[-1]["eval/pass@1"] = sum(after) / len(after)
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    uids = [f"p{seed}-{i}" for i in range(len(before))]  # each seed evaluates its own prompts
    (path / "held_out.jsonl").write_text(
        json.dumps({"step": 0, "uid": uids, "correct": list(before)}) + "\n"
        + json.dumps({"step": len(rewards), "uid": uids, "correct": list(after)}) + "\n")
    return str(path)


def test_arms_are_what_the_configs_set_differently_seed_aside(tmp_path):
    runs = [{"config": {"seed": s, "run_dir": f"r{s}{e}", "external": {"name": e, "k": 1 if e == "none" else 2},
                        "lr": 1e-4}} for e in ("none", "solver") for s in (0, 1)]
    assert arm_labels(runs) == ["external=none"] * 2 + ["external=solver"] * 2
    assert arm_labels(runs[:2]) == ["all", "all"]
    runs[3]["config"]["lr"] = 3e-4
    assert arm_labels(runs)[3] == "external=solver lr=0.0003"


def test_one_seed_pairs_over_prompts_and_two_seeds_over_seeds(tmp_path, capsys):
    """Baseline arm: 1/4 -> 3/4 at seed 0; the other arm ends at 4/4 (seed 0) and, at seed 1, 2/4 against the
    baseline's 3/4. By hand: one seed, per-prompt differences [0, 1, 0, 0] -> +0.25 ± 0.25 (s.d. 0.5 / 2); two
    seeds, per-seed differences +0.25 and -0.25 -> 0.0 ± 0.25 (s.d. 0.354 / sqrt 2)."""
    base0 = write_run(tmp_path / "base0", seed=0)
    other0 = write_run(tmp_path / "other0", seed=0, external="solver", after=(1, 1, 1, 1), rewards=(0.2, 0.3, 0.5, 0.6))
    out = compare([base0, other0], plot=None, print_fn=lambda *_: None, window=3)
    (diff,) = out["differences"]
    # training reward, paired by step over the last 3: differences 0.1, 0.3, 0.4 -> 0.2667 ± s.d. 0.1528 / sqrt 3
    assert diff["reward_difference"] == pytest.approx(0.8 / 3) and diff["reward_se"] == pytest.approx(0.0882, abs=1e-4)
    assert diff["reward_se_from"] == "one seed, paired over its last 3 steps"
    assert diff["arm"] == "external=solver" and diff["baseline"] == "external=none"
    assert diff["difference"] == pytest.approx(0.25) and diff["se"] == pytest.approx(0.25)
    assert "one seed" in diff["se_from"]
    row = out["runs"][0]
    assert (row["held_out_start"], row["held_out_end"], row["held_out_gain"]) == pytest.approx((0.25, 0.75, 0.5))
    assert row["held_out_gain_se"] == pytest.approx((1 / 3) ** 0.5 / 2)

    base1 = write_run(tmp_path / "base1", seed=1)
    other1 = write_run(tmp_path / "other1", seed=1, external="solver", after=(1, 0, 1, 0), rewards=(0.2,) * 4)
    plot = tmp_path / "figs" / "cmp.png"
    out = compare([base0, base1, other0, other1], plot=str(plot), json=str(tmp_path / "cmp.json"), window=3)
    (diff,) = out["differences"]
    # per seed 0.2667 and 0 -> 0.1333 ± 0.1333 (s.d. 0.1886 / sqrt 2)
    assert (diff["reward_difference"], diff["reward_se"]) == pytest.approx((0.4 / 3, 0.4 / 3))
    assert diff["per_seed"] == pytest.approx({0: 0.25, 1: -0.25})
    assert diff["difference"] == pytest.approx(0.0) and diff["se"] == pytest.approx(0.25)
    assert diff["se_from"] == "over 2 seeds"
    assert plot.is_file() and plot.stat().st_size > 10_000
    assert json.loads((tmp_path / "cmp.json").read_text())["differences"][0]["se"] == pytest.approx(0.25)
    printed = capsys.readouterr().out
    assert ("| external=solver | external=none | +0.000 ± 0.250 | over 2 seeds | 0: +0.250, 1: -0.250 | +0.133 ± 0.133 "
            "| over 2 seeds |") in printed


def test_the_command_takes_runs_as_arguments_and_refuses_mixed_tasks(tmp_path, capsys):
    a = write_run(tmp_path / "a", seed=0)
    b = write_run(tmp_path / "b", seed=0, task="countdown")
    assert cli.main(["compare", a, f"plot={tmp_path / 'x.png'}"]) == 0
    assert "held-out pass@1" in capsys.readouterr().out and (tmp_path / "x.png").is_file()
    assert cli.main(["compare", a, b, "plot=null"]) == 2
    assert f"these differ: {a} (sudoku), {b} (countdown)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="runs=\\[\\]: expected one or more run directories"):
        compare([], plot=None)
    assert cli.main(["compare", str(tmp_path / "nowhere"), "plot=null"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_output_paths_that_are_directories_are_named_before_any_work(tmp_path):
    for key in ("json", "plot"):
        with pytest.raises(ConfigError, match=f"{key}={str(tmp_path)!r} is a directory"):
            compare([str(tmp_path / "no-run")], **{key: str(tmp_path)})
