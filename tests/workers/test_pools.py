"""Heterogeneous rollout-worker pools (`workers.pools`): each pool's workers decode with its own settings and
roll out exactly what the learner's sampler does with them; a synchronous step's groups are shared by the pools'
throughput figures (hand-computed); the per-pool metrics (hand-computed, and from real runs); a pool that cannot
start is named; the plan's `workers.pools` override parses back to the plan; which pool changes a resume may make."""

import json
import shlex
import time
from dataclasses import dataclass

import pytest
import torch

from dllm_rl import cli
from dllm_rl.checkpoint import latest_checkpoint
from dllm_rl.errors import ConfigError
from dllm_rl.resume import config_changes, run_changing
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.train import train
from dllm_rl.workers.config import PoolConfig, WorkersConfig
from dllm_rl.workers.pools import assign_groups, pool_metrics, worker_weights
from dllm_rl.workers.ray_pool import RayStore, WorkerPool, WorkersError, worker_device
from dllm_rl.workers.remote import split_groups
from dllm_rl.workers.versions import Publisher
from tests.conftest import DigitShare
from tests.test_train import SMALL, weights
from tests.workers.test_ray_pool import MODEL, PROMPTS, SAMPLER, perturbed_policy
from tests.workers.test_remote_training import metrics_of, one_thread


def keys_of(sizes: list[int]) -> list[tuple[int, int, int]]:
    return [(b, 10 + b, g) for b, n in enumerate(sizes) for g in range(n)]


def test_groups_are_shared_by_the_throughput_figures():
    keys = keys_of([4, 4, 4, 4])  # 16 rollouts; group middles at 2, 6, 10, 14 of 16
    # weights 3 : 1 -> the first share ends at 12 of 16: the middles 2, 6, 10 fall in it, 14 does not
    assert assign_groups(keys, [3.0, 1.0]) == [list(range(0, 12)), list(range(12, 16))]
    # 1 : 3 -> the first share ends at 4: only the middle at 2
    assert assign_groups(keys, [1.0, 3.0]) == [list(range(0, 4)), list(range(4, 16))]
    # a worker too slow for a whole group gets none, and keeps its place in the list
    assert assign_groups(keys, [10.0, 0.1, 10.0]) == [list(range(0, 8)), [], list(range(8, 16))]
    # equal weights are the even split of alike workers
    assert split_groups(keys_of([4, 4, 2, 6]), 3) == [list(range(0, 4)), list(range(4, 10)), list(range(10, 16))]
    pools = WorkersConfig(pools={"fast": {"count": 2, "throughput": 3}, "slow": {"count": 1, "throughput": 1}})
    assert worker_weights(pools.pool_list()) == [3, 3, 1]
    assert worker_weights(WorkersConfig(count=2).pool_list()) == [1.0, 1.0]


@dataclass
class Made:  # what a worker returns, as far as the metrics read it
    pool: str
    seconds: float
    samples: object


def made(pool: str, rollouts: int, seconds: float) -> Made:
    return Made(pool, seconds, type("S", (), {"sequences_BL": torch.zeros(rollouts, 3)})())


def test_pool_metrics_by_hand():
    pools = [PoolConfig("fast", count=2), PoolConfig("slow", count=1), PoolConfig("idle", count=1)]
    got = pool_metrics([(made("fast", 8, 2.0), 0), (made("fast", 4, 2.0), 1), (made("slow", 4, 4.0), 1)], pools,
                       period_s=5.0)
    assert got == {"pool/fast/rollouts": 12.0, "pool/fast/utilisation": 4.0 / (2 * 5.0),
                   "pool/fast/throughput": 12 / 4.0, "pool/fast/lag_mean": 0.5,
                   "pool/slow/rollouts": 4.0, "pool/slow/utilisation": 4.0 / 5.0, "pool/slow/throughput": 1.0,
                   "pool/slow/lag_mean": 1.0,
                   "pool/idle/rollouts": 0.0, "pool/idle/utilisation": 0.0}


def test_pools_inherit_the_group_settings_and_bad_ones_are_named():
    pools = WorkersConfig(threads=2, cpus=0.5, pools={"a": {"count": 2}, "b": {"threads": 1}}).pool_list()
    assert [(p.name, p.count, p.threads, p.cpus) for p in pools] == [("a", 2, 2, 0.5), ("b", 1, 1, 0.5)]
    assert WorkersConfig(pools={"a": {}, "b": {"count": 3}}).size == 4 and WorkersConfig().size == 0
    for pools, message in (({"a": {"count": 1, "sampler": {"steps": 4}}}, r"\['steps'\] cannot differ"),
                           ({"a": {"gpus": -1}}, "workers.pools.a.gpus=-1"),
                           ({"a": {"throughput": 0}}, "workers.pools.a.throughput=0"),
                           ({"a b": {}}, "pool name 'a b'")):
        with pytest.raises(ConfigError, match=message):
            WorkersConfig(pools=pools)


def test_a_worker_asked_for_a_gpu_it_does_not_have_is_named():
    if torch.cuda.is_available():
        assert worker_device("cuda", "gpu") == torch.device("cuda", 0)
    else:
        with pytest.raises(WorkersError, match="workers.pools.gpu.device=cuda, but its worker .* no usable CUDA"):
            worker_device("cuda", "gpu")
    assert worker_device("cpu", "x") == torch.device("cpu")


def test_the_plan_applies_as_workers_pools(tmp_path, capsys):
    kinds = ("kinds={cpu: {throughput: 1.5, price: 0.1, max_count: 32, pool: {sampler: {threshold: 0.9}}}, "
             "h100: {throughput: 40, price: 2.5, max_count: 4, pool: {gpus: 1, device: cuda}}}")
    out = tmp_path / "plan.json"
    assert cli.main(["plan", "train_s=5", "publish_s=0.5", "max_staleness=2", "target_utilisation=0.9", kinds,
                     f"json={out}"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("apply it: dllm-rl train "))
    pools = {"cpu": {"count": 6, "throughput": 1.5, "price": 0.1, "sampler": {"threshold": 0.9}}}
    assert json.loads(out.read_text())["pools"] == pools
    assert line.endswith("workers.max_staleness=2")  # sampler_correction.mode=auto turns the correction on
    overrides = shlex.split(line)[4:]  # as a shell passes them
    cfg = cli.to_plain(cli.compose_config("train", overrides))
    assert cfg["workers"]["pools"] == pools
    assert WorkersConfig(**cfg["workers"]).size == 6


def test_a_resume_may_move_alike_pools_but_not_change_how_one_decodes():
    def changes(old, new):
        saved, asked = {"workers": {"count": 0, "pools": old}}, {"workers": {"count": 0, "pools": new}}
        return run_changing(config_changes(saved, asked), asked)

    assert changes({"a": {"count": 2}}, {"a": {"count": 1}, "b": {"count": 3, "device": "cpu"}}) == {}
    assert changes(None, {"a": {"count": 2}}) == {}
    assert changes({"a": {"count": 1}}, {"a": {"count": 1, "sampler": {"threshold": 0.9}}})
    # with a pool that decodes otherwise, which pool a group goes to decides its rollouts
    assert changes({"a": {"count": 1, "sampler": {"threshold": 0.9}}, "b": {"count": 1}},
                   {"a": {"count": 2, "sampler": {"threshold": 0.9}}, "b": {"count": 1}})


@pytest.mark.slow
def test_each_pool_rolls_out_what_its_settings_give_in_process(ray_session):
    policy, tokenizer = perturbed_policy(seed=3)
    snapshot = Publisher(RayStore()).publish(policy.model.state_dict(), step=2)
    # threshold 0.2: on these arithmetic prompts, which the embedded dLLM never saw, few tokens pass 0.5 (9 forwards
    # against the exact schedule's 8); at 0.2 the fast pool decodes in 6
    pools = WorkersConfig(pools={"exact": {"count": 1}, "fast": {"count": 1, "sampler": {"threshold": 0.2}}})
    pool = WorkerPool(pools.pool_list(), MODEL, SAMPLER, bf16=False, timeout_s=120)
    chunk = (PROMPTS, [21, 22, 23, 24])
    try:
        pool.load(snapshot)
        exact, fast = pool.generate([chunk, chunk], workers=[0, 1])
    finally:
        pool.close()
    with torch.no_grad():  # on one thread, as the workers run
        ref_exact = one_thread(TextGenerator(policy, tokenizer, **SAMPLER).sample, *chunk)
        ref_fast = one_thread(TextGenerator(policy, tokenizer, **SAMPLER, threshold=0.2).sample, *chunk)
    assert (exact.pool, fast.pool) == ("exact", "fast") and exact.seconds > 0 and fast.seconds > 0
    assert torch.equal(exact.samples.sequences_BL, ref_exact.sequences_BL)
    assert torch.equal(fast.samples.sequences_BL, ref_fast.sequences_BL)
    assert fast.samples.forwards == ref_fast.forwards < exact.samples.forwards == ref_exact.forwards


@pytest.mark.slow
def test_a_pool_that_cannot_start_is_named_and_leaves_no_worker(ray_session):
    import ray

    before = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(WorkersError, match=r"pool 'gpu' failed to start: it did not start within 10 s .*1 GPUs"):
        WorkerPool([PoolConfig("cpu", count=1), PoolConfig("gpu", count=1, gpus=1)], MODEL, SAMPLER, bf16=False,
                   timeout_s=10)
    with pytest.raises(WorkersError, match=r"pool 'cpu' failed to start: .*nonexistent"):
        WorkerPool([PoolConfig("cpu", count=1)], "/nonexistent/model", SAMPLER, bf16=False, timeout_s=60)
    assert len(ray.util.list_named_actors(all_namespaces=True)) == before
    deadline = time.time() + 30  # Ray returns a killed actor's CPU a moment later
    while ray.available_resources().get("CPU", 0) < ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == ray.cluster_resources()["CPU"]  # every worker stopped


POOLS = {"fast": {"count": 1, "throughput": 3, "sampler": {"threshold": 0.9}}, "exact": {"count": 1, "throughput": 1}}


@pytest.mark.slow
def test_training_with_pools_shares_the_groups_and_logs_each_pool(ray_session, saved_model, tmp_path):
    run = tmp_path / "run"
    options = dict(SMALL, model=saved_model, steps=2, checkpoint_every=2, bf16=False, prompts_per_step=4,
                   minibatch_size=16)
    train(DigitShare(), run_dir=str(run), workers={"pools": POOLS, "timeout_s": 120}, **options)
    for m in metrics_of(run):
        # 4 groups of 4, shared 3 : 1 -> the first three groups on the fast pool (see the hand-computed split)
        assert (m["pool/fast/rollouts"], m["pool/exact/rollouts"]) == (12.0, 4.0)
        assert m["pool/fast/lag_mean"] == m["pool/exact/lag_mean"] == 0.0
        for name in POOLS:
            assert 0 < m[f"pool/{name}/utilisation"] <= 1 and m[f"pool/{name}/throughput"] > 0


@pytest.mark.slow
def test_alike_pools_of_any_shares_train_as_in_process(ray_session, saved_model, tmp_path):
    """Pools that decode alike, shared 3 : 1: the rows come back in prompt order whoever made them, so the run
    equals in-process rollouts (the same weights after 2 steps)."""
    options = dict(SMALL, model=saved_model, steps=2, checkpoint_every=2, bf16=False, prompts_per_step=4,
                   minibatch_size=16)
    one_thread(train, DigitShare(), run_dir=str(tmp_path / "local"), **options)
    alike = {"a": {"count": 1, "throughput": 3}, "b": {"count": 1, "throughput": 1}}
    one_thread(train, DigitShare(), run_dir=str(tmp_path / "pools"), workers={"pools": alike, "timeout_s": 120},
               **options)
    a, b = weights(latest_checkpoint(tmp_path / "local")), weights(latest_checkpoint(tmp_path / "pools"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [m["pool/a/rollouts"] for m in metrics_of(tmp_path / "pools")] == [12.0, 12.0]


@pytest.mark.slow
def test_asynchronous_pools_log_each_pool_within_the_bound(ray_session, saved_model, tmp_path):
    run = tmp_path / "run"
    train(DigitShare(), model=saved_model, run_dir=str(run), workers={"pools": POOLS, "max_staleness": 1,
                                                                       "timeout_s": 120},
          **dict(SMALL, steps=3, checkpoint_every=3, bf16=False, sampler_correction={"mode": "weight", "cap": 2.0}))
    lines = metrics_of(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert m["pool/fast/rollouts"] + m["pool/exact/rollouts"] == 2 * 4  # each group from one worker
        assert all(0 <= m.get(f"pool/{n}/lag_mean", 0) <= 1 for n in POOLS) and m["rollout/lag_violations"] == 0
    assert sum(m["pool/fast/rollouts"] for m in lines) > 0 and sum(m["pool/exact/rollouts"] for m in lines) > 0
