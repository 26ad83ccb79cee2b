"""Data-parallel bookkeeping on fake ranks in one process: the collectives are replaced by what two ranks would
exchange, and each rank's share is checked against the single-process step (dllm_rl/data_parallel.py)."""

import pytest
import torch

from dllm_rl import data_parallel
from dllm_rl.buffer import minibatch_plan
from dllm_rl.data_parallel import DataParallel, Shard, rank_plan
from dllm_rl.engine import World
from dllm_rl.errors import ConfigError
from dllm_rl.likelihood.estimators import build_estimator

ESTIMATORS = {"on_policy": build_estimator({"name": "mean_field"}), "external": build_estimator({"name": "elbo"})}


@pytest.mark.parametrize("mix", ["stratified", "mixed"])
def test_rank_plans_split_the_single_process_plan(mix):
    """Two ranks holding on-policy rows 0-5 / 6-11 and external rows 0-1 / 2-4 together take exactly the rows
    of each single-process minibatch."""
    sizes = [12, 5]
    whole = minibatch_plan(sizes, 3, mix, torch.Generator().manual_seed(7))
    ranks = [rank_plan(sizes, starts, local, 3, mix, torch.Generator().manual_seed(7))
             for starts, local in (([0, 0], [6, 2]), ([6, 2], [6, 3]))]
    for k in range(3):
        for p in range(2):
            joined = torch.cat([ranks[0][k][p], ranks[1][k][p] + [6, 2][p]])
            assert sorted(joined.tolist()) == sorted(whole[k][p].tolist())
            assert all(len(r[k][p]) == 0 or int(r[k][p].max()) < n for r, n in zip(ranks, ([6, 2][p], [6, 3][p])))


def two_ranks(monkeypatch, fake_rows, external_counts):
    """Both fake ranks' sources after `shard_sources`, each rank seeing the gathered external row counts."""
    monkeypatch.setattr(data_parallel, "all_gather_objects", lambda obj, world: list(external_counts))
    out = []
    for rank, count in enumerate(external_counts):
        dp = DataParallel(World(rank, 2), prompts_per_step=4, group_size=3, minibatch_size=4)
        rows = {"on_policy": fake_rows("on_policy", 6, prompts=2)}
        if count:
            rows["external"] = fake_rows("external", count)
        dp.shard_sources(rows, ESTIMATORS)
        out.append((dp, rows))
    return out


@pytest.mark.parametrize("mix", ["stratified", "mixed"])
def test_two_fake_ranks_train_on_exactly_the_rows_of_each_single_process_minibatch(monkeypatch, make_rows, mix):
    ranks = two_ranks(monkeypatch, make_rows, [3, 2])
    assert [rows["on_policy"].shard for _, rows in ranks] == [Shard(0, 6, 12), Shard(6, 6, 12)]
    assert [rows["external"].shard for _, rows in ranks] == [Shard(0, 3, 5), Shard(3, 2, 5)]
    whole = minibatch_plan([12, 5], 3, mix, torch.Generator().manual_seed(1))  # 12 on-policy rows, minibatches of 4
    plans = [dp.minibatch_plan(list(rows.values()), mix, torch.Generator().manual_seed(1)) for dp, rows in ranks]
    for k in range(3):
        for p, source in enumerate(("on_policy", "external")):
            joined = [int(i) + rows[source].shard.start for (dp, rows), plan in zip(ranks, plans) for i in plan[k][p]]
            assert sorted(joined) == sorted(whole[k][p].tolist())


def test_a_rank_without_rows_of_a_source_others_have_scores_a_stand_in(monkeypatch, make_rows):
    _, (dp1, rows1) = two_ranks(monkeypatch, make_rows, [3, 0])
    stand_in = rows1["external"]
    assert stand_in.inert and len(stand_in) == 1 and stand_in.shard == Shard(3, 0, 3)
    assert stand_in.mask_NC.sum() == 0 and stand_in.weight_N.tolist() == [0.0] and stand_in.adv_N.tolist() == [0.0]
    assert stand_in.estimator is ESTIMATORS["external"] and dp1.pads
    for picks in dp1.minibatch_plan(list(rows1.values()), "stratified", torch.Generator().manual_seed(0)):
        assert len(picks[1]) == 0  # it never takes part in the plan: loss_inputs pads it in (mask 0)
    _, (_, alone) = two_ranks(monkeypatch, make_rows, [0, 0])
    assert "external" not in alone  # no rank has external rows: no stand-in either


def test_one_process_needs_no_collective(make_rows, monkeypatch):
    import torch.distributed as dist

    def collective(*args, **kwargs):
        raise AssertionError("a collective was called in a world of one process")

    for name in ("all_gather_object", "all_reduce", "all_gather", "broadcast_object_list", "broadcast", "barrier",
                 "reduce_scatter"):
        monkeypatch.setattr(dist, name, collective)
    dp = DataParallel(World(), prompts_per_step=2, group_size=2, minibatch_size=2)
    rows = {"on_policy": make_rows("on_policy", 4, prompts=2)}
    dp.shard_sources(rows, ESTIMATORS)
    assert rows == {"on_policy": rows["on_policy"]} and rows["on_policy"].shard == Shard(0, 4, 4)
    assert dp.local_prompts(["a", "b"]) == (["a", "b"], 0) and not dp.pads and dp.num_minibatches == 2
    assert dp.total(3.0) == 3.0 and dp.any(True) and not dp.any(False) and dp.widest(7) == 7


def test_shares_must_be_whole_groups_and_minibatches_fit_a_rank():
    with pytest.raises(ConfigError, match="prompts_per_step=3 must be divisible by the number of ranks"):
        DataParallel(World(0, 2), prompts_per_step=3, group_size=2, minibatch_size=4)
    with pytest.raises(ConfigError, match="minibatch_size=1 makes 8 minibatches per inner iteration, but a rank "
                                          "holds 4 rollouts; use minibatch_size >= 2"):
        DataParallel(World(0, 2), prompts_per_step=4, group_size=2, minibatch_size=1)
