"""`dllm-rl plan`: the capacity model against an event-by-event simulation of the pipeline, the planner's mix against a
brute-force search, hand-computed periods, and bad inputs named."""

import itertools
import json
import random

import pytest

from dllm_rl import cli
from dllm_rl.errors import ConfigError
from dllm_rl.workers.plan import Pipeline, WorkerKind, makespan, plan, simulate, speeds_of


def test_hand_computed_periods():
    # T = 5, D = 1, B = 48 in groups of 6 (8 groups) on 4 workers of 3 rollouts/s: X = 12, B / X = 4 s, and the
    # batch's makespan is 2 rounds of 2 s = 4 s
    speeds = [3.0] * 4
    assert makespan(speeds, 48, 6) == pytest.approx(4.0)
    assert Pipeline(5.0, 1.0, 48, 0).period(speeds, 6) == pytest.approx(5 + 1 + 4)  # synchronous: the whole chain
    assert Pipeline(5.0, 1.0, 48, 1).period(speeds, 6) == pytest.approx(5.0)  # (5 + 1 + 4) / 2 = 5 = T
    assert Pipeline(5.0, 1.0, 48, 1).utilisation([1.5] * 4, 6) == pytest.approx(5 / 8)  # B / X = 8 s binds
    # a slow worker's group holds the batch up: 8 groups on one 6/s and one 0.5/s worker
    assert makespan([6.0, 0.5], 48, 6) == pytest.approx(12.0)  # the fast one's 7 groups end at 7 s,
                                                               # the slow one's at 12
    assert simulate(Pipeline(5.0, 1.0, 48, 0), speeds, 6) == pytest.approx(5 / 10)


def test_the_capacity_model_matches_the_simulation():
    """Over a grid of inputs: exactly where equal workers split the groups evenly, and within 0.15 utilisation
    (0.05 for nine in ten) with mixed speeds, where a slow worker's last group makes the steps uneven."""
    rng, mixed = random.Random(0), []
    for S, T, D, workers, group in itertools.product((0, 1, 2, 4), (1.0, 5.0), (0.0, 2.0), (1, 2, 4), (4, 8)):
        pipeline = Pipeline(T, D, group * 8, S)
        speeds = [rng.choice([0.5, 2.0, 8.0])] * workers
        assert pipeline.utilisation(speeds, group) == pytest.approx(simulate(pipeline, speeds, group), abs=1e-9)
    for _ in range(150):
        pipeline = Pipeline(rng.uniform(1, 10), rng.uniform(0, 5), rng.choice([4, 8]) * rng.choice([8, 16, 32]),
                            rng.choice([0, 1, 2, 4]))
        group = 4 if pipeline.batch % 8 else rng.choice([4, 8])
        speeds = [rng.choice([0.5, 1.0, 2.0, 5.0, 10.0]) for _ in range(rng.randint(1, 8))]
        mixed.append(abs(pipeline.utilisation(speeds, group) - simulate(pipeline, speeds, group)))
    assert max(mixed) < 0.15
    assert sum(d < 0.05 for d in mixed) >= 0.9 * len(mixed)


def brute_force(pipeline, kinds, target, group):
    best = None
    for mix in itertools.product(*(range(k.max_count + 1) for k in kinds)):
        counts = {k.name: n for k, n in zip(kinds, mix)}
        if pipeline.utilisation(speeds_of(kinds, counts), group) >= target - 1e-12:
            price = sum(n * k.price for n, k in zip(mix, kinds))
            best = price if best is None else min(best, price)
    return best


def test_the_planner_is_never_dearer_than_the_brute_force_cheapest():
    rng, feasible = random.Random(1), 0
    for _ in range(60):
        kinds = [WorkerKind(f"k{i}", rng.choice([0.5, 1.5, 4.0, 12.0]), rng.choice([0.1, 0.4, 1.0, 2.5]),
                            rng.randint(1, 5)) for i in range(rng.randint(1, 3))]
        pipeline = Pipeline(rng.uniform(1, 8), rng.uniform(0, 2), 48, rng.choice([1, 2, 4]))
        target = rng.choice([0.6, 0.8, 0.95])
        cheapest = brute_force(pipeline, kinds, target, 6)
        if cheapest is None:
            with pytest.raises(ConfigError, match="no feasible mix"):
                plan(pipeline, kinds, target, 6)
            continue
        feasible += 1
        result = plan(pipeline, kinds, target, 6)
        assert result.price <= cheapest + 1e-9 and result.utilisation >= target - 1e-12
        assert result.utilisation == pytest.approx(pipeline.utilisation(speeds_of(kinds, result.counts), 6))
    assert feasible >= 20


@pytest.mark.parametrize("make, message", [
    (lambda: WorkerKind("gpu", -3.0, 1.0), r"kinds.gpu.throughput=-3.0: expected a finite number > 0"),
    (lambda: WorkerKind("gpu", 3.0, -1.0), r"kinds.gpu.price=-1.0: expected a finite number >= 0"),
    (lambda: Pipeline(5.0, 0.0, 48, -1), r"max_staleness=-1: expected an integer >= 0"),
    (lambda: Pipeline(0.0, 0.0, 48, 1), r"train_s=0.0: expected seconds > 0"),
    (lambda: Pipeline(5.0, -1.0, 48, 1), r"publish_s=-1.0"),
    (lambda: plan(Pipeline(5.0, 1.0, 48, 0), [WorkerKind("cpu", 1.0, 1.0)], 0.95, 6),
     r"no feasible mix: with max_staleness=0.*at most 0.833"),
    (lambda: plan(Pipeline(5.0, 0.0, 48, 1), [WorkerKind("cpu", 1.0, 1.0, max_count=2)], 0.9, 6),
     r"no feasible mix: every worker of every kind together keeps the learner at 0.208"),
    (lambda: plan(Pipeline(5.0, 0.0, 48, 1), [WorkerKind("cpu", 1.0, 1.0)], 1.5, 6), r"target_utilisation=1.5"),
    (lambda: plan(Pipeline(5.0, 0.0, 48, 1), [WorkerKind("cpu", 1.0, 1.0)], 0.9, 5), r"group_size=5"),
])
def test_bad_inputs_are_named(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_the_plan_command(tmp_path, capsys):
    out = tmp_path / "plan.json"
    kinds = ("kinds={cpu: {throughput: 1.5, price: 0.1, max_count: 32}, "
             "h100: {throughput: 40, price: 2.5, max_count: 4}}")
    assert cli.main(["plan", "train_s=5", "publish_s=0.5", "max_staleness=2", "target_utilisation=0.9", kinds,
                     f"json={out}"]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["counts"] == {"cpu": 6, "h100": 0} and "| cpu | 6 |" in printed
    assert saved["utilisation"] == pytest.approx(5 / (48 / 9)) and saved["simulated"] == pytest.approx(0.94, abs=0.01)
    assert cli.main(["plan", "train_s=5"]) == 2
    assert "kinds: expected at least one worker kind" in capsys.readouterr().err
    # a directory for json= is named before anything is printed (no traceback after the plan)
    assert cli.main(["plan", "train_s=5", kinds, f"json={tmp_path}"]) == 2
    printed = capsys.readouterr()
    assert f"json={str(tmp_path)!r} is a directory: expected a file path" in printed.err and not printed.out
    assert cli.main(["plan", "--help"]) == 0
    helped = capsys.readouterr().out
    keys = [line.split(":")[0] for line in (cli.config_dir() / "plan.yaml").read_text().splitlines()
            if line and not line.startswith("#")]
    assert len(keys) >= 12 and all(f"  {key}=" in helped for key in keys)
