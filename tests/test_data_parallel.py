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
    of each single-process minibatch, in its order."""
    sizes = [12, 5]
    whole = minibatch_plan(sizes, 3, mix, torch.Generator().manual_seed(7))
    positions = [[range(0, 6), range(0, 2)], [range(6, 12), range(2, 5)]]
    ranks = [rank_plan(sizes, mine, 3, mix, torch.Generator().manual_seed(7)) for mine in positions]
    for k in range(3):
        for p in range(2):
            joined = [positions[r][p][i] for r in range(2) for i in ranks[r][k][p].tolist()]
            assert sorted(joined) == sorted(whole[k][p].tolist())
            for r in range(2):  # each rank's rows come in the order the single-process minibatch has them
                mine = [positions[r][p][i] for i in ranks[r][k][p].tolist()]
                assert mine == [i for i in whole[k][p].tolist() if i in positions[r][p]]


def fake_gather(monkeypatch, keys_by_rank):
    """all_gather_objects as two ranks would answer it: the n-th call of a rank gets every rank's n-th object
    (here: the keys of one source per call, on_policy first)."""
    calls = {"n": 0}

    def gather(obj, world):
        source = calls["n"] % len(keys_by_rank[0])
        calls["n"] += 1
        return [ranks[source] for ranks in keys_by_rank]

    monkeypatch.setattr(data_parallel, "all_gather_objects", gather)
    return calls


def keyed(rows, prompt_ids, rollouts=None):
    rows.prompt_id_N = torch.tensor(prompt_ids)
    if rollouts is not None:
        rows.rollout_N = torch.tensor(rollouts)
    return rows


def two_ranks(monkeypatch, fake_rows, external_counts):
    """Both fake ranks' sources after `shard_sources`: on-policy prompts 0, 1 on rank 0 and 2, 3 on rank 1
    (3 rollouts each); each rank's external rows belong to its first prompt."""
    made = []
    for rank, count in enumerate(external_counts):
        rows = {"on_policy": keyed(fake_rows("on_policy", 6, prompts=2), [2 * rank] * 3 + [2 * rank + 1] * 3)}
        if count:
            rows["external"] = keyed(fake_rows("external", count), [2 * rank] * count)
        made.append(rows)
    fake_gather(monkeypatch, [[rows[s].keys if s in rows else [] for s in ESTIMATORS] for rows in made])
    out = []
    for rank, rows in enumerate(made):
        dp = DataParallel(World(rank, 2), prompts_per_step=4, group_size=3, minibatch_size=4)
        dp.shard_sources(rows, ESTIMATORS)
        out.append((dp, rows))
    return out


@pytest.mark.parametrize("mix", ["stratified", "mixed"])
def test_two_fake_ranks_train_on_exactly_the_rows_of_each_single_process_minibatch(monkeypatch, make_rows, mix):
    ranks = two_ranks(monkeypatch, make_rows, [3, 2])
    assert [rows["on_policy"].shard for _, rows in ranks] == [Shard(tuple(range(6)), 12),
                                                              Shard(tuple(range(6, 12)), 12)]
    assert [rows["external"].shard for _, rows in ranks] == [Shard((0, 1, 2), 5), Shard((3, 4), 5)]
    whole = minibatch_plan([12, 5], 3, mix, torch.Generator().manual_seed(1))  # 12 on-policy rows, minibatches of 4
    plans = [dp.minibatch_plan(list(rows.values()), mix, torch.Generator().manual_seed(1)) for dp, rows in ranks]
    for k in range(3):
        for p, source in enumerate(("on_policy", "external")):
            joined = [rows[source].shard.index_N[int(i)] for (dp, rows), plan in zip(ranks, plans) for i in plan[k][p]]
            assert sorted(joined) == sorted(whole[k][p].tolist())


@pytest.mark.parametrize("mix", ["stratified", "mixed"])
def test_uneven_interleaved_rows_take_their_key_order_places(monkeypatch, make_rows, mix):
    """Ranks holding 5 and 2 on-policy rows whose keys interleave (as rounds of dynamic sampling leave them):
    every row's global position is its key's rank among all keys, and the ranks' minibatches are the
    single-process ones over the rows sorted by key."""
    r0 = keyed(make_rows("on_policy", 5), [0, 0, 0, 5, 9], [0, 2, 3, 0, 1])  # prompt 0 lost its rollout 1
    r1 = keyed(make_rows("on_policy", 2), [3, 3], [1, 0])  # in any order on the rank
    fake_gather(monkeypatch, [[r0.keys, []], [r1.keys, []]])
    shards = []
    for rank, rows in enumerate((r0, r1)):
        dp = DataParallel(World(rank, 2), prompts_per_step=4, group_size=2, minibatch_size=3)
        mine = {"on_policy": rows}
        dp.shard_sources(mine, ESTIMATORS)
        shards.append((dp, rows))
    # all keys sorted: (0,0) (0,2) (0,3) (3,0) (3,1) (5,0) (9,1)
    assert r0.shard == Shard((0, 1, 2, 5, 6), 7) and r1.shard == Shard((4, 3), 7)
    whole = minibatch_plan([7], 3, mix, torch.Generator().manual_seed(4))
    plans = [dp.minibatch_plan([rows], mix, torch.Generator().manual_seed(4)) for dp, rows in shards]
    for k in range(3):
        joined = [rows.shard.index_N[int(i)] for (_, rows), plan in zip(shards, plans) for i in plan[k][0]]
        assert sorted(joined) == sorted(whole[k][0].tolist())


def test_duplicate_keys_are_an_error(monkeypatch, make_rows):
    rows = keyed(make_rows("on_policy", 2), [4, 4], [1, 1])
    with pytest.raises(ConfigError, match=r"duplicate keys .*\(4, 1\)"):
        DataParallel(World(), 2, 2, 2).shard_sources({"on_policy": rows}, ESTIMATORS)


def test_a_rank_without_rows_of_a_source_others_have_scores_a_stand_in(monkeypatch, make_rows):
    _, (dp1, rows1) = two_ranks(monkeypatch, make_rows, [3, 0])
    stand_in = rows1["external"]
    assert stand_in.inert and len(stand_in) == 1 and stand_in.shard == Shard((), 3)
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
    assert rows == {"on_policy": rows["on_policy"]} and rows["on_policy"].shard == Shard((0, 1, 2, 3), 4)
    assert dp.assign([2, 2]) == range(0, 2) and not dp.pads and dp.num_minibatches == 2
    assert dp.total(3.0) == 3.0 and dp.any(True) and not dp.any(False) and dp.widest(7) == 7


def test_prompts_go_to_ranks_in_runs_balanced_by_rollouts():
    """Equal groups split as equal prompt runs (any prompts_per_step); uneven ones by rollouts; a rank may get
    none; every prompt goes to exactly one rank, in order."""
    from dllm_rl.data_parallel import balanced_runs

    assert balanced_runs([2] * 4, 2) == [range(0, 2), range(2, 4)]
    assert balanced_runs([2] * 3, 2) == [range(0, 1), range(1, 3)]  # 3 prompts on 2 ranks: a middle group goes on
    assert balanced_runs([8, 1, 1, 1, 1], 2) == [range(0, 1), range(1, 5)]
    assert balanced_runs([0, 3, 0], 2) == [range(0, 1), range(1, 3)]  # rank 0: only a prompt without rollouts
    assert balanced_runs([0, 0], 2) == [range(0), range(0)]
    for counts in ([1, 5, 2, 0, 7, 3], [4] * 7, [1], [0, 9, 9, 0, 1]):
        for ranks in (1, 2, 3, 4):
            runs = balanced_runs(counts, ranks)
            assert [i for r in runs for i in r if counts[i] > 0] == [i for i, n in enumerate(counts) if n > 0]
            assert all(r.start >= s.stop for s, r in zip(runs, runs[1:]) if len(r) and len(s))


def test_a_step_with_more_rows_than_its_budget_is_an_error(make_rows):
    dp = DataParallel(World(), prompts_per_step=2, group_size=2, minibatch_size=2)
    rows = {"on_policy": make_rows("on_policy", 6, prompts=3)}
    dp.shard_sources(rows, ESTIMATORS)
    with pytest.raises(ConfigError, match="6 on-policy rows, more than prompts_per_step"):
        dp.minibatch_plan(list(rows.values()), "stratified", torch.Generator())
