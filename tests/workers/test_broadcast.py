"""`workers.transport=broadcast` (dllm_rl/workers/broadcast.py): a snapshot sent by one gloo broadcast arrives
whole (every dtype, every shape), passes its checksum, and a group that cannot form is a named error in bounded
time. The Ray workers' side is tested in test_ray_pool.py."""

import threading

import pytest
import torch

from dllm_rl.engine.dist import free_port
from dllm_rl.errors import ConfigError
from dllm_rl.workers.broadcast import BroadcastGroup, BroadcastReceiver, BroadcastSender, layout_of
from dllm_rl.workers.config import WorkersConfig
from dllm_rl.workers.errors import WorkersError
from dllm_rl.workers.versions import ChecksumMismatch, Publisher, Snapshot, load_verified


def members(size, timeout_s=30.0):
    """Rank 0 in this thread, ranks 1.. in threads: the groups, in rank order."""
    port, groups, threads = free_port(), {}, []
    for rank in range(1, size):
        threads.append(threading.Thread(target=lambda r=rank: groups.__setitem__(
            r, BroadcastGroup("127.0.0.1", port, r, size, timeout_s))))
        threads[-1].start()
    groups[0] = BroadcastGroup("127.0.0.1", port, 0, size, timeout_s)
    for t in threads:
        t.join()
    return [groups[r] for r in range(size)]


def test_a_published_snapshot_arrives_whole_at_every_receiver():
    g = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(3, 4, generator=g), "a.bias": torch.randn(5, generator=g).to(torch.bfloat16),
             "steps": torch.tensor([7, 8], dtype=torch.int64), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    groups = members(3)
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
        assert all(got[r][k].dtype == state[k].dtype and torch.equal(got[r][k], state[k]) for k in state)
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
    with pytest.raises(WorkersError, match=r"the broadcast group at 127.0.0.1:\d+ did not form \(rank 0 of 2"):
        BroadcastGroup("127.0.0.1", free_port(), 0, 2, timeout_s=2.0)


def test_broadcast_serves_synchronous_workers_only_by_name():
    for options in ({"max_staleness": 1, "sampler_correction": None}, {"pipe": True}):
        options.pop("sampler_correction", None)
        with pytest.raises(ConfigError, match="workers.transport=broadcast with .* a broadcast needs every worker"):
            WorkersConfig(count=2, transport="broadcast", **options)
    with pytest.raises(ConfigError, match="workers.transport='nccl': expected one of"):
        WorkersConfig(count=2, transport="nccl")
