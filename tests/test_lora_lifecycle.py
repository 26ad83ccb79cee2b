"""A LoRA run's life through the CLI, each command after the first from another working directory: train with
LoRA (the base given as a relative path), resume and extend, export the merged model, evaluate the checkpoint
and the export (the same completions), and start new RL runs from the LoRA checkpoint (fully, or with a fresh
adapter) and from the export. What no resume can apply (a new adapter shape, LoRA switched on or off) is refused
by name before anything loads; a damaged adapter and a different base model are named too."""

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dllm_rl import cli
from dllm_rl.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow
QUICK = ["task=arithmetic", "external=none", "prompts_per_step=2", "group_size=2", "minibatch_size=4",
         "rollout.gen_length=16", "rollout.block_length=16", "rollout.steps=8", "eval_every=0", "tensorboard=false"]
EVAL = ["task=sudoku", "num_prompts=3", "rollout.gen_length=32", "rollout.block_length=32", "rollout.steps=16"]


def steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lifecycle(tmp_path_factory):
    """A LoRA run started from `root` with model=base (relative), then every other command from `root/elsewhere`."""
    root = tmp_path_factory.mktemp("lifecycle")
    shutil.copytree(Path(__file__).parents[1] / "models" / "tiny-dllm", root / "base")
    (root / "elsewhere").mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_cli(root, monkeypatch, "train", "model=base", "run_dir=run", "steps=2", "lora.r=4",
                       "checkpoint_every=1", *QUICK) == 0
    return root


def run_cli(cwd: Path, monkeypatch, *args: str) -> int:
    monkeypatch.chdir(cwd)
    return cli.main(list(args))


def test_train_resume_export_eval_and_hand_off_from_another_directory(lifecycle, monkeypatch, capsys):
    root = lifecycle
    elsewhere, run = root / "elsewhere", root / "run"
    checkpoint = latest_checkpoint(run)
    record = json.loads((checkpoint / "base_model.json").read_text())
    assert record["path"] == str((root / "base").resolve()) and record["weights"] == {"model.safetensors": (
        root / "base" / "model.safetensors").stat().st_size}
    assert json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"] == record["path"]

    assert run_cli(elsewhere, monkeypatch, "train", f"resume={run}", "steps=3") == 0  # extend
    assert steps(run) == [1, 2, 3]
    checkpoint = latest_checkpoint(run)
    assert checkpoint.name == "step_000003"

    exported = root / "exported"
    assert run_cli(elsewhere, monkeypatch, "export", f"checkpoint={run}", f"output_dir={exported}") == 0
    assert (exported / "model.safetensors").is_file() and not (exported / "adapter_config.json").exists()
    summaries = []
    for i, model in enumerate((checkpoint, exported)):  # no kind=native needed for the adapter directory
        out = root / f"eval{i}"
        assert run_cli(elsewhere, monkeypatch, "eval", f"model={model}", f"output_dir={out}", *EVAL) == 0
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        summaries.append(([{k: v for k, v in x.items() if k != "source"} for x in samples],
                          json.loads((out / "summary.json").read_text())))
    assert summaries[0][0] == summaries[1][0]  # the merged checkpoint and its export write the same completions
    assert any(x["completion"] for x in summaries[0][0])
    scores = [{k: v for k, v in summary["tasks"]["sudoku"].items() if k != "seconds"} for _, summary in summaries]
    assert scores[0] == scores[1]

    for name, start, lora in (("full", checkpoint, "lora.r=0"), ("adapter", checkpoint, "lora.r=2"),
                              ("from_export", exported, "lora.r=0")):
        out = root / name
        assert run_cli(elsewhere, monkeypatch, "train", f"model={start}", f"run_dir={out}", "steps=1", lora,
                       *QUICK) == 0, name
        saved = latest_checkpoint(out)
        if lora == "lora.r=0":  # the whole merged model trains: its checkpoint holds full weights
            weights = load_file(str(saved / "model.safetensors"))
            assert weights and not any("lora_" in k for k in weights)
        else:  # a fresh adapter on top of the merged one, whose base is the first run's checkpoint
            assert json.loads((saved / "base_model.json").read_text())["path"] == str(checkpoint)
            assert run_cli(elsewhere, monkeypatch, "eval", f"model={saved}", f"output_dir={root / 'eval_chain'}",
                           *EVAL) == 0


@pytest.mark.parametrize("change, message", [
    ("lora.r=8", "lora.r was 4 in this run; 8 changes the adapter's shape"),
    ("lora.r=0", "lora.r was 4 in this run; 0 switches LoRA off"),
    ("lora.target_modules=[qkv]", "lora.target_modules was 'all-linear' in this run; ['qkv'] changes the adapter's "
                                  "shape"),
])
def test_a_resume_that_would_reshape_the_adapter_is_refused_by_name(lifecycle, monkeypatch, capsys, change,
                                                                     message):
    run = lifecycle / "run"
    before = (run / "metrics.jsonl").read_text()
    assert run_cli(lifecycle / "elsewhere", monkeypatch, "train", f"resume={run}", change, "allow_changes=true") == 2
    err = capsys.readouterr().err
    assert message in err and "not even with allow_changes=true" in err and "Traceback" not in err, err
    assert f"dllm-rl train model={latest_checkpoint(run)} {change.split('=')[0]}=" in err
    assert (run / "metrics.jsonl").read_text() == before  # nothing written


def test_switching_lora_on_at_a_resume_of_a_full_run_is_refused(lifecycle, monkeypatch, capsys):
    full = lifecycle / "full_run"
    assert run_cli(lifecycle, monkeypatch, "train", "model=base", f"run_dir={full}", "steps=1", *QUICK) == 0
    assert run_cli(lifecycle / "elsewhere", monkeypatch, "train", f"resume={full}", "lora.r=4",
                   "allow_changes=true") == 2
    assert "lora.r was 0 in this run; 4 switches LoRA on" in capsys.readouterr().err


def test_a_truncated_adapter_and_a_different_base_are_named(lifecycle, monkeypatch, capsys):
    root = lifecycle
    run = root / "run"
    damaged = root / "damaged_run" / "checkpoints" / "step_000003"
    shutil.copytree(latest_checkpoint(run), damaged)
    adapter = damaged / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[: adapter.stat().st_size // 2])
    elsewhere = root / "elsewhere"
    assert run_cli(elsewhere, monkeypatch, "train", f"model={damaged}", f"run_dir={root / 'never'}", "steps=1",
                   *QUICK) == 2
    err = capsys.readouterr().err
    assert f"model='{damaged}': cannot load its LoRA adapter (adapter_model.safetensors: " in err, err
    assert run_cli(elsewhere, monkeypatch, "export", f"checkpoint={damaged}", f"output_dir={root / 'never2'}") == 2
    err = capsys.readouterr().err
    assert f"checkpoint='{damaged}' is damaged" in err and "adapter_model.safetensors" in err, err

    config = root / "base" / "config.json"  # another model at the base's path
    original = config.read_text()
    config.write_text(json.dumps({**json.loads(original), "note": "retrained"}))
    try:
        assert run_cli(elsewhere, monkeypatch, "eval", f"model={latest_checkpoint(run)}",
                       f"output_dir={root / 'never3'}", *EVAL) == 2
    finally:
        config.write_text(original)
    err = capsys.readouterr().err
    assert f"the base model at {(root / 'base').resolve()} is not the one its LoRA adapter was trained on " \
           f"(config.json differ from" in err, err
