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
@pytest.mark.parametrize("group, option", group_options())
def test_every_config_composes(config_name, group, option):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name, overrides=[f"{group}={option}"])
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
