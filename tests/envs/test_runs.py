"""Multi-turn runs through the trainer (env=..., dllm_rl/envs/collect.py): the step's stage list on turn rows with
each credit, held-out success, a run SIGKILLed mid-step and resumed equal to the uninterrupted one, SFT on solver
episodes, evaluation, the tasks command, and what is refused by name."""

import json

import pytest

from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from dllm_rl.train_config import TrainConfig
from tests.conftest import Counter, DigitPass, weights_checksum

OPTIONS = dict(rollout={"gen_length": 8, "block_length": 8, "steps": 4, "temperature": 1.0, "threshold": None,
                        "random_first": False},
               external={"name": "none"}, likelihood={"name": "mean_field"}, prompts_per_step=2, group_size=3,
               minibatch_size=24, train_pool=8, eval_every=0, sample_every=0, tensorboard=False, bf16=False,
               lr=1e-3, warmup=0, lr_schedule="constant", print_fn=lambda *_: None)
COUNTER = "tests.conftest:Counter"


def metrics_of(run_dir):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("credit", ["grpo", "gigpo", "crbc"])
def test_a_multi_turn_run_trains_on_its_turn_rows(saved_model, tmp_path, credit):
    run = tmp_path / "run"
    train(DigitPass(), model=saved_model, run_dir=str(run), steps=2, env={"name": COUNTER, "credit": credit},
          eval_every=2, eval_prompts=4, **{k: v for k, v in OPTIONS.items() if k != "eval_every"})
    lines = metrics_of(run)
    assert len(lines) == 3 and lines[0]["step"] == 0 and lines[-1]["eval/turns"] >= 1  # before and after
    for m in lines[1:]:
        assert m["env/turns"] >= 1 and 0 <= m["env/success"] <= 1 and 0 <= m["env/invalid"] <= 1
        assert m["rollouts/on_policy"] == pytest.approx(m["env/turns"] * 6)  # one row per turn of 2 x 3 episodes
    assert any(m["policy/updates"] > 0 for m in lines[1:])  # some group had signal, and the policy moved
    assert weights_checksum(run / "checkpoints" / "step_000002") != weights_checksum(saved_model)


def test_what_a_multi_turn_run_cannot_take_yet_is_refused_by_name():
    env = {"name": "corridor"}
    with pytest.raises(ConfigError, match="env=corridor with curation=.*set curation=none"):
        TrainConfig(env=env, external={"name": "none"}, curation={"greso": {}})
    with pytest.raises(ConfigError, match="env=corridor with workers=.*set workers.count=0"):
        TrainConfig(env=env, external={"name": "none"}, workers={"count": 2})
    with pytest.raises(ConfigError, match="env='maze': expected one of corridor"):
        TrainConfig(env={"name": "maze"}, external={"name": "none"})
    with pytest.raises(ConfigError, match="unknown config key 'env.corridor.width'"):
        TrainConfig(env={"name": "corridor", "options": {"width": 3}}, external={"name": "none"})
    assert TrainConfig(env={"name": COUNTER}, external={"name": "none"}).environment().on
    assert Counter.max_turns == 4 and not TrainConfig().environment().on


def test_the_tasks_command_lists_environments_and_plays_the_solver(capsys):
    from dllm_rl import cli

    assert cli.main(["tasks", "env=corridor", "n=1", "check=30", "+env.options.length=6"]) == 0
    out = capsys.readouterr().out
    assert "environments: corridor, frozen_lake, countdown, sudoku, sliding" in out
    assert "the door is at 5" in out and "solver: 1.000 of 31 episodes succeed" in out
    assert cli.main(["tasks", "env=corridor", "env.colour=1"]) != 0
    assert "unknown config key 'env.colour'" in capsys.readouterr().err


def test_sft_data_from_solver_episodes_replays_to_success():
    from dllm_rl.envs.task import EnvConfig, EnvTask, solver_turns

    task = EnvTask(EnvConfig(name="corridor", history=1))
    turns = solver_turns(task, 40, seed=0)
    assert len(turns) == 40 and all(action in ("left", "right", "pick", "open") for _, action in turns)
    # the first episode's turns, replayed from its seed, reach the door; each prompt is the turn's as a run builds it
    env, seed = task.make(), task.examples("train", 1, 0)[0].meta["seed"]
    observation, records = env.reset(seed), []
    for prompt, action in turns:
        assert prompt == f"{env.describe()}\n" + "".join(f"Observation: {o}\nAction: {a}\n" for o, a in records[-1:]) \
            + f"Observation: {observation}\nAction: "
        step = env.step(action)
        records.append((observation, action))
        observation = step.observation
        if step.done:
            break
    assert step.done and step.info["success"]


def test_sft_and_eval_commands_on_an_environment(saved_model, tmp_path, capsys):
    from dllm_rl import cli

    tuned, evaluated = tmp_path / "tuned", tmp_path / "eval"
    assert cli.main(["sft", f"model={saved_model}", f"env.name={COUNTER}", "examples=16", "steps=2", "batch_size=8",
                     "gen_length=8", "tensorboard=false", f"output_dir={tuned}"]) == 0
    assert (tuned / "model.safetensors").is_file()
    assert cli.main(["eval", f"model={tuned}", f"env.name={COUNTER}", "num_prompts=6", "rollout.gen_length=8",
                     "rollout.block_length=8", "rollout.steps=4", f"output_dir={evaluated}"]) == 0
    summary = json.loads((evaluated / "summary.json").read_text())
    assert summary["episodes"] == 6 and 0 <= summary["success"] <= 1 and 1 <= summary["turns"] <= Counter.max_turns
    assert len((evaluated / "episodes.jsonl").read_text().splitlines()) == 6
    assert "counter: success" in capsys.readouterr().out
    assert cli.main(["eval", f"model={tuned}", f"env.name={COUNTER}", "protocol=d1"]) != 0
    assert "use protocol=none" in capsys.readouterr().err


def test_a_multi_turn_run_sigkilled_mid_step_resumes_to_the_uninterrupted_run(saved_model, tmp_path):
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.engine.test_distributed import clean_env

    root = Path(__file__).parents[2]
    options = dict(OPTIONS, env={"name": COUNTER, "credit": "crbc"}, checkpoint_every=1, steps=4, sample_every=1)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(DigitPass(), model=saved_model, run_dir=str(straight), **options)
    code = ("import sys; from dllm_rl.train import train; from tests.conftest import DigitPass; "
            "from tests.envs.test_runs import OPTIONS; "
            f"train(DigitPass(), model={saved_model!r}, run_dir={str(killed)!r}, "
            f"**dict(OPTIONS, env={{'name': {COUNTER!r}, 'credit': 'crbc'}}, checkpoint_every=1, steps=4, "
            "sample_every=1))")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=clean_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (killed / "checkpoints" / "step_000002" / "COMPLETE").exists():  # then it is inside step 3
        assert child.poll() is None, child.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    train(DigitPass(), model=saved_model, resume=str(killed), **options)
    assert metrics_of(killed) == metrics_of(straight)
    assert weights_checksum(killed / "checkpoints" / "step_000004") == \
        weights_checksum(straight / "checkpoints" / "step_000004")
