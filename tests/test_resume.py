"""What a resume may change (dllm_rl/resume.py), decided in one place for the CLI and for Python: changes that
alter nothing the remaining steps compute pass, others are refused unless allowed, and whatever a resume
changes lasts, because it rewrites the run's config.json."""

import json

import pytest
import torch

from dllm_rl import cli
from dllm_rl.checkpoint import latest_checkpoint, write_manifest
from dllm_rl.collect import PromptSource
from dllm_rl.errors import ConfigError
from dllm_rl.resume import config_changes, flatten, run_changing, steps_change_nothing
from dllm_rl.train import train
from tests.conftest import DigitShare
from tests.test_train import SMALL


def lines(run, name="metrics.jsonl"):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def test_changes_are_compared_key_by_key_and_steps_is_safe_only_where_the_schedule_ignores_it():
    saved = {"steps": 10, "seed": 0, "rollout": {"name": "rl", "gen_length": 64}, "resume": None, "run_dir": "a"}
    requested = {"steps": 20, "seed": 0, "rollout": {"name": "rl", "gen_length": 32}, "resume": "a", "run_dir": "b",
                 "lr_schedule": "constant"}
    assert flatten(saved)["rollout.gen_length"] == 64
    changes = config_changes(saved, requested)
    assert changes == {"steps": [10, 20], "rollout.gen_length": [64, 32], "lr_schedule": [None, "constant"]}
    assert run_changing(changes, requested) == {"rollout.gen_length": [64, 32], "lr_schedule": [None, "constant"]}
    assert steps_change_nothing(10, 20, {"lr_schedule": "constant", "warmup": 5})
    assert not steps_change_nothing(10, 20, {"lr_schedule": "cosine", "warmup": 5})
    assert steps_change_nothing(10, 10, {"lr_schedule": "cosine", "warmup": 0})


@pytest.fixture
def cli_run(saved_model, tmp_path):
    def start(run, *extra, steps=1):
        base = [f"model={saved_model}", f"run_dir={run}", "task=arithmetic", "prompts_per_step=2", "group_size=2",
                "minibatch_size=4", "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8",
                "eval_every=0", "tensorboard=false", "external=none", f"steps={steps}", *extra]
        assert cli.main(["train", *base]) == 0
        return run
    return start


def test_an_allowed_change_is_applied_and_lasts_and_so_does_a_longer_run(cli_run, tmp_path, capsys):
    changed, plain = cli_run(tmp_path / "changed"), cli_run(tmp_path / "plain")
    assert cli.main(["train", f"resume={changed}", "steps=2", "seed=3", "allow_changes=true"]) == 0
    assert cli.main(["train", f"resume={plain}", "steps=2"]) == 0
    saved = json.loads((changed / "config.json").read_text())
    assert saved["seed"] == 3 and saved["steps"] == 2 and saved["resume"] is None
    (record,) = lines(changed, "changes.jsonl")
    assert record["changes"] == {"seed": [0, 3]} and record["safe"] == {"steps": [1, 2]}
    # the resumed step drew its rollouts from seed 3: not the rows seed 0 gives
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith("perf/")}  # noqa: E731
    assert strip(lines(changed)[0]) == strip(lines(plain)[0])
    texts = lambda run, step: [s["completion"] for s in lines(run, "samples.jsonl") if s["step"] == step]  # noqa: E731
    assert texts(changed, 1) == texts(plain, 1) and texts(changed, 2) != texts(plain, 2)
    # a later plain resume keeps both changes: no refusal of the seed, and 2 steps are already done
    capsys.readouterr()
    assert cli.main(["train", f"resume={changed}"]) == 0
    assert [m["step"] for m in lines(changed)] == [1, 2]
    assert cli.main(["train", f"resume={changed}", "steps=3"]) == 0
    assert [m["step"] for m in lines(changed)] == [1, 2, 3] and len(lines(changed, "changes.jsonl")) == 2


def test_steps_changes_the_run_under_a_cosine_schedule(cli_run, tmp_path, capsys):
    """Under cosine the rate of step s depends on the total: a run resumed before its end with another `steps`
    would train its remaining steps at other rates (step 1 of 2 runs at 0.5 of the peak, of 4 at 0.85)."""
    run = cli_run(tmp_path / "cosine", "lr_schedule=cosine", "warmup=0", steps=2)
    capsys.readouterr()
    assert cli.main(["train", f"resume={run}", "steps=4"]) == 2
    err = capsys.readouterr().err
    assert "resume: steps was 2 in this run; 4 would change the learning rate of every remaining step" in err
    assert cli.main(["train", f"resume={run}", "steps=3", "allow_changes=true"]) == 0


def test_python_resume_is_decided_by_the_same_rule(saved_model, tmp_path):
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, **SMALL)
    assert json.loads((run / "config.json").read_text())["task"] == {"name": "digit_share"}
    with pytest.raises(ConfigError, match="resume: group_size was 4 in this run; 2 would change the run"):
        train(DigitShare(), model=saved_model, resume=str(run), steps=2, **{**SMALL, "group_size": 2})
    with pytest.raises(ConfigError, match="resume: seed was 0 in this run; 5 would change the run"):
        train(DigitShare(), model=saved_model, resume=str(run), steps=2, seed=5, **SMALL)
    assert [m["step"] for m in lines(run)] == [1]  # nothing was run, nothing written
    train(DigitShare(), model=saved_model, resume=str(run), steps=2, **SMALL)  # a longer run is a safe change
    assert json.loads((run / "config.json").read_text())["steps"] == 2
    train(DigitShare(), model=saved_model, resume=str(run), steps=3, seed=5, allow_changes=True, **SMALL)
    assert [m["step"] for m in lines(run)] == [1, 2, 3] and json.loads((run / "config.json").read_text())["seed"] == 5


def test_prompts_trained_ahead_of_the_position_are_passed_over_and_kept_until_reached():
    source = PromptSource(DigitShare(), None, None, per_step=3, pool=8, seed=0, position=2, skip=[0, 3, 5, 20])
    plain = PromptSource(DigitShare(), None, None, per_step=3, pool=8, seed=0, position=2)
    drawn, every = source.draw(3), {d.prompt_id: d for d in plain.draw(6)}
    assert [d.prompt_id for d in drawn] == [2, 4, 6] and source.position == 7
    assert all(d.example_id == every[d.prompt_id].example_id for d in drawn)  # the same stream, less the skipped
    assert source.trained_after() == [20]


def test_a_synchronous_resume_never_draws_what_an_asynchronous_checkpoint_trained_ahead(saved_model, tmp_path):
    """A checkpoint of asynchronous rollouts holds prompt ids beyond its position already trained on
    (`trained_after`, dllm_rl/workers/pipelined.py); resumed with in-process rollouts, the run passes over them and
    its next checkpoint keeps those it has not reached."""
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, **SMALL)
    checkpoint = latest_checkpoint(run)
    saved = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    position = saved["state"]["data_position"]
    saved["state"]["trained_after"] = [position + 1, position + 100]  # as an asynchronous run leaves it
    torch.save(saved, checkpoint / "trainer_state.pt")
    write_manifest(checkpoint)
    train(DigitShare(), model=saved_model, resume=str(run), steps=2, **SMALL)
    state = torch.load(latest_checkpoint(run) / "trainer_state.pt", weights_only=False)["state"]
    assert state["data_position"] == position + SMALL["prompts_per_step"] + 1  # one prompt passed over
    assert state["trained_after"] == [position + 100]
