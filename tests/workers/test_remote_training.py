"""`workers.count=N`: training with rollouts from Ray actors equals training with in-process rollouts (the same
weights after 3 steps, the same rewards), stamps every step with a lag of 0 and a new policy version, resumes with
the version, and a run that starts its own Ray leaves no Ray process behind."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.errors import ConfigError
from dllm_rl.train import train
from tests.conftest import DigitShare
from tests.test_train import SMALL, weights
from tests.workers.conftest import processes_mentioning

pytestmark = pytest.mark.slow


def one_thread(fn, *args, **kwargs):
    """`fn` with torch on one thread, as each worker runs (the rollouts are then the same floats)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def metrics_of(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_three_steps_with_two_workers_equal_three_steps_in_process(ray_session, saved_model, tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    options = dict(SMALL, model=saved_model, steps=3, checkpoint_every=3, bf16=False)
    one_thread(train, DigitShare(), run_dir=str(local), **options)
    one_thread(train, DigitShare(), run_dir=str(remote), workers={"count": 2, "timeout_s": 120}, **options)
    a, b = weights(latest_checkpoint(local)), weights(latest_checkpoint(remote))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], weights(saved_model)[k]) for k in a)  # the run trained
    ours, theirs = metrics_of(local), metrics_of(remote)
    assert [m["reward/on_policy"] for m in ours] == [m["reward/on_policy"] for m in theirs]
    assert [m["rollout/policy_version"] for m in theirs] == [1.0, 2.0, 3.0]
    assert all(m["rollout/lag_max"] == 0.0 and m["rollout/lag_mean"] == 0.0 for m in theirs)
    saved = torch.load(latest_checkpoint(remote) / "trainer_state.pt", weights_only=False)
    assert saved["state"]["policy_version"] == 3
    # a resumed run continues the version count; versions never go back
    one_thread(train, DigitShare(), resume=str(remote), workers={"count": 1, "timeout_s": 120},
               **{**options, "steps": 4})
    assert metrics_of(remote)[-1]["rollout/policy_version"] == 4.0


def test_a_bf16_learner_and_its_workers_sample_alike_and_train_as_in_process(ray_session, saved_model, tmp_path):
    """deepspeed.bf16=true end to end: the learner publishes bf16 weights (half the bytes of fp32), each worker
    casts its model to bf16 before loading them, so it samples with the learner's numbers: three steps with one
    worker (the learner's batch, padded alike) leave the weights bitwise equal to three steps in process. (With
    two workers each batch holds other prompts, hence other padding, and in bf16 that flips a near-tie token now
    and then: measured, step 3's rollouts differed.) With the Sparse-RL correction on, the
    log-ratio of the learner's bf16 score to the worker's recorded bf16 log-probs (taken in float64) is bf16
    rounding of a batch padded otherwise: below 1e-4 per token (about 1e-5 measured; 1e-7 in process)."""
    local, remote, corrected = tmp_path / "local", tmp_path / "remote", tmp_path / "corrected"
    options = dict(SMALL, model=saved_model, steps=3, checkpoint_every=3, bf16=False, deepspeed={"bf16": True})
    one_thread(train, DigitShare(), run_dir=str(local), **options)
    one_thread(train, DigitShare(), run_dir=str(remote), workers={"count": 1, "timeout_s": 120}, **options)
    a, b = weights(latest_checkpoint(local)), weights(latest_checkpoint(remote))
    assert all(v.dtype == torch.bfloat16 for v in b.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    ours, theirs = metrics_of(local), metrics_of(remote)
    assert [m["reward/on_policy"] for m in ours] == [m["reward/on_policy"] for m in theirs]
    fp32_mb = sum(v.numel() * 4 for v in weights(saved_model).values()) / 2**20
    assert [m["rollout/snapshot_mb"] for m in theirs] == [pytest.approx(fp32_mb / 2)] * 3
    one_thread(train, DigitShare(), run_dir=str(corrected), workers={"count": 2, "timeout_s": 120},
               **{**options, "steps": 2, "sampler_correction": {"mode": "weight", "cap": 2.0}})
    logged = metrics_of(corrected)
    assert logged[0]["reward/on_policy"] == ours[0]["reward/on_policy"]
    assert all(0 < m["correction/log_ratio_abs"] < 1e-4 for m in logged), [m["correction/log_ratio_abs"] for m in logged]


def test_snapshots_by_broadcast_train_as_in_process(ray_session, saved_model, tmp_path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    options = dict(SMALL, model=saved_model, steps=2, checkpoint_every=2, bf16=False)
    one_thread(train, DigitShare(), run_dir=str(local), **options)
    one_thread(train, DigitShare(), run_dir=str(remote),
               workers={"count": 2, "transport": "broadcast", "timeout_s": 120}, **options)
    a, b = weights(latest_checkpoint(local)), weights(latest_checkpoint(remote))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["rollout/policy_version"] for m in metrics_of(remote)] == [1.0, 2.0]


def test_groups_streamed_from_two_workers_train_as_the_synchronous_step(ray_session, saved_model, tmp_path):
    """workers.pipe=true at S = 0: the same rollouts as in process, the update equal up to float rounding, the
    learner's wait logged; at S = 1 the streamed groups keep their lags within the bound."""
    local, piped = tmp_path / "local", tmp_path / "piped"
    options = dict(SMALL, model=saved_model, steps=2, checkpoint_every=2, bf16=False, lr=1e-4)
    one_thread(train, DigitShare(), run_dir=str(local), **options)
    one_thread(train, DigitShare(), run_dir=str(piped), workers={"count": 2, "pipe": True, "timeout_s": 120},
               **options)
    a, b = weights(latest_checkpoint(local)), weights(latest_checkpoint(piped))
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    ours, theirs = metrics_of(local), metrics_of(piped)
    assert [m["reward/on_policy"] for m in ours] == [m["reward/on_policy"] for m in theirs]
    assert all(m["rollout/lag_max"] == 0 and m["rollout/learner_wait_s"] > 0 for m in theirs)
    assert [m["rollout/learner_wait_s"] for m in theirs] == [m["perf/rollout_s"] for m in theirs]
    run = tmp_path / "async"
    train(DigitShare(), model=saved_model, run_dir=str(run),
          workers={"count": 2, "max_staleness": 1, "pipe": True, "timeout_s": 120}, **{**ASYNC, "steps": 3})
    assert all(0 <= m["rollout/lag_max"] <= 1 and m["rollout/lag_violations"] == 0 for m in metrics_of(run))


def test_lora_runs_publish_the_merged_weights_and_roll_out_as_in_process(ray_session, saved_model, tmp_path):
    """With LoRA the workers hold the plain model and load the base with the adapter merged in: two steps give
    the in-process run's rewards and adapter weights (to rounding: merged weights are not the adapter's path)."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    options = dict(SMALL, model=saved_model, steps=2, checkpoint_every=2, bf16=False, lora={"r": 4, "alpha": 8.0})
    one_thread(train, DigitShare(), run_dir=str(local), **options)
    one_thread(train, DigitShare(), run_dir=str(remote), workers={"count": 1, "timeout_s": 120}, **options)
    adapter = lambda run: load_file(str(latest_checkpoint(run) / "adapter_model.safetensors"))  # noqa: E731
    a, b = adapter(local), adapter(remote)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    assert [m["reward/on_policy"] for m in metrics_of(local)] == [m["reward/on_policy"] for m in metrics_of(remote)]
    assert [m["rollout/policy_version"] for m in metrics_of(remote)] == [1.0, 2.0]


def test_workers_refuse_what_they_cannot_serve_by_name(saved_model, tmp_path):
    zero2 = {"name": "zero2", "stage": 2}
    for extra, match in (({"deepspeed": zero2, "workers": {"count": 1, "pipe": True}}, "needs ZeRO stage 0 or 3"),):
        with pytest.raises(ConfigError, match=match):
            train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "r"), steps=1,
                  **{**SMALL, "workers": {"count": 1}, **extra})


def test_a_run_that_starts_its_own_ray_leaves_no_ray_process(saved_model, tmp_path):
    """A run that starts its own Ray stops it however it ends: no process, no shared-memory file remains."""
    run, short = tmp_path / "run", Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # Ray's sockets need short paths
    env = {**os.environ, "TMPDIR": str(short), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dllm_rl.cli", "train", f"model={saved_model}", f"run_dir={run}", "steps=1",
               "task=arithmetic", "prompts_per_step=2", "group_size=2", "minibatch_size=4", "eval_every=0",
               "external=none", "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8",
               "workers.count=1", "workers.timeout_s=120", "tensorboard=false"]
    shared = set(os.listdir("/dev/shm"))  # Ray's object store lives in shared memory
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert set(os.listdir("/dev/shm")) <= shared  # no shared-memory file left behind
    assert metrics_of(run)[0]["rollout/policy_version"] == 1.0
    assert not processes_mentioning(str(short))  # its Ray (under TMPDIR) is gone, its session directory too
    assert not [p.name for p in short.iterdir() if p.name.startswith("dllm-ray-")]
    # a run that fails (its workers cannot load the model in time) stops its Ray too
    failed = subprocess.run([*command[:5], f"run_dir={tmp_path / 'failed'}", *command[6:-2], "workers.timeout_s=0.01",
                             "tensorboard=false"], env=env, capture_output=True, text=True, timeout=300)
    assert (failed.returncode != 0
            and "failed to start: it did not start within 0.01 s" in failed.stderr), failed.stderr[-3000:]
    assert not processes_mentioning(str(short))
    shutil.rmtree(short)


def test_groups_are_split_whole_and_contiguous_over_the_workers():
    from dllm_rl.workers.remote import split_groups

    keys = [(b, 10 + b, g) for b, n in enumerate([4, 4, 2, 6]) for g in range(n)]  # 16 rollouts in 4 groups
    assert split_groups(keys, 2) == [list(range(0, 8)), list(range(8, 16))]
    assert split_groups(keys, 3) == [list(range(0, 4)), list(range(4, 10)), list(range(10, 16))]
    assert split_groups(keys[:4], 3) == [[0, 1, 2, 3]]  # one group: one worker
    shares = split_groups(keys, 8)
    assert sorted(i for s in shares for i in s) == list(range(16)) and len(shares) == 4


ASYNC = dict(SMALL, steps=4, checkpoint_every=2, bf16=False, sampler_correction={"mode": "weight", "cap": 2.0})


def test_asynchronous_rollouts_lag_at_most_s_are_corrected_and_resume(ray_session, saved_model, tmp_path):
    run = tmp_path / "run"
    workers = {"count": 2, "max_staleness": 2, "timeout_s": 120}
    train(DigitShare(), model=saved_model, run_dir=str(run), workers=workers, **ASYNC)
    lines = metrics_of(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert all(0 <= m["rollout/lag_max"] <= 2 and m["rollout/lag_violations"] == 0 for m in lines)
    assert max(m["rollout/lag_max"] for m in lines) >= 1  # groups were generated ahead, by older policies
    assert lines[0]["rollout/lag_max"] == 0  # the first step's groups come from the starting policy
    assert all(0 < m["correction/ess"] <= 1 and "correction/weight_mean" in m for m in lines)
    assert [m["rollout/policy_version"] for m in lines] == [1.0, 2.0, 3.0, 4.0]
    before, after = weights(saved_model), weights(latest_checkpoint(run))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    state = torch.load(latest_checkpoint(run) / "trainer_state.pt", weights_only=False)["state"]
    assert state["data_position"] <= 4 * 2 and state["policy_version"] == 4  # groups in flight are drawn again
    train(DigitShare(), model=saved_model, resume=str(run), workers=workers, **{**ASYNC, "steps": 6})
    lines = metrics_of(run)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5, 6] and lines[-1]["rollout/policy_version"] == 6.0


def test_a_snapshot_every_two_updates_bumps_the_version_every_two_steps(ray_session, saved_model, tmp_path):
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run),
          workers={"count": 1, "max_staleness": 1, "sync_every": 2, "timeout_s": 120}, **ASYNC)
    lines = metrics_of(run)
    assert [m["rollout/policy_version"] for m in lines] == [1.0, 1.0, 2.0, 2.0]
    assert [m["rollout/publish_s"] > 0 for m in lines] == [True, False, True, False]
    assert all(0 <= m["rollout/lag_max"] <= 1 and m["rollout/lag_violations"] == 0 for m in lines)


def test_asynchronous_rollouts_need_the_correction_and_no_curation(saved_model, tmp_path):
    workers = {"count": 1, "max_staleness": 1}
    with pytest.raises(ConfigError, match="workers.max_staleness=1: rows generated by older policies"):
        train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "a"), workers=workers,
              sampler_correction={"mode": "none"}, **SMALL)  # the default (auto) turns it on
    with pytest.raises(ConfigError, match="workers.max_staleness=1 with curation=.*greso"):
        train(DigitShare(), model=saved_model, run_dir=str(tmp_path / "b"), workers=workers,
              **{**ASYNC, "curation": {"greso": {}}})


def test_ctrl_c_stops_the_run_and_its_workers_and_leaves_no_ray_process(saved_model, tmp_path):
    """Ctrl-C in a terminal reaches the whole foreground process group (the learner and every Ray process it
    started): the run stops after its step with the resume line, and nothing of its Ray remains."""
    import signal
    import time

    run, short = tmp_path / "run", Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(short), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dllm_rl.cli", "train", f"model={saved_model}", f"run_dir={run}", "steps=500",
               "task=arithmetic", "prompts_per_step=2", "group_size=2", "minibatch_size=4", "eval_every=0",
               "external=none", "rollout.gen_length=16", "rollout.block_length=8", "rollout.steps=8",
               "checkpoint_every=1", "workers.count=1", "workers.max_staleness=1",  # the correction: mode=auto
               "workers.timeout_s=120", "tensorboard=false"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline and not (run / "checkpoints" / "latest").exists():
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate(timeout=180)
    assert process.returncode == 130, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("stopped: interrupted after step ")], err[-3000:]
    time.sleep(1.0)
    assert not processes_mentioning(str(short)), err[-3000:]
    shutil.rmtree(short, ignore_errors=True)
