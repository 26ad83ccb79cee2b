"""Learning is a tested property: on-policy GRPO raises the training reward of the embedded dLLM on a memorisable
pool of Sudoku prompts, with every likelihood estimator that can, and ERILS (the default run) by the same margin.

The pool is 8 Sudoku train prompts, every one in every step (8 prompts x 6 rollouts), sampled as the defaults do
(confidence threshold 0.9, one random first commit; docs/learning.md) and scored with d1's Sudoku reward, the
fraction of blanks right (`task.partial_credit=true`): the embedded dLLM solves few whole puzzles (greedy pass@1
0.07), so on 8 prompts the 0/1 reward starts at 0.08 and leaves most groups without signal, where the fraction of
blanks starts at 0.60. The measure is the mean on-policy training reward of the last `WINDOW` steps over the first
step's (the untrained policy's own samples, the same in every run: learning shows from the second step on, so a
first window would hold part of it); each run must raise it by `MARGIN`. What the margin means against noise: with
the learning rate at 0 (1e-12: no update) the same runs move by -0.010 to +0.003, and with the update's sign
flipped the reward falls by 0.05 to 0.54, so every test here fails on both (`python scripts/learning_check.py
--variants normal,lr0,flipped --erils`, docs/learning_check_fp32.json). Precision is the default (`bf16=auto`):
the margin, not the numbers, is pinned; the runs were measured in fp32 (+0.13 to +0.21), and the margin leaves
them about 0.05 or more for what bf16's rounding moves (up to 0.05 on the previous model's runs).

Left out, with its measured reason (docs/learning.md, and configs/likelihood/mean_field.yaml): `mean_field` with
d1's prompt masking (`prompt_mask_prob=0.15`, `LEFT_OUT`): on Sudoku the prompt is the puzzle, and a gradient taken
with a fifth of the givens hidden is nearly orthogonal to the exact one (cosine 0.04 on the previous model,
`scripts/diagnose_learning.py`); here it rises +0.095 in 16 steps, the least of all and too close to the margin to
pin. SPG runs with its prompt clean for the same reason (with its 0.15 perturbation its gradient's cosine is 0.05).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dllm_rl import cli
from dllm_rl.data import build_task
from dllm_rl.train import train

pytestmark = pytest.mark.slow

WINDOW = 5  # steps averaged at the end (against the first step)
MARGIN = 0.08  # the least rise of the training reward a run must show

POOL = dict(train_pool=8, prompts_per_step=8, group_size=6, minibatch_size=48, eval_every=0, checkpoint_every=0,
            sample_every=0, tensorboard=False, seed=0, warmup=0, lr_schedule="constant", external={"name": "none"},
            rollout={"threshold": 0.9, "random_first": True})

# estimator -> (its settings, steps, learning rate); each at a sensible setting of its own, with the steps it needs
# to clear the margin (10-24: the Monte-Carlo ELBOs, noisier, take longer; scripts/learning_check.py prints every
# run's rise, docs/learning.md)
ESTIMATORS = {
    "mean_field": ({"likelihood": {"name": "mean_field"}}, 12, 1e-4),
    "elbo": ({"likelihood": {"name": "elbo", "num_masks": 2, "masking": "fixed_count"}}, 24, 1e-4),
    "coupled": ({"likelihood": {"name": "coupled"}}, 24, 1e-4),
    "espo": ({"likelihood": {"name": "espo"}, "algo": {"kl": "k2", "advantage": "loo"}}, 16, 1e-4),
    "ordered": ({"likelihood": {"name": "ordered", "group": 4}}, 10, 1e-4),
    "left_to_right": ({"likelihood": {"name": "left_to_right", "group": 16}}, 12, 1e-4),
    "spg": ({"likelihood": {"name": "spg"}, "algo": {"objective": "pg"}}, 16, 1e-4),
}
# left out of the tests (see above), run by scripts/learning_check.py to show where it stands
LEFT_OUT = {
    "mean_field_d1": ({"likelihood": {"name": "mean_field", "prompt_mask_prob": 0.15}}, 16, 1e-4),
}
ERILS_ESTIMATOR = "mean_field"  # the estimator of ERILS's test run: the default


def rewards(run_dir) -> list[float]:
    return [row["reward/on_policy"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "reward/on_policy" in row]


def rise(values: list[float]) -> float:
    """The mean of the last `WINDOW` steps over the first step's reward (the untrained policy's own samples)."""
    return sum(values[-WINDOW:]) / WINDOW - values[0]


def defaults() -> dict:
    cfg = cli.to_plain(cli.compose_config("train", []))
    cfg.pop("task")
    return cfg


def run_here(tmp_path, name: str, **options) -> list[float]:
    """One run in this process (scripts/learning_check.py, which starts fresh); its on-policy training rewards."""
    task = build_task("sudoku", partial_credit=True)
    train(task, **{**defaults(), **POOL, "run_dir": str(tmp_path / name), **options}, print_fn=lambda *_: None)
    return rewards(tmp_path / name)


ROOT = Path(__file__).resolve().parents[1]
CHILD = ("import json, pathlib, sys; sys.path.insert(0, sys.argv[1]); from tests.test_learning import run_here; "
         "[run_here(pathlib.Path(sys.argv[2]), name, **options) for name, options in json.loads(sys.argv[3]).items()]")


def runs() -> dict[str, dict]:
    """Every run the tests check, by name: each estimator's, and ERILS's (the default estimator with the solver's
    rows)."""
    out = {name: dict(steps=steps, lr=lr, **settings) for name, (settings, steps, lr) in ESTIMATORS.items()}
    settings, steps, lr = ESTIMATORS[ERILS_ESTIMATOR]
    out["erils"] = dict(steps=steps, lr=lr, **settings, external={"name": "solver"})
    return out


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> dict[str, list[float]]:
    """Every run's on-policy training rewards, the runs one after another in one fresh interpreter: a trajectory of
    many updates amplifies any change of float rounding, and in the whole suite's process what earlier tests left
    behind (a library's global setting) changed one run's rounding from its first update on (the `ordered` run rose
    +0.05 there against +0.146 alone, where it is measured). One interpreter for all of them runs as
    scripts/learning_check.py measures (its runs, too, follow one another in one process), and pays its start-up
    once."""
    root = tmp_path_factory.mktemp("learning")
    subprocess.run([sys.executable, "-c", CHILD, str(ROOT), str(root), json.dumps(runs())], check=True, timeout=2400)
    return {name: rewards(root / name) for name in runs()}


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_on_policy_grpo_raises_the_training_reward(learned, estimator):
    values = learned[estimator]
    assert rise(values) >= MARGIN, f"{estimator}: training reward {values}"


def test_erils_raises_it_too(learned):
    """The default run with the solver's verified rows added (ERILS): its on-policy training reward rises by the
    margin as well."""
    values = learned["erils"]
    assert rise(values) >= MARGIN, f"ERILS: training reward {values}"
