"""Rollout workers as real Ray actors (dllm_rl/workers/ray_pool.py) on the embedded dLLM: a published snapshot
travels through the object store, each worker checks it, and their rollouts equal the learner's in-process
rollouts of the same weights and seeds token for token; a corrupted snapshot and an unloaded worker are named."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray
import torch

from dllm_rl.policy.adapters import load_policy
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.workers.admission import Admission
from dllm_rl.workers.pipeline import Job, Pipeline
from dllm_rl.workers.ray_pool import RayBackend, RayStore, WorkerPool, WorkersError, start_ray
from dllm_rl.workers.versions import ChecksumMismatch, Publisher, Snapshot
from tests.workers.conftest import processes_mentioning

MODEL = str(Path(__file__).resolve().parents[2] / "models" / "tiny-dllm")
SAMPLER = {"gen_length": 16, "block_length": 8, "steps": 8, "temperature": 1.0}
PROMPTS = ["12+7=", "3+4=", "40+2=", "9+9="]

pytestmark = pytest.mark.slow


def perturbed_policy(seed: int):
    """The embedded dLLM with every weight moved a little: rollouts that only these weights give."""
    policy, tokenizer = load_policy(MODEL)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    policy.model.eval()
    return policy, tokenizer


def test_workers_roll_out_what_the_learner_would_from_the_published_snapshot(ray_session):
    policy, tokenizer = perturbed_policy(seed=1)
    publisher = Publisher(RayStore())
    snapshot = publisher.publish(policy.model.state_dict(), step=3)
    pool = WorkerPool(2, MODEL, SAMPLER, bf16=False, timeout_s=120)
    try:
        pool.load(snapshot)
        chunks = [(PROMPTS[:2], [11, 12]), (PROMPTS[2:], [13, 14])]
        got = pool.generate(chunks)
    finally:
        pool.close()
    generator = TextGenerator(policy, tokenizer, **SAMPLER)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        with torch.no_grad():
            expected = [generator.sample(p, s) for p, s in chunks]
    finally:
        torch.set_num_threads(threads)
    for out, ref in zip(got, expected):
        assert (out.version, out.step, out.checksum) == (1, 3, snapshot.checksum)
        assert torch.equal(out.samples.sequences_BL, ref.sequences_BL)
        assert torch.equal(out.samples.unmask_step_BC, ref.unmask_step_BC)
        assert torch.equal(out.samples.logp_BC, ref.logp_BC)
    unperturbed = TextGenerator(load_policy(MODEL)[0], tokenizer, **SAMPLER).sample(*chunks[0])
    assert not torch.equal(unperturbed.sequences_BL, got[0].samples.sequences_BL)  # the snapshot mattered


@pytest.mark.parametrize("kind", ["llada", "dream"])
def test_workers_hold_the_published_llada_and_dream_code_and_roll_out_alike(ray_session, kind, char_tokenizer,
                                                                             tmp_path):
    """A checkpoint with its own model code (trust_remote_code, the real files' stand-ins): a worker loads it,
    takes a snapshot of moved weights, and rolls out what the learner's sampler does."""
    from tests.policy.remote_standins import write_dream, write_llada

    path = str((write_llada if kind == "llada" else write_dream)(tmp_path / kind, char_tokenizer))
    policy, tokenizer = load_policy(path, trust_remote_code=True)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    policy.model.eval()
    pool = WorkerPool(1, path, SAMPLER, bf16=False, timeout_s=120, trust_remote_code=True)
    try:
        pool.load(Publisher(RayStore()).publish(policy.model.state_dict(), step=1))
        (got,) = pool.generate([(PROMPTS[:2], [41, 42])])
    finally:
        pool.close()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        with torch.no_grad():
            expected = TextGenerator(policy, tokenizer, **SAMPLER).sample(PROMPTS[:2], [41, 42])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got.samples.sequences_BL, expected.sequences_BL)


def test_a_corrupted_snapshot_and_an_unloaded_worker_are_named(ray_session):
    policy, _ = perturbed_policy(seed=2)
    snapshot = Publisher(RayStore()).publish(policy.model.state_dict(), step=0)
    pool = WorkerPool(1, MODEL, SAMPLER, bf16=False, timeout_s=120)
    try:
        with pytest.raises(WorkersError, match="before any snapshot was loaded"):
            pool.generate([(PROMPTS[:1], [1])])
        bad = Snapshot(snapshot.version, snapshot.step, snapshot.ref, "0badc0de")
        with pytest.raises(ChecksumMismatch, match="the learner published 0badc0de"):
            pool.load(bad)
    finally:
        pool.close()


def test_a_cluster_that_is_not_there_is_a_named_error():
    with socket.socket() as closed:  # a loopback port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(WorkersError, match=rf"the cluster at address='127.0.0.1:{port}'\): nothing answers"):
        start_ray(address=f"127.0.0.1:{port}")
    with pytest.raises(WorkersError, match="expected host:port"):
        start_ray(address="headnode")


def test_ray_that_cannot_start_is_a_named_error(tmp_path):
    code = ("from dllm_rl.workers.ray_pool import start_ray, WorkersError\n"
            "try:\n    start_ray(num_cpus=1, object_store_mb=1, temp_dir=%r)\n"
            "except WorkersError as e:\n    print('NAMED', e)\n" % str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "NAMED Ray did not start (a local Ray)" in out.stdout, out.stderr[-2000:]


def test_the_pipeline_on_real_workers_survives_a_sigkilled_worker(ray_session):
    """Two actors, S = 1, groups of two rollouts: one worker is SIGKILLed with groups queued on it; the lost groups
    are generated again (same seeds, same snapshot: the same tokens), the worker restarts, no group is taken twice
    or lost (a regenerated group starts after its neighbours, so it may be taken a step later, within S)."""
    policy, tokenizer = perturbed_policy(seed=3)
    publisher = Publisher(RayStore())
    pool = WorkerPool(2, MODEL, SAMPLER, bf16=False, timeout_s=120)
    drawn = iter(range(100))

    def draw():  # two prompts a step, two rollouts each
        keys = [next(drawn), next(drawn)]
        return [Job(q, q // 2, ([PROMPTS[q % 4]] * 2, [1000 + 2 * q, 1001 + 2 * q])) for q in keys]

    pipe = Pipeline(RayBackend(pool), Admission(batch=2, max_staleness=1), draw, timeout_s=120)
    try:
        def step(k):  # the weights do not change here: every snapshot holds the same ones
            pipe.publish(publisher.publish(policy.model.state_dict(), step=k))
            return pipe.take(k)[0]

        first = step(0)
        victim = ray.get(pool.actors[1].pid.remote())
        os.kill(victim, signal.SIGKILL)
        later = [step(1), step(2), step(3)]  # a regenerated group may be taken up to S = 1 step later
    finally:
        pipe.close()
        pool.close()
    groups = first + [g for taken in later for g in taken]
    keys = [job.key for job, _ in groups]
    assert len(keys) == len(set(keys)) == 8 and set(range(6)) <= set(keys)  # each once, none lost
    assert pipe.counters["restarts"] == 1 and pipe.counters["regenerated"] >= 1
    generator = TextGenerator(policy, tokenizer, **SAMPLER)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers run
    try:
        with torch.no_grad():
            expected = [generator.sample(*job.payload) for job, _ in groups]
    finally:
        torch.set_num_threads(threads)
    for (job, made), ref in zip(groups, expected):
        assert torch.equal(made.samples.sequences_BL, ref.sequences_BL)


def test_two_nodes_joined_by_address_share_snapshots_and_roll_out_alike(tmp_path):
    """A two-node cluster on one machine (ray.cluster_utils.Cluster), in a process of its own (this session's Ray
    is another cluster): workers on both nodes, the snapshot pulled across, the learner's rollouts; nothing left."""
    temp = Path(__import__("tempfile").mkdtemp(prefix="n", dir="/tmp"))  # Ray's sockets need a short path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("two_nodes.py"))], cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "RAY_TMPDIR": str(temp)},
                         capture_output=True, text=True, timeout=300)
    assert "NODES 2" in out.stdout and "OK" in out.stdout.split(), out.stdout + out.stderr[-3000:]
    assert not processes_mentioning(str(temp))


DRIVER = """
import sys, time
from dllm_rl.workers.ray_pool import start_ray
start_ray(None, num_cpus=1, temp_dir=sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_starter_leaves_no_ray_process_and_no_session_directory(tmp_path):
    """SIGKILL of the process that started a local Ray: its reaper ends the Ray processes that outlive it (the
    raylet's DashboardAgent and RuntimeEnvAgent stay about a minute on their own) and removes the session."""
    import time

    import psutil

    from dllm_rl.workers.reaper import uses

    session = Path(tempfile.mkdtemp(prefix="dllm-ray-", dir="/tmp"))  # Ray's sockets need a short path
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(session)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2], env=env)
    assert driver.stdout.readline().strip() == "ready"
    time.sleep(3)  # the agents are up
    agents = [p for p in psutil.process_iter() if uses(p, str(session)) and "Agent" in " ".join(p.cmdline())]
    assert agents  # what would outlive the driver
    driver.kill()
    _, err = driver.communicate()
    assert "Token authentication is enabled" not in err  # token auth on, said explicitly: no warning on every run
    deadline = time.time() + 20
    while time.time() < deadline and (session.exists() or any(p.is_running() for p in agents)):
        time.sleep(0.2)
    assert not session.exists() and not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in agents)
    assert not processes_mentioning(str(session))
