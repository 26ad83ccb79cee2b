"""Ranks started by hand, as a cluster scheduler starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, no
launcher to tear the others down): when one rank fails at start-up or never comes, every other rank exits
within `deepspeed.timeout_s` plus a margin, with an error naming that rank."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dllm_rl.engine.dist import free_port
from tests.engine.test_distributed import clean_env

pytestmark = pytest.mark.slow
TIMEOUT_S = 10
MARGIN_S = 30
ROOT = Path(__file__).parents[2]


def start(rank: int, port: int, run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = clean_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port))
    args = [sys.executable, "-m", "dllm_rl.cli", "train", f"run_dir={run_dir}", "task=arithmetic", "steps=2",
            "prompts_per_step=2", "group_size=2", "minibatch_size=4", "rollout.gen_length=16",
            "rollout.block_length=16", "rollout.steps=8", "eval_every=0", "tensorboard=false", "external=none",
            f"deepspeed.timeout_s={TIMEOUT_S}", *overrides]
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> tuple[int, str, float]:
    """(exit status, output, seconds from now until it exited)."""
    begin = time.monotonic()
    output, _ = process.communicate(timeout=TIMEOUT_S + MARGIN_S + 60)
    return process.returncode, output, time.monotonic() - begin


@pytest.mark.parametrize("bad", [0, 1])
def test_a_rank_with_a_bad_model_path_stops_its_peer_with_its_reason(tmp_path, bad):
    port = free_port()
    ranks = {r: start(r, port, tmp_path / "run", *(["model=/no/such/model"] if r == bad else [])) for r in (0, 1)}
    results = {r: finish(p) for r, p in ranks.items()}
    good = 1 - bad
    status, output, _ = results[bad]
    assert status == 2 and "model path '/no/such/model'" in output and "Traceback" not in output, output
    status, output, seconds = results[good]
    assert status == 1 and "Traceback" not in output, output
    assert f"stopped: rank {bad} failed: ConfigError: model path '/no/such/model'" in output, output
    assert seconds < TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("overrides, message", [
    (["external=causal_lm", "external.path=/no/such/ar"], "external.path='/no/such/ar': expected a local"),
    (["task=gsm8k", "task.train_file=/no/such.jsonl", "eval_every=0"],
     "task.train_file='/no/such.jsonl': no such file"),
])
def test_a_rank_failing_on_its_external_model_or_data_files_stops_its_peer_with_its_reason(tmp_path, overrides,
                                                                                         message):
    """They load after the rendezvous: the failing rank's reason reaches its peer at once, not "did not reach the
    rendezvous" after the whole timeout."""
    port = free_port()
    ranks = {1: start(1, port, tmp_path / "run", *overrides), 0: start(0, port, tmp_path / "run")}
    status, output, _ = finish(ranks[1])
    assert status == 2 and message in output and "Traceback" not in output, output
    status, output, seconds = finish(ranks[0])
    assert status == 1 and f"stopped: rank 1 failed: ConfigError: {message}" in output, output
    assert seconds < TIMEOUT_S + MARGIN_S


def test_ctrl_c_under_a_launcher_is_an_interrupt_on_every_rank(tmp_path):
    """SIGINT to every rank, as a terminal's Ctrl-C sends it: each stops after the same step with the interrupt's
    own message and status 130, none reports the other as failed."""
    port, run = free_port(), tmp_path / "run"
    ranks = {r: start(r, port, run, "steps=200", "checkpoint_every=0") for r in (0, 1)}
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.values())
        time.sleep(0.2)
    for process in ranks.values():
        process.send_signal(signal.SIGINT)
    for rank, process in ranks.items():
        status, output, _ = finish(process)
        assert status == 130 and "stopped: interrupted after step" in output, (rank, output)
        assert "failed" not in output and "Traceback" not in output, (rank, output)


@pytest.mark.parametrize("started", [0, 1])
def test_a_rank_that_never_comes_is_named_after_the_timeout(tmp_path, started):
    begin = time.monotonic()
    status, output, _ = finish(start(started, free_port(), tmp_path / "run"))
    seconds = time.monotonic() - begin
    assert status == 1 and "Traceback" not in output, output
    if started == 0:  # rank 0 hosts the rendezvous and waits for rank 1
        assert f"rank 1 did not reach the rendezvous within deepspeed.timeout_s={TIMEOUT_S}s" in output, output
    else:  # rank 1 finds no rendezvous: rank 0 hosts it
        assert "rank 0, which hosts it, did not start" in output, output
    assert TIMEOUT_S <= seconds < TIMEOUT_S + MARGIN_S, seconds


def test_one_rank_is_one_world_without_a_rendezvous_wait(tmp_path):
    """WORLD_SIZE=1 set by hand: rank 0 hosts and joins alone, no wait."""
    env = clean_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    result = subprocess.run([sys.executable, "-m", "dllm_rl.cli", "train", f"run_dir={tmp_path / 'run'}",
                             "task=arithmetic", "steps=1", "prompts_per_step=1", "group_size=2", "minibatch_size=2",
                             "rollout.gen_length=16", "rollout.block_length=16", "rollout.steps=8", "eval_every=0",
                             "tensorboard=false", "external=none", f"deepspeed.timeout_s={TIMEOUT_S}"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step": 1') == 1
    assert os.path.isdir(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("lost, how", [(1, signal.SIGKILL), (1, signal.SIGSTOP), (0, signal.SIGKILL)])
def test_a_peer_lost_mid_run_is_named_with_the_checkpoint_to_resume_from(tmp_path, lost, how):
    """A rank killed (or stopped) after its first checkpoint: the survivor ends within the timeout with one line
    naming that rank, the phase and step it was in, the last checkpoint and the resume command; no traceback.
    A killed rank 0 takes the rendezvous store with it, and is named all the same."""
    port, run = free_port(), tmp_path / "run"
    ranks = {r: start(r, port, run, "steps=200", "checkpoint_every=1") for r in (0, 1)}
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "latest").is_file():
        assert time.monotonic() < deadline and all(p.poll() is None for p in ranks.values())
        time.sleep(0.1)
    ranks[lost].send_signal(how)
    try:
        status, output, seconds = finish(ranks[1 - lost])
    finally:
        ranks[lost].kill()
        ranks[lost].wait()
    assert status == 1 and "Traceback" not in output, output
    match = re.search(rf"stopped: rank {lost} stopped answering during the (.+?) phase of step (\d+) \((.*)\); "
                      rf"the last checkpoint is step (\d+); continue with resume=(\S+)", output)
    assert match is not None, output
    phase, step, cause, checkpoint, resume = match.groups()
    assert phase in ("rollout", "external", "score", "update", "evaluation, logging and checkpoint"), output
    assert 1 <= int(checkpoint) < int(step) + 1 and resume == str(run)
    assert (run / "checkpoints" / f"step_{int(checkpoint):06d}" / "COMPLETE").is_file()
    assert ("timed out" in cause.lower()) if how == signal.SIGSTOP else cause
    assert seconds < TIMEOUT_S + MARGIN_S
