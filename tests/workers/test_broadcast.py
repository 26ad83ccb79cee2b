"""`workers.transport=broadcast` and `nccl` (dllm_rl/workers/broadcast.py): a snapshot sent by broadcasts arrives
whole (every dtype, every shape), passes its checksum, and a group that cannot form is a named error in bounded
time. One code path for both backends: gloo from host memory here, nccl from GPU to GPU where there are two GPUs
(marked gpu). The Ray workers' side is tested in test_ray_pool.py."""

import threading

import pytest
import torch

from dllm_rl.engine.dist import free_port
from dllm_rl.errors import ConfigError
from dllm_rl.workers.broadcast import BroadcastGroup, BroadcastReceiver, BroadcastSender, layout_of
from dllm_rl.workers.config import WorkersConfig
from dllm_rl.workers.errors import WorkersError
from dllm_rl.workers.versions import ChecksumMismatch, Publisher, Snapshot, load_verified


def members(size, timeout_s=30.0, backend="gloo", devices=None):
    """Rank 0 in this thread, ranks 1.. in threads (each on `devices[rank]`, default the CPU): the groups, in rank
    order."""
    port, groups, threads = free_port(), {}, []
    devices = devices or ["cpu"] * size
    for rank in range(1, size):
        threads.append(threading.Thread(target=lambda r=rank: groups.__setitem__(
            r, BroadcastGroup("127.0.0.1", port, r, size, timeout_s, backend, devices[r]))))
        threads[-1].start()
    groups[0] = BroadcastGroup("127.0.0.1", port, 0, size, timeout_s, backend, devices[0])
    for t in threads:
        t.join()
    return [groups[r] for r in range(size)]


BACKENDS = [("gloo", ["cpu", "cpu", "cpu"]),
            pytest.param("nccl", ["cuda:0", "cuda:1", "cuda:1"], marks=pytest.mark.gpu, id="nccl")]


@pytest.mark.parametrize("backend, devices", BACKENDS, ids=["gloo", "nccl"])
def test_a_published_snapshot_arrives_whole_at_every_receiver(backend, devices):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("nccl broadcasts between two GPUs (one process per GPU in a run; threads here)")
    g = torch.Generator().manual_seed(0)
    # cpu: drawn on the host, then placed where the learner's side of the group holds them
    state = {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
             "steps": torch.tensor([7, 8], dtype=torch.int64), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
             "big": torch.randn(300, 257, generator=g)}
    state = {k: v.to(devices[0]) for k, v in state.items()}
    groups = members(3, backend=backend, devices=devices)
    publisher = Publisher(BroadcastSender(groups[0]))
    snapshot = publisher.publish(state, step=4)
    got = {}
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, load_verified(BroadcastReceiver(groups[r]),
                                                                                      snapshot))) for r in (1, 2)]
    for t in threads:
        t.start()
    publisher.transport.send()
    for t in threads:
        t.join()
    for r in (1, 2):
        assert set(got[r]) == set(state)
        assert all(got[r][k].device == torch.device(devices[r]) for k in state)
        assert all(got[r][k].dtype == state[k].dtype and torch.equal(got[r][k].cpu(), state[k].cpu()) for k in state)
    assert snapshot.ref == layout_of(state) and publisher.transport.pending is None
    wrong = Snapshot(snapshot.version, snapshot.step, snapshot.ref, "00000000")
    threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, pytest.raises(
        ChecksumMismatch, load_verified, BroadcastReceiver(groups[r]), wrong))) for r in (1, 2)]
    publisher.transport.put(state)
    for t in threads:
        t.start()
    publisher.transport.send()
    for t in threads:
        t.join()
    assert all("the learner published 00000000" in str(got[r].value) for r in (1, 2))


def test_a_group_a_member_never_joins_is_a_named_error_in_bounded_time():
    with pytest.raises(WorkersError, match=r"the gloo broadcast group at 127.0.0.1:\d+ did not form \(rank 0 of 2"):
        BroadcastGroup("127.0.0.1", free_port(), 0, 2, timeout_s=2.0)


def test_broadcast_serves_synchronous_workers_only_by_name():
    for options in ({"max_staleness": 1, "sampler_correction": None}, {"pipe": True}):
        options.pop("sampler_correction", None)
        with pytest.raises(ConfigError, match="workers.transport=broadcast with .* a broadcast needs every worker"):
            WorkersConfig(count=2, transport="broadcast", **options)
    with pytest.raises(ConfigError, match="workers.transport='udp': expected one of"):
        WorkersConfig(count=2, transport="udp")
    with pytest.raises(ConfigError, match=r"workers.transport=nccl with pool\(s\) \['cpu'\] on the CPU"):
        WorkersConfig(transport="nccl", pools={"gpu": {"gpus": 1}, "cpu": {"count": 2}})
    WorkersConfig(transport="nccl", pools={"gpu": {"gpus": 1, "count": 2}})  # GPU workers: accepted


def test_a_group_on_the_wrong_device_for_its_backend_is_a_named_error():
    with pytest.raises(WorkersError, match="a gloo broadcast group on cuda:0: nccl moves GPU memory"):
        BroadcastGroup("127.0.0.1", free_port(), 0, 2, timeout_s=2.0, backend="gloo", device="cuda:0")
    with pytest.raises(WorkersError, match="a nccl broadcast group on cpu"):
        BroadcastGroup("127.0.0.1", free_port(), 0, 2, timeout_s=2.0, backend="nccl", device="cpu")
