"""Checkpoints on resume: files are checked against their manifest, a damaged newest checkpoint falls back to the
previous complete one, and a planted pickle is refused before anything unpickles it (dllm_rl/checkpoint.py)."""

import json
import os
import pickle
import warnings

import pytest
import torch

from dllm_rl.checkpoint import MANIFEST, damage, resumable_checkpoint, write_manifest
from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from tests.conftest import DigitShare

SETTINGS = dict(rollout={"gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0},
                likelihood={"name": "mean_field"}, external={"name": "none"}, prompts_per_step=2, group_size=4,
                minibatch_size=8, eval_every=0, sample_every=0, tensorboard=False, lr=1e-3, warmup=0,
                checkpoint_every=2, keep_checkpoints=0, lr_schedule="constant", print_fn=lambda *_: None)


class Planted:
    """A pickle that runs code when unpickled: it creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def run(saved_model, tmp_path):
    """A run with complete checkpoints at steps 2 and 4."""
    path = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(path), steps=4, **SETTINGS)
    return path


def test_every_file_is_in_the_manifest_and_a_change_is_named(run):
    checkpoint = run / "checkpoints" / "step_000004"
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert {"trainer_state.pt", "model.safetensors", "deepspeed/mp_rank_00_model_states.pt"} <= set(manifest)
    assert damage(checkpoint) is None
    states = checkpoint / "deepspeed" / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    states.write_bytes(bytes(data))
    assert damage(checkpoint) == "deepspeed/mp_rank_00_model_states.pt does not match the checksum it was written with"
    with open(states, "r+b") as f:
        f.truncate(100)
    assert "has 100 bytes where" in damage(checkpoint)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_and_the_run_ends_the_same(
        run, saved_model, tmp_path):
    straight = tmp_path / "straight"
    train(DigitShare(), model=saved_model, run_dir=str(straight), steps=6, **SETTINGS)
    with open(run / "checkpoints" / "step_000004" / "trainer_state.pt", "r+b") as f:
        f.truncate(50)  # a truncated file under a COMPLETE marker
    with pytest.warns(UserWarning, match=r"step_000004 is damaged \(trainer_state.pt has 50 bytes"):
        assert resumable_checkpoint(run).name == "step_000002"
    with pytest.warns(UserWarning, match="step_000004 is damaged"):
        train(DigitShare(), model=saved_model, resume=str(run), steps=6, **SETTINGS)
    a, b = (torch.load(path / "checkpoints" / "step_000006" / "deepspeed" / "mp_rank_00_model_states.pt",
                       weights_only=False)["module"] for path in (run, straight))
    assert all(torch.equal(a[k], b[k]) for k in a)  # steps 3-6 ran again from step 2, exactly
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("target", ["trainer_state.pt", "deepspeed/mp_rank_00_model_states.pt"])
def test_a_planted_pickle_is_refused_before_it_runs(run, saved_model, tmp_path, target):
    """The attacker also rewrites the manifest, so the checksums match: the pickle itself is refused."""
    marker = tmp_path / "code_ran"
    checkpoint = run / "checkpoints" / "step_000004"
    with open(checkpoint / target, "wb") as f:
        pickle.dump({"state": Planted(marker)}, f)
    write_manifest(checkpoint)
    with pytest.raises(ConfigError, match=f"{target}: refusing to load it: it holds Python objects"):
        train(DigitShare(), model=saved_model, resume=str(run), steps=6, **SETTINGS)
    assert not marker.exists()
    from dllm_rl import cli

    assert cli.main(["export", f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'out'}"]) == 2
    assert not marker.exists() and not os.path.exists(tmp_path / "out")


def test_a_failed_checkpoint_write_names_the_directory_and_keeps_the_previous_checkpoint(run, saved_model,
                                                                                         monkeypatch, capsys):
    """A full disk: torch's writer fails mid-file (its message says 'unexpected pos'). The run stops with a plain
    message; the half-written directory is gone and the previous checkpoint is still the latest."""
    import dllm_rl.checkpoint as checkpoint_module
    from dllm_rl.checkpoint import latest_checkpoint
    from dllm_rl.errors import RunStopped

    def full_disk(obj, path, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 512 vs 448")

    monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
    with pytest.raises(RunStopped, match=r"could not write checkpoint step_000006 in .*checkpoints: .*unexpected pos.*"
                                         r"GiB free there.*checkpoints/latest are unchanged"):
        train(DigitShare(), model=saved_model, resume=str(run), steps=6, **SETTINGS)
    assert latest_checkpoint(run).name == "step_000004" and resumable_checkpoint(run).name == "step_000004"
    assert not any(p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir())


@pytest.mark.parametrize("pointer", [b"\xff\xfe\x00garbage", b"../../etc", b"step_000009"])
def test_a_damaged_latest_pointer_falls_back_to_the_newest_complete_checkpoint(run, saved_model, pointer):
    """`checkpoints/latest` holding binary garbage, a path, or a checkpoint that is not there: the newest complete
    checkpoint is taken (with a warning where the pointer names none), and the run resumes from it."""
    from dllm_rl.checkpoint import latest_checkpoint

    (run / "checkpoints" / "latest").write_bytes(pointer)
    if pointer.startswith(b"step_"):
        assert latest_checkpoint(run).name == "step_000004"
    else:
        with pytest.warns(UserWarning, match="latest is damaged"):
            assert latest_checkpoint(run).name == "step_000004"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(DigitShare(), model=saved_model, resume=str(run), steps=5, **SETTINGS)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]
