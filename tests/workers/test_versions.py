"""Versioned policy snapshots (dllm_rl/workers/versions.py): the checksum sees every byte, name, shape and dtype;
versions only go up; only the last snapshots stay published; a corrupted snapshot is named when a worker loads it."""

import zlib

import pytest
import torch

from dllm_rl.workers.versions import ChecksumMismatch, InMemory, Publisher, checksum, load_verified


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
            "step": torch.tensor(7)}


def test_checksum_by_hand_for_one_tensor():
    t = torch.tensor([1.0, -2.0], dtype=torch.float32)
    expected = zlib.crc32(t.numpy().tobytes(), zlib.crc32(b"x|torch.float32|(2,)"))
    assert checksum({"x": t}) == f"{expected:08x}"


def test_checksum_sees_a_bit_a_name_a_shape_and_a_dtype():
    base = state()
    assert checksum(base) == checksum({k: v.clone() for k, v in reversed(list(base.items()))})  # order-free
    flipped = {**base, "b": base["b"].clone()}
    flipped["b"].view(torch.int16)[1] ^= 1  # one bit of one bf16 value
    renamed = {("w2" if k == "w" else k): v for k, v in base.items()}
    reshaped = {**base, "w": base["w"].reshape(3, 4)}
    retyped = {**base, "step": base["step"].to(torch.int32)}
    sums = {checksum(s) for s in (base, flipped, renamed, reshaped, retyped)}
    assert len(sums) == 5
    assert checksum({**base, "w": base["w"].t().contiguous().t()}) == checksum(base)  # strides do not matter


def test_versions_go_up_and_only_the_last_two_snapshots_stay_published():
    transport = InMemory()
    pub = Publisher(transport)
    snaps = [pub.publish(state(s), step=s) for s in range(4)]
    assert [s.version for s in snaps] == [1, 2, 3, 4] and pub.latest == snaps[-1]
    assert sorted(transport.store) == [snaps[2].ref, snaps[3].ref]
    with pytest.raises(KeyError, match="no longer published"):
        load_verified(transport, snaps[0])
    assert torch.equal(load_verified(transport, snaps[3])["w"], state(3)["w"])
    with pytest.raises(ValueError, match="publishing step 2 after step 3"):
        pub.publish(state(9), step=2)
    resumed = Publisher(InMemory(), **{"version": pub.state_dict()["policy_version"]})
    assert resumed.publish(state(5), step=5).version == 5


def test_a_corrupted_snapshot_is_named_when_loaded():
    transport = InMemory()
    snap = Publisher(transport).publish(state(), step=3)
    transport.store[snap.ref]["w"][0, 0] += 1e-3
    with pytest.raises(ChecksumMismatch, match=rf"policy version 1 \(step 3\).*published {snap.checksum}"):
        load_verified(transport, snap)
