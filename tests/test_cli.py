import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dllm_rl import cli

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def primary_configs():
    return sorted(p.stem for p in CONFIGS.glob("*.yaml"))


def group_options():
    return [(g.name, f.stem) for g in sorted(CONFIGS.iterdir()) if g.is_dir() for f in sorted(g.glob("*.yaml"))]


@pytest.mark.parametrize("config_name", primary_configs())
def test_every_config_composes_with_every_option_of_its_groups(config_name):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        base = compose(config_name)
        groups = [(g, o) for g, o in group_options() if g in base]
        assert groups or config_name in ("export", "plan", "compare"), f"{config_name} uses no config group"
        for group, option in groups:
            cfg = compose(config_name, overrides=[f"{group}={option}"])
            if group == "curation":  # keyed by strategy, so that several compose: curation=[greso,darts]
                assert list(cfg[group]) == ([] if option == "none" else [option])
            else:
                assert cfg[group]["name"] == option


def test_every_yaml_field_has_a_comment():
    for path in CONFIGS.rglob("*.yaml"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped and not stripped.startswith(("#", "-", "defaults:")) and ":" in stripped:
                assert "#" in line, f"{path.name}: field without a comment: {line!r}"


def test_tasks_command_prints_examples_and_summary(capsys):
    assert cli.main(["tasks", "task=sudoku", "n=2", "check=50", "task.blanks=8"]) == 0
    out = capsys.readouterr().out
    assert out.count("=== sudoku [train] example") == 2
    assert "reference answers correct 50/50, solver correct 50/50" in out


def test_print_config_with_overrides(capsys):
    assert cli.main(["tasks", "--cfg", "task=arithmetic", "task.ops=+", "+task.extra=1", "~task.format_weight"]) == 0
    out = capsys.readouterr().out
    assert "name: arithmetic" in out and "ops: +" in out and "extra: 1" in out
    assert "format_weight" not in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["tasks", "task.max_numbr=3"], "unknown config key 'task.max_numbr' (did you mean 'task.max_number'?)"),
        (["tasks", "chek=3"], "unknown config key 'chek' (did you mean 'check'?)"),
        (["tasks", "+task.bogus=1"], "unknown config key 'task.bogus'"),
        (["tasks", "task=sudok"], "Could not find 'task/sudok'"),
        (["tasks", "task.max_number=abc"], "task.max_number='abc': expected int"),
        (["tasks", "n=0"], "n must be a positive integer, got 0"),
        (["tasks", "split=validation"], "split must be one of ('train', 'test'), got 'validation'"),
        (["tasks", "task.num_numbers=[3,"], "cannot parse the overrides"),
        (["tasks", "tokenizer=/nonexistent"], "tokenizer='/nonexistent': expected a local tokenizer directory"),
        (["tsks"], "unknown command 'tsks' (did you mean 'tasks'?)"),
        (["tasks", "--cfgg"], "unknown flag(s) ['--cfgg']"),
    ],
)
def test_bad_input_is_named(args, message, capsys):
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_launcher_local_rank_flag_is_stripped(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert cli.main(["tasks", "--local_rank=1", "--cfg"]) == 0
    assert os.environ["LOCAL_RANK"] == "1"
    assert cli.strip_launcher_args(["tasks", "--local_rank", "3", "n=1"]) == ["tasks", "n=1"]


def test_console_script_runs():
    exe = Path(sys.executable).with_name("dllm-rl")
    result = subprocess.run([str(exe), "tasks", "n=1", "check=10", "--local_rank=0"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "=== summary: 10 train examples of countdown" in result.stdout


@pytest.fixture
def saved_dllm(tiny_policy, char_tokenizer, tmp_path):
    path = tmp_path / "tiny"
    tiny_policy.model.save_pretrained(path)
    char_tokenizer.save_pretrained(path)
    return path


def test_generate_command(saved_dllm, capsys):
    args = ["generate", f"model={saved_dllm}", "prompt=Compute 1 + 2", "num_samples=2", "rollout.temperature=1.0",
            "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "--- sample 0" in out and "--- sample 1" in out


def test_generate_notes_a_literal_backslash_n_and_keeps_real_newlines(saved_dllm, capsys):
    settings = ["rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8"]
    assert cli.main(["generate", f"model={saved_dllm}", "prompt='Numbers: [3, 5]\\nTarget: 8'", *settings]) == 0
    assert "literal backslash-n" in capsys.readouterr().out
    assert cli.main(["generate", f"model={saved_dllm}", "prompt='Numbers: [3, 5]\nTarget: 8'", *settings]) == 0
    assert "literal backslash-n" not in capsys.readouterr().out


def test_eval_command_writes_samples_and_summary(saved_dllm, tmp_path, capsys):
    out_dir = tmp_path / "eval"
    args = ["eval", f"model={saved_dllm}", "task=sudoku", "num_prompts=3", "num_samples=2", "rollout.temperature=1.0",
            "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8", f"output_dir={out_dir}"]
    assert cli.main(args) == 0
    summary = json.loads((out_dir / "summary.json").read_text())["tasks"]["sudoku"]
    assert summary["num_prompts"] == 3 and "pass@2" in summary and "best_of_2" in summary
    assert len((out_dir / "samples.jsonl").read_text().splitlines()) == 6


def test_sft_command_saves_a_model_that_loads(saved_dllm, tmp_path):
    out_dir = tmp_path / "sft"
    args = ["sft", f"model={saved_dllm}", "task=arithmetic", "examples=40", "steps=3", "batch_size=4",
            f"output_dir={out_dir}", "gen_length=48"]
    assert cli.main(args) == 0
    from dllm_rl.policy.adapters import load_policy

    policy, _ = load_policy(str(out_dir))
    assert policy.kind == "native"


@pytest.mark.parametrize(
    "args, message",
    [
        (["eval", "model=/nonexistent"], "model='/nonexistent': expected a local model directory"),
        (["sft", "task=gsm8k", "task.train_file=x", "model=SAVED"], "task.train_file='x': no such file"),
        (["sft", "task=gsm8k", "task.test_file=x", "model=SAVED"], "gsm8k: there is no train split"),
        (["eval", "rollout.block_length=5", "model=SAVED"], "gen_length=64 must be a multiple of block_length=5"),
        (["eval", "rollout=fast"], "Could not find 'rollout/fast'"),
    ],
)
def test_model_commands_reject_bad_input(args, message, capsys, saved_dllm):
    args = [a.replace("SAVED", str(saved_dllm)) for a in args]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def test_a_missing_mandatory_value_is_named(capsys):
    assert cli.main(["train", "external=jsonl"]) == 2
    assert "external.path has no value (the config says ???); set it with external.path=..." in capsys.readouterr().err


def test_file_splits_are_said_and_checked_before_loading(saved_dllm, fixtures, tmp_path, capsys):
    """`eval` with only a test file scores all of it (num_prompts=null) and says so; `train` with only a train
    file and held-out evaluation on stops before loading, saying how to get a test split."""
    out = tmp_path / "eval"
    assert cli.main(["eval", f"model={saved_dllm}", "task=gsm8k", f"task.test_file={fixtures / 'gsm8k_test.jsonl'}",
                     "num_prompts=null", "task.prompt_style=compact", "chat=false", "rollout.gen_length=16",
                     "rollout.block_length=16", "rollout.steps=4",
                     f"output_dir={out}"]) == 0
    assert "gsm8k: task.test_file is the whole test split (2 problems)" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["tasks"]["gsm8k"]["num_prompts"] == 2
    run = tmp_path / "run"
    assert cli.main(["train", f"model={saved_dllm}", "task=gsm8k", f"run_dir={run}",
                     f"task.train_file={fixtures / 'gsm8k_train.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert "gsm8k: there is no test split: only task.train_file is set" in err and "eval_every=0" in err, err
    assert not run.exists()


@pytest.mark.parametrize("command", ["tasks", "generate", "eval", "sft", "train", "export"])
def test_help_lists_every_group_and_top_level_key_with_its_comment(command, capsys):
    from dllm_rl.cli import COMMANDS, compose_config, config_dir, yaml_outline

    for flag in ("--help", "-h"):
        assert cli.main([command, flag]) == 0
        text = capsys.readouterr().out
        composed = compose_config(COMMANDS[command][1], [])
        groups, keys = yaml_outline(config_dir() / f"{COMMANDS[command][1]}.yaml")
        assert {k for k, _, _ in keys} | {g for g, _, _ in groups} >= set(composed.keys())  # nothing unlisted
        for key, default, comment in keys:
            line = next(x for x in text.splitlines() if x.strip().startswith(f"{key}="))
            assert comment in line and default in line, (key, line)
        for group, default, _ in groups:
            assert f"{group}={default}" in text
            options = sorted(f.stem for f in (config_dir() / group).glob("*.yaml"))
            assert f"options: {' | '.join(options)}" in text


def test_version_and_bare_command(capsys):
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0 and capsys.readouterr().out.strip() == f"dllm-rl {version('dllm-rl')}"
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in ("tasks", "generate", "eval", "sft", "train", "export"))
    assert cli.main(["train", "--nope"]) == 2 and "unknown flag(s) ['--nope']" in capsys.readouterr().err


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_override_values_that_yaml_cannot_read_are_strings_for_every_command(command, capsys):
    """`key=/tmp/x: y` or `key=a host::` is a value YAML cannot parse: the consent check reads only the keys, and the
    value arrives as the string it is (no scanner traceback)."""
    assert cli.main([command, "--cfg", "+probe=/tmp/x: y", "+other=not a host::"]) == 0
    out = capsys.readouterr().out
    assert "probe: '/tmp/x: y'" in out and "other: 'not a host::'" in out


def test_yaml_value_reads_what_yaml_reads_and_keeps_the_rest_as_text():
    """What a resume's overrides go through (`resumed_config`)."""
    assert cli.yaml_value("3") == 3 and cli.yaml_value("true") is True and cli.yaml_value("[a, b]") == ["a", "b"]
    assert cli.yaml_value("/tmp/x: y") == "/tmp/x: y" and cli.yaml_value("not a host::") == "not a host::"


def test_eval_of_a_runs_checkpoint_scores_the_runs_task_unless_another_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "COMPLETE").write_text("")
    (run / "checkpoints" / "latest").symlink_to("step_000002")
    (run / "config.json").write_text(json.dumps({"task": {"name": "sudoku"}, "steps": 2}))
    for model in (checkpoint, run / "checkpoints" / "latest"):
        assert cli.main(["eval", "--cfg", f"model={model}"]) == 0
        captured = capsys.readouterr()
        assert "name: sudoku" in captured.out and "task=sudoku: the task of the run" in captured.err
    assert cli.main(["eval", "--cfg", f"model={checkpoint}", "task=countdown"]) == 0
    assert "name: countdown" in capsys.readouterr().out
    assert cli.main(["eval", "--cfg", f"model={tmp_path}"]) == 0  # not a checkpoint: eval's own default
    assert "name: countdown" in capsys.readouterr().out


def test_help_on_a_group_lists_its_keys_with_their_comments(capsys):
    assert cli.main(["train", "--help", "workers"]) == 0
    out = capsys.readouterr().out
    assert "workers:" in out and "max_staleness: 0" in out and "# S: a group may be generated" in out
    assert "steps=80" not in out  # only the group
    assert cli.main(["train", "--help", "likelihood"]) == 0
    out = capsys.readouterr().out
    assert "likelihood=elbo:" in out and "num_masks: 4" in out and "likelihood=mean_field:" in out
    assert cli.main(["train", "--help", "worker"]) == 2
    assert "--help worker: not a group of dllm-rl train (did you mean 'workers'?)" in capsys.readouterr().err
    assert cli.main(["train", "--help"]) == 0
    assert "dllm-rl train --help <lora|sampler_correction|workers|mixing|" in capsys.readouterr().out


def test_help_imports_neither_torch_nor_transformers():
    """`import dllm_rl` registers the native model only once transformers' Auto classes load, so `--help` (and
    `--cfg`, and a config error) costs the config files, not torch (seconds)."""
    code = ("import sys; from dllm_rl import cli; cli.main(['train', '--help', 'workers']); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", out.stderr[-2000:]
