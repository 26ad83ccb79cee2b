import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl import cli, learner
from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.data import build_task
from dllm_rl.errors import ConfigError
from dllm_rl.rollout.sampler import completion_mask
from dllm_rl.train import train
from tests.conftest import DigitShare

# a fixed sampler and learning rate: what these tests compare is the loop's bookkeeping, not the defaults that learn
SMALL = dict(
    rollout={"gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0, "threshold": None,
             "random_first": False},
    lr_schedule="constant",
    likelihood={"name": "mean_field"},
    algo={"advantage": "mean", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.0},
    prompts_per_step=2, group_size=4, minibatch_size=8, eval_every=0, sample_every=1, tensorboard=False,
    lr=1e-3, warmup=0, external={"name": "none"}, print_fn=lambda *_: None,
)


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def test_completion_mask_counts_up_to_the_first_eos():
    completion = torch.tensor([[5, 6, 2, 2, 2], [5, 6, 7, 8, 9], [2, 2, 2, 2, 2]])
    assert completion_mask(completion, eos_id=2).tolist() == [[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]]


@pytest.mark.parametrize("likelihood, inner", [({"name": "mean_field"}, 1), ({"name": "elbo", "num_masks": 2}, 2),
                                               ({"name": "ordered", "group": 4}, 1)])
def test_end_to_end_parameters_change_and_metrics_are_finite(saved_model, tmp_path, likelihood, inner):
    run = tmp_path / "run"
    metrics = train(DigitShare(), model=saved_model, run_dir=str(run), steps=2, inner_iterations=inner,
                    **{**SMALL, "likelihood": likelihood, "algo": {**SMALL["algo"], "beta": 0.04}})
    before, after = weights(saved_model), weights(latest_checkpoint(run))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert metrics["policy/updates"] == inner
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2]
    for line in lines:
        assert all(v == v and abs(v) != float("inf") for v in line.values() if isinstance(v, float))
        assert 0.0 < line["reward/on_policy"] < 1.0 and "loss/kl" in line and "policy/clip_frac" in line
    assert (run / "samples.jsonl").read_text().count("\n") == 2 * 2  # one sample per prompt and step
    # A checkpoint is a model directory the evaluator loads.
    assert cli.main(["eval", f"model={latest_checkpoint(run)}", "num_prompts=2", "rollout.gen_length=16",
                     "rollout.block_length=8", "rollout.steps=8", f"output_dir={tmp_path / 'eval'}"]) == 0


def test_four_steps_equal_two_plus_resume_plus_two(saved_model, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(DigitShare(), model=saved_model, run_dir=str(straight), steps=4, checkpoint_every=2, **SMALL)
    train(DigitShare(), model=saved_model, run_dir=str(split), steps=2, checkpoint_every=2, **SMALL)
    train(DigitShare(), model=saved_model, resume=str(split), steps=4, checkpoint_every=2, **SMALL)
    a, b = weights(latest_checkpoint(straight)), weights(latest_checkpoint(split))
    assert all(torch.equal(a[k], b[k]) for k in a)  # bitwise
    rewards = [[json.loads(l)["reward/on_policy"] for l in (run / "metrics.jsonl").read_text().splitlines()]
               for run in (straight, split)]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 4
    ta = torch.load(latest_checkpoint(straight) / "trainer_state.pt", weights_only=False)
    tb = torch.load(latest_checkpoint(split) / "trainer_state.pt", weights_only=False)
    assert ta["state"] == tb["state"] and ta["state"]["step"] == 4
    oa, ob = (torch.load(latest_checkpoint(run) / "deepspeed" / "mp_rank_00_model_states.pt",
                         weights_only=False)["optimizer"]["state"] for run in (straight, split))
    assert oa and all(torch.equal(v, ob[p][k]) for p in oa for k, v in oa[p].items() if torch.is_tensor(v))


@pytest.mark.slow
def test_resume_is_exact_with_external_rollouts(saved_model, tmp_path):
    """ERILS state (the running baseline) and the external rows survive a resume bit for bit."""
    task = build_task("arithmetic")
    options = {**SMALL, "rollout": {"gen_length": 32, "block_length": 16, "steps": 16, "temperature": 1.0},
               "external": {"name": "solver"}, "mixing": {"per_prompt": 1, "statistic": "running", "keep": "all",
                                                          "correction": "is"}}
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(task, model=saved_model, run_dir=str(straight), steps=4, checkpoint_every=2, **options)
    train(task, model=saved_model, run_dir=str(split), steps=2, checkpoint_every=2, **options)
    train(task, model=saved_model, resume=str(split), steps=4, checkpoint_every=2, **options)
    a, b = weights(latest_checkpoint(straight)), weights(latest_checkpoint(split))
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [[json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] for run in (straight, split)]
    assert lines[0] == [dict(l, **{k: v for k, v in l0.items() if k.startswith("perf/")}) for l, l0 in
                        zip(lines[1], lines[0])]
    assert all(l["external/rows"] == 2 and l["policy/updates"] == 1 for l in lines[0])
    state = torch.load(latest_checkpoint(split) / "trainer_state.pt", weights_only=False)["state"]
    assert state["external_baseline"] == pytest.approx(1 - 0.9**4)  # an EMA of four steps of reward 1 from 0


CRASH = """
import os, signal, sys
import torch
import dllm_rl.checkpoint as ckpt
from dllm_rl.data import build_task
from dllm_rl.train import train
real_save = torch.save
def dying_save(obj, path, *a, **k):
    if isinstance(obj, dict) and "torch_rng" in obj and obj["state"]["step"] == 4:  # the second checkpoint: write half a file, then die
        open(path, "wb").write(b"partial")
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, path, *a, **k)
ckpt.torch.save = dying_save
train(build_task("arithmetic"), model=sys.argv[1], run_dir=sys.argv[2], steps=6, checkpoint_every=2,
      rollout={"gen_length": 16, "block_length": 8, "steps": 8}, likelihood={"name": "mean_field"}, algo={},
      prompts_per_step=2, group_size=2, minibatch_size=4, eval_every=0, tensorboard=False)
"""


@pytest.mark.slow
def test_killed_during_a_checkpoint_write_resumes_from_the_last_complete_one(saved_model, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-c", CRASH, saved_model, str(run)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
    assert latest_checkpoint(run).name == "step_000002"  # the half-written step 4 is ignored
    assert any(p.name.startswith(".tmp_step_000004") for p in (run / "checkpoints").iterdir())
    train(build_task("arithmetic"), model=saved_model, resume=str(run), steps=6, checkpoint_every=2,
          rollout={"gen_length": 16, "block_length": 8, "steps": 8}, likelihood={"name": "mean_field"}, algo={},
          prompts_per_step=2, group_size=2, minibatch_size=4, eval_every=0, tensorboard=False,
          print_fn=lambda *_: None)
    assert latest_checkpoint(run).name == "step_000006"
    steps = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 3-4 ran again after the crash, and were logged once


def test_resume_cuts_the_logs_back_to_the_checkpoint_and_repairs_a_partial_line(saved_model, tmp_path):
    """Steps logged after the last checkpoint are logged again by the resumed run, and a kill in the middle of a
    write leaves half a line: both are cut before the resumed run appends, so each step appears once."""
    from dllm_rl.analysis import load_run

    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=2, checkpoint_every=2, **SMALL)
    with open(run / "metrics.jsonl", "a") as f:  # step 3 logged, then killed while logging step 4
        f.write(json.dumps({"step": 3, "reward/on_policy": 0.5}) + "\n" + '{"step": 4, "reward/on_pol')
    with open(run / "samples.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "completion": "x"}) + "\n" + '{"step": 4, "compl')
    train(DigitShare(), model=saved_model, resume=str(run), steps=3, checkpoint_every=2, **SMALL)
    logged = load_run(run)
    assert logged["metrics"]["step"].tolist() == [1, 2, 3] and logged["metrics"]["reward/on_policy"][2] != 0.5
    assert sorted(set(logged["samples"]["step"])) == [1, 2, 3] and "x" not in set(logged["samples"]["completion"])
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]  # no duplicate left for readers to drop


def test_a_window_beyond_the_models_context_is_refused_inside_the_trainer(saved_model, tmp_path, capsys):
    """The policy is a DeepSpeed engine inside the trainer; its context is still read from the network."""
    assert cli.main(["train", f"model={saved_model}", f"run_dir={tmp_path / 'run'}", "external=none", "steps=1",
                     "rollout.gen_length=128", "rollout.block_length=128", "rollout.steps=2", "eval_every=0"]) == 2
    assert "exceeds the model's context of 128" in capsys.readouterr().err


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_after_the_current_step(saved_model, tmp_path):
    """SIGINT ends the step under way, writes its checkpoint (none was due: checkpoint_every=100), then the run
    stops with one line that says so and status 130."""
    import time

    run = tmp_path / "run"
    args = [sys.executable, "-m", "dllm_rl.cli", "train", f"model={saved_model}", f"run_dir={run}", "steps=500",
            "checkpoint_every=100", "eval_every=0", "external=none", "prompts_per_step=2", "group_size=2",
            "minibatch_size=4", "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8",
            "tensorboard=false"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    metrics = run / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    (line,) = [l for l in err.splitlines() if l.startswith("stopped: ")]
    done = int(line.split("after step ")[1].split()[0])
    assert line == (f"stopped: interrupted after step {done} of 500; the checkpoint of step {done} is written: "
                    f"continue with resume={run}")
    steps = [json.loads(l)["step"] for l in metrics.read_text().splitlines()]
    assert steps == list(range(1, done + 1)) and latest_checkpoint(run).name == f"step_{done:06d}"


def test_an_interrupt_without_checkpoints_says_the_run_cannot_be_resumed(saved_model, tmp_path, monkeypatch):
    """With checkpoint_every=0 nothing is written on Ctrl-C, and the message does not promise a resume."""
    from dllm_rl import train as train_module
    from dllm_rl.errors import Interrupted

    class Pressed(train_module.StopRequest):
        def __init__(self):
            super().__init__()
            self.requested = True  # Ctrl-C during the first step

    monkeypatch.setattr(train_module, "StopRequest", Pressed)
    run = tmp_path / "run"
    with pytest.raises(Interrupted, match="interrupted after step 1 of 3; checkpoint_every=0 keeps no checkpoint, "
                                          "so the run cannot be resumed"):
        train(build_task("arithmetic"), model=saved_model, run_dir=str(run), steps=3,
              **{**SMALL, "checkpoint_every": 0})
    assert latest_checkpoint(run) is None


def test_zero_variance_steps_complete_without_an_update(saved_model, tmp_path):
    # An untrained model never answers arithmetic correctly: every group's rewards are all 0.
    metrics = train(build_task("arithmetic"), model=saved_model, run_dir=str(tmp_path / "run"), steps=2, **SMALL)
    assert metrics["reward/zero_std_groups"] == 1.0 and metrics["policy/updates"] == 0.0
    before, after = weights(saved_model), weights(latest_checkpoint(tmp_path / "run"))
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_non_finite_losses_skip_updates_then_stop(saved_model, tmp_path, monkeypatch):
    real = learner.grpo_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(learner, "grpo_loss", nan_loss)
    with pytest.warns(UserWarning, match="non-finite loss or gradient; update skipped"):
        with pytest.raises(RuntimeError, match="stopping: 2 non-finite updates in a row"):
            train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "run"), steps=4, max_bad_steps=2, **SMALL)


@pytest.mark.parametrize(
    "override, message",
    [
        ("group_size=-1", "group_size must be >= 2"),
        ("algo.eps_low=0", "algo.eps_low must be > 0, got 0"),
        ("likelihood.name=elbow", "likelihood.name must be one of"),
        ("algo.advantage=median", "unknown algo.advantage 'median'"),
        ("+likelihood.num_maks=3", "unknown config key 'likelihood.num_maks'"),
        ("lr_schedule=linear", "lr_schedule must be 'constant' or 'cosine', got 'linear'"),
    ],
)
def test_bad_train_config_fails_at_start(saved_model, tmp_path, override, message, capsys):
    assert cli.main(["train", f"model={saved_model}", f"run_dir={tmp_path / 'run'}", override]) == 2
    assert message in capsys.readouterr().err


def test_resume_through_the_cli_reuses_the_saved_config(saved_model, tmp_path, capsys):
    run = tmp_path / "run"
    base = [f"model={saved_model}", f"run_dir={run}", "task=arithmetic", "prompts_per_step=2", "group_size=2",
            "minibatch_size=4", "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8", "eval_every=0",
            "tensorboard=false"]
    assert cli.main(["train", *base, "steps=1"]) == 0
    assert cli.main(["train", f"resume={run}", "steps=2"]) == 0
    assert latest_checkpoint(run).name == "step_000002"
    assert cli.main(["train", f"resume={run}", "task=sudoku"]) == 2
    assert "only key=value overrides" in capsys.readouterr().err
    assert cli.main(["train", f"resume={tmp_path / 'nothing'}"]) == 2


@pytest.mark.parametrize("overrides, message", [
    (["deepspeed=zero2"], "a config group cannot change in a run"), (["external=none"], "a config group cannot change"),
    (["group_size=4"], "resume: group_size was 2 in this run; 4 would change the run"),
    (["model=elsewhere"], "resume: model was"), (["rollout.gen_length=32"], "resume: rollout.gen_length was 16"),
    (["deepspeed.stage=2"], "resume: deepspeed.stage was 0"), (["seed=3"], "resume: seed was 0"),
])
def test_resume_refuses_what_would_change_the_run_unless_asked(saved_model, tmp_path, capsys, overrides, message):
    run = tmp_path / "run"
    base = [f"model={saved_model}", f"run_dir={run}", "task=arithmetic", "prompts_per_step=2", "group_size=2",
            "minibatch_size=4", "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8", "eval_every=0",
            "tensorboard=false", "external=none", "steps=1"]
    assert cli.main(["train", *base]) == 0
    capsys.readouterr()
    assert cli.main(["train", f"resume={run}", "steps=2", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert cli.main(["train", f"resume={run / 'checkpoints' / 'step_000001'}"]) == 2
    assert f"resume takes its run directory, resume={run}" in capsys.readouterr().err
    if overrides == ["seed=3"]:  # asked for: applied, and recorded
        assert cli.main(["train", f"resume={run}", "steps=2", "seed=3", "allow_changes=true"]) == 0
        (line,) = [json.loads(l) for l in (run / "changes.jsonl").read_text().splitlines()]
        assert line["changes"] == {"seed": [0, 3]}


def test_a_new_run_never_appends_to_an_old_one(saved_model, tmp_path):
    """A fresh run into a directory that holds a run is refused (its logs would interleave); `resume` of a run
    that stopped before its first checkpoint starts it again with clean logs."""
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, checkpoint_every=0, **SMALL)
    with pytest.raises(ConfigError, match=f"run_dir='{run}' holds a run already.*resume={run}"):
        train(DigitShare(), model=saved_model, run_dir=str(run), steps=1, checkpoint_every=0, **SMALL)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    train(DigitShare(), model=saved_model, resume=str(run), steps=2, checkpoint_every=0, **SMALL)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("steps, reward_line", [
    (1, "on-policy training reward: 0.100 (1 step)"),
    (3, "on-policy training reward: 0.100 (first step) -> 0.300 (last step)"),
    (7, "on-policy training reward: 0.200 ± 0.058 (first 3 steps) -> 0.600 ± 0.058 (last 3 steps)"),
    (30, "on-policy training reward: 0.550 ± 0.096 (first 10 steps) -> 2.550 ± 0.096 (last 10 steps)"),
])
def test_the_summary_compares_steps_that_do_not_overlap(tmp_path, steps, reward_line):
    from dllm_rl.train import run_summary

    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "reward/on_policy": s / 10}) + "\n" for s in range(1, steps + 1)))
    text = run_summary(tmp_path)
    assert text.splitlines()[0] == f"run {tmp_path}: {steps} step{'s' if steps > 1 else ''}"
    assert reward_line in text


def test_the_summary_gives_the_held_out_gain_paired_over_prompts(tmp_path):
    """Four prompts: 1 of 4 right before, 3 of 4 after, two flipped up and none down. By hand: p = 0.25 and 0.75,
    each with binomial s.e. sqrt(0.25 * 0.75 / 4) = 0.217; the per-prompt differences [1, 0, 0, 1] have mean 0.5
    and sample s.d. sqrt(1/3), so the paired s.e. is sqrt(1/3) / 2 = 0.289 (1.7 s.e.)."""
    from dllm_rl.train import run_summary

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [
        {"step": 0, "eval/pass@1": 0.25}, {"step": 1, "reward/on_policy": 0.5},
        {"step": 2, "reward/on_policy": 0.5, "eval/pass@1": 0.75}]))
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [
        {"step": 0, "uid": ["a", "b", "c", "d"], "correct": [0, 0, 1, 0]},
        {"step": 2, "uid": ["a", "b", "c", "d"], "correct": [1, 0, 1, 1]}]))
    text = run_summary(tmp_path)
    assert "held-out pass@1 at steps 0, 2: 0.250 -> 0.750" in text
    assert ("held-out greedy pass@1 (4 prompts), step 0 -> 2: 0.250 ± 0.217 -> 0.750 ± 0.217, gain +0.500 ± 0.289 "
            "(paired over prompts, +1.7 s.e.)") in text


def test_the_summary_leaves_out_a_provenance_side_that_is_every_prompt(tmp_path):
    from dllm_rl.train import run_summary

    def write(fraction, solved, failed):
        rows = [{"step": s, "eval/pass@1": p, "eval/external_solved_fraction": fraction,
                 **({"eval/pass1_external_solved": solved} if solved is not None else {}),
                 **({"eval/pass1_external_failed": failed} if failed is not None else {})}
                for s, p in ((0, 0.25), (2, 0.5))]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return run_summary(tmp_path)

    assert "pass1_external" not in write(1.0, 0.25, None)  # the source solves all: the solved side is pass@1
    both = write(0.5, 0.3, 0.2)
    assert "held-out pass1_external_solved at steps 0, 2: 0.300 -> 0.300" in both and "pass1_external_failed" in both


def test_the_step_line_leaves_out_fields_that_say_nothing():
    from dllm_rl.tracking import console_line

    line = console_line(3, 10, {"reward/on_policy": 0.25, "reward/accuracy": 0.25, "loss/kl": 0.0,
                                "perf/external_s": 0.01, "perf/score_s": 0.0, "perf/update_s": 1.24})
    assert line == "step 3/10 | reward 0.250 | upd 1.2s"
    line = console_line(3, 10, {"reward/on_policy": 0.35, "reward/accuracy": 0.25, "loss/kl": 0.0012,
                                "perf/external_s": 0.5})
    assert line == "step 3/10 | reward 0.350 | acc 0.250 | kl 0.0012 | ext_s 0.5s"
