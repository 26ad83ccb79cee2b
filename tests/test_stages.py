"""Each stage of the RL step alone, on a tiny model or hand-made rows (dllm_rl/collect.py, dllm_rl/stages.py)."""

import contextlib
import dataclasses

import pytest
import torch

from dllm_rl.data import build_task
from dllm_rl.data_parallel import DataParallel, Shard
from dllm_rl.engine import Engine, World, deepspeed_config, init_distributed
from dllm_rl.external.mixer import ExternalMixer, MixingConfig
from dllm_rl.external.sources import SolverSource
from dllm_rl.likelihood.estimators import build_estimator
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.seeds import derive_seed
from dllm_rl.collect import InProcessRollouts, PromptSource, StepBatch, merge_batches, verify
from dllm_rl.learner import Learner
from dllm_rl.stages import assign_advantages, score_old_and_reference, step_metrics

ARITHMETIC = build_task("arithmetic")
MEAN_FIELD = build_estimator({"name": "mean_field"})
ONE = World()


def batch_of(examples, first_id=0, step=3, sizes=None):
    """A batch of `examples` whose prompt ids start at `first_id`, `sizes` rollouts each (2 by default)."""
    n = len(examples)
    return StepBatch(step, list(examples), [ARITHMETIC.prompt(ex) for ex in examples],
                     list(range(first_id, first_id + n)), list(sizes or [2] * n))


def test_prompt_sources_give_each_rank_its_whole_groups_of_the_single_process_prompts(char_tokenizer):
    single = PromptSource(ARITHMETIC, char_tokenizer, DataParallel(ONE, 4, 2, 8), per_step=4, pool=6, seed=1)
    ranks = [PromptSource(ARITHMETIC, char_tokenizer, DataParallel(World(r, 2), 4, 2, 8), per_step=4, pool=6, seed=1)
             for r in range(2)]
    for step in range(3):  # 12 prompts from a pool of 6: two epochs, each a permutation of the pool
        drawn = single(step)
        whole = single.batch(step, drawn, [2] * 4)
        parts = [source.batch(step, source(step), [2] * 4) for source in ranks]
        assert [p.prompt_ids for p in parts] == [[4 * step, 4 * step + 1], [4 * step + 2, 4 * step + 3]]
        assert whole.prompt_ids == [d.prompt_id for d in drawn] == list(range(4 * step, 4 * step + 4))
        assert parts[0].examples + parts[1].examples == whole.examples
        assert parts[1].prompt_texts == [ARITHMETIC.prompt(ex) for ex in whole.examples[2:]]
        assert [single.examples[i] for i in whole.example_ids] == whole.examples
    assert single.position == ranks[1].position == 12
    single.position = 0
    first_epoch = single.draw(6)
    assert sorted(d.example_id for d in first_epoch) == list(range(6))
    assert sorted(d.example.uid for d in first_epoch) == sorted(ex.uid for ex in single.examples)


def test_uneven_allocations_split_over_ranks_by_rollouts(char_tokenizer):
    """Prompts with 0 rollouts are left out; the rest go to ranks in contiguous runs balanced by rollouts, and
    together the ranks hold the single-process batch."""
    sources = [PromptSource(ARITHMETIC, char_tokenizer, DataParallel(World(r, 2), 4, 2, 8), per_step=5, pool=6,
                            seed=1) for r in range(2)]
    counts = [6, 0, 1, 1, 4]  # 12 rollouts: the first prompt's group is rank 0's share
    parts = [source.batch(0, source(0), counts) for source in sources]
    assert [p.prompt_ids for p in parts] == [[0], [2, 3, 4]] and [p.group_sizes for p in parts] == [[6], [1, 1, 4]]
    assert all(p.template == parts[0].template != "" for p in parts)
    lone = [PromptSource(ARITHMETIC, char_tokenizer, DataParallel(World(r, 2), 4, 2, 8), per_step=3, pool=6,
                         seed=1) for r in range(2)]
    parts = [source.batch(0, source(0), [0, 3, 0]) for source in lone]  # one group: the other rank gets none
    assert [p.prompt_ids for p in parts] == [[], [1]] and parts[0].examples == []


def test_rollouts_draw_each_row_from_its_global_seed_whatever_the_batch(tiny_policy, char_tokenizer):
    generator = TextGenerator(tiny_policy, char_tokenizer, gen_length=8, block_length=8, steps=4, temperature=1.0)
    rollouts = InProcessRollouts(generator, MEAN_FIELD, seed=5, inference=contextlib.nullcontext)
    examples = ARITHMETIC.examples("train", 2, 0)
    whole = rollouts(batch_of(examples))
    second = rollouts(batch_of(examples[1:], first_id=1))  # what a second rank holding prompt 1 generates
    assert torch.equal(second.ids_NL[:, -8:], whole.ids_NL[2:, -8:])
    assert whole.prompt_N.tolist() == [0, 0, 1, 1] and whole.version == 3 and whole.rewards == []
    assert whole.keys == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # another prompt's group size changes no rollout: prompt 0 gets 3 then 1, prompt 1 keeps its 2
    for sizes in ([3, 2], [1, 2], [0, 2]):
        ragged = rollouts(batch_of(examples, sizes=sizes))
        assert ragged.keys == [(q, g) for q, n in enumerate(sizes) for g in range(n)]
        for n, key in enumerate(ragged.keys):
            if key in whole.keys:
                assert torch.equal(ragged.ids_NL[n, -8:], whole.ids_NL[whole.keys.index(key), -8:]), (sizes, key)
    third = rollouts(batch_of(examples, sizes=[3, 2])).ids_NL[2, -8:]  # rollout (0, 2): a draw of its own
    assert not any(torch.equal(third, row) for row in whole.ids_NL[:, -8:])
    assert whole.source == "on_policy" and whole.estimator is MEAN_FIELD and whole.order_NC.shape == (4, 8)
    eos = whole.ids_NL[:, -8:] == tiny_policy.eos_id
    for n in range(4):  # the mask counts up to and including the first EOS; the text stops before it
        end = int(eos[n].int().argmax()) if eos[n].any() else 7
        assert whole.mask_NC[n].tolist() == [1.0] * (end + 1) + [0.0] * (7 - end)
    other_step = rollouts(batch_of(examples, step=4))
    assert not torch.equal(other_step.ids_NL, whole.ids_NL)


def test_verify_scores_every_source_with_the_task_reward(make_rows):
    examples = ARITHMETIC.examples("train", 2, 0)
    batch = batch_of(examples)
    right, wrong = (f"<answer>{examples[1].answer}</answer>", "<answer>-1</answer>")
    batch.rows["on_policy"] = make_rows("on_policy", 4, prompts=2, texts=["", wrong, right, wrong])
    batch.rows["external"] = make_rows("external", 1, texts=[f"<answer>{examples[0].answer}</answer>"])
    verify(batch, ARITHMETIC)
    assert [r.correct for r in batch.rows["on_policy"].rewards] == [False, False, True, False]
    assert batch.rows["on_policy"].rewards[0].reason != "ok" and batch.rows["external"].rewards[0].correct


def scored(rows, rewards):
    from dllm_rl.data.task import Reward

    rows.rewards = [Reward(float(r), r == 1, True, "ok") for r in rewards]
    return rows


def test_advantages_from_hand_made_rewards(make_rows):
    batch = batch_of(ARITHMETIC.examples("train", 2, 0))
    batch.rows["on_policy"] = scored(make_rows("on_policy", 8, prompts=2), [1, 0, 0, 1, 0, 0, 0, 0])
    assign_advantages(batch, "mean", None, DataParallel(ONE, 2, 4, 8))
    assert batch.rows["on_policy"].adv_N.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    # ERILS, separate processing with a constant statistic: external rows get constant * reward and the loss
    # weight; the on-policy advantages are the same as without them
    mixer = ExternalMixer(SolverSource(), MixingConfig(constant=2.0, weight=0.5), MEAN_FIELD)
    batch.rows["external"] = scored(make_rows("external", 2, prompts=2), [1, 1])
    assign_advantages(batch, "mean", mixer, DataParallel(ONE, 2, 4, 8))
    assert batch.rows["on_policy"].adv_N.tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    assert batch.rows["external"].adv_N.tolist() == [2.0, 2.0] and batch.rows["external"].weight_N.tolist() == [0.5] * 2


def test_old_and_reference_log_probs_are_scored_under_the_stored_mask_seeds(make_rows, tiny_policy):
    batch = batch_of(ARITHMETIC.examples("train", 1, 0))
    on, ext = make_rows("on_policy", 2), make_rows("external", 3, estimator=build_estimator({"name": "elbo"}))
    on.shard, ext.shard = Shard((4, 5), 8), Shard((1, 2, 3), 5)  # rows 4-5 and 1-3 of all ranks' rows
    on.prompt_id_N = torch.tensor([7, 7])  # keys (7, 0), (7, 1): the seeds follow them, not the shard
    batch.rows.update(on_policy=on, external=ext)
    score_old_and_reference(batch, tiny_policy, tiny_policy, iterations=2, reuse_current=False, seed=9,
                            autocast=contextlib.nullcontext())
    assert on.mask_seeds == [[derive_seed(9, "mask", 3, it, 7, g) for g in range(2)] for it in range(2)]
    assert ext.mask_seeds[1] == [derive_seed(9, "mask", 3, 1, "external", 0, g) for g in range(3)]
    for rows in (on, ext):
        for it in range(2):  # the reference here is the policy itself: the same masks give the same values
            assert torch.equal(rows.old_logp[it], rows.ref_logp[it])
            assert torch.equal(rows.old_logp[it], rows.score_all(tiny_policy, it))
    assert ext.old_logp[0].shape == (3, 1)  # the ELBO is scored per sequence
    assert not torch.equal(ext.old_logp[0], ext.old_logp[1])  # a fresh mask per inner iteration
    score_old_and_reference(batch, tiny_policy, None, iterations=1, reuse_current=True, seed=9,
                            autocast=contextlib.nullcontext())
    assert on.old_logp == [None] and on.ref_logp == [None]  # the update reuses the current log-probs


@pytest.fixture
def learner(tiny_policy):
    world = init_distributed()
    net = tiny_policy.model.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    engine = Engine(net, optimizer, world, deepspeed_config(stage=0, micro_batch_size=4))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 ** s)
    dp = DataParallel(world, 2, 2, 4)
    return Learner(engine, dataclasses.replace(tiny_policy, model=engine.ds), None, scheduler,
                   {"eps_low": 0.2, "eps_high": 0.2}, iterations=2, reuse_current=False, minibatch_mix="stratified",
                   seed=0, dp=dp, autocast=contextlib.nullcontext())


# two prompts of two rollouts each: a group with equal rewards has no signal
@pytest.mark.parametrize("rewards, updates", [([1, 0, 0, 0], 2.0), ([0, 1, 1, 0], 2.0), ([1, 1, 0, 0], 0.0),
                                              ([1, 1, 1, 1], 0.0)])
def test_the_learner_updates_once_per_minibatch_when_there_is_a_signal(learner, make_rows, rewards, updates):
    batch = batch_of(ARITHMETIC.examples("train", 2, 0))
    batch.rows["on_policy"] = scored(make_rows("on_policy", 4, prompts=2), rewards)
    assign_advantages(batch, "mean", None, learner.dp)
    learner.dp.shard_sources(batch.rows, {"on_policy": MEAN_FIELD})
    score_old_and_reference(batch, learner.policy, None, 2, False, 0, contextlib.nullcontext())
    before = [p.detach().clone() for p in learner.engine.module.parameters()]
    metrics = learner.update(batch)
    moved = any(not torch.equal(b, p) for b, p in zip(before, learner.engine.module.parameters()))
    assert metrics["policy/updates"] == updates and moved == (updates > 0)
    assert metrics["policy/lr"] == pytest.approx(1e-2 * 0.5)  # the schedule advances with or without an update
    assert ("loss/policy" in metrics) == (updates > 0) and learner.bad_steps == 0


def test_a_step_whose_signal_rows_all_have_weight_zero_makes_no_update(learner, make_rows):
    """Rows with an advantage but loss weight 0 (all rejected by the sampler correction) carry no signal: no
    optimizer step runs, so AdamW's moments never see a zero gradient and the weights do not move."""
    batch = batch_of(ARITHMETIC.examples("train", 2, 0))
    batch.rows["on_policy"] = on = scored(make_rows("on_policy", 4, prompts=2), [1, 0, 0, 1])
    assign_advantages(batch, "mean", None, learner.dp)
    on.weight_N = torch.zeros(4)
    learner.dp.shard_sources(batch.rows, {"on_policy": MEAN_FIELD})
    score_old_and_reference(batch, learner.policy, None, 2, False, 0, contextlib.nullcontext())
    before = [p.detach().clone() for p in learner.engine.module.parameters()]
    metrics = learner.update(batch)
    assert metrics["policy/updates"] == 0 and metrics["policy/no_signal"] == 1.0
    assert all(torch.equal(b, p) for b, p in zip(before, learner.engine.module.parameters()))
    assert not learner.engine.optimizer.state  # AdamW never stepped: no moments
    on.weight_N = torch.tensor([0.0, 1.0, 1.0, 1.0])  # one rejected row: the step trains on the other three
    assert learner.update(batch)["policy/no_signal"] == 0.0


def test_step_metrics_from_a_batch(make_rows):
    batch = batch_of(ARITHMETIC.examples("train", 2, 0))
    batch.rows["on_policy"] = on = scored(make_rows("on_policy", 4, prompts=2), [1, 0, 1, 1])
    on.adv_N, on.mask_NC[0, 2:] = torch.tensor([0.5, -0.5, 0.0, 0.0]), 0
    batch.metrics["external/rows"] = 0.0
    metrics = step_metrics(batch, {"policy/updates": 1.0}, {"perf/rollout_s": 2.0}, DataParallel(ONE, 2, 2, 4))
    assert metrics["reward/on_policy"] == 0.75 and metrics["reward/accuracy"] == 0.75
    assert metrics["reward/zero_std_groups"] == 0.5 and metrics["len/on_policy"] == 3.5
    assert metrics["perf/tokens_per_s"] == 7.0 and metrics["external/rows"] == 0.0 and "reward/external" not in metrics
    assert metrics["rollouts/on_policy"] == 4.0


def test_ragged_groups_in_one_step_by_hand(make_rows):
    """Groups of 0, 1, 2 and 5 rollouts in one step (prompt 1 has none), rows of a group not adjacent:
    mean-centred advantages per group, a lone rollout 0, and the metrics over groups as they are."""
    batch = batch_of(ARITHMETIC.examples("train", 4, 0), sizes=[1, 0, 2, 5])
    rows = make_rows("on_policy", 8)
    rows.prompt_N = torch.tensor([3, 0, 2, 3, 3, 2, 3, 3])
    rows.prompt_id_N, rows.rollout_N = rows.prompt_N.clone(), torch.tensor([0, 0, 0, 1, 2, 1, 3, 4])
    batch.rows["on_policy"] = scored(rows, [1, 1, 0, 0, 1, 1, 0, 0])
    assign_advantages(batch, "mean", None, DataParallel(ONE, 4, 2, 8))
    assert batch.rows["on_policy"].adv_N.tolist() == pytest.approx([0.6, 0.0, -0.5, -0.4, 0.6, 0.5, -0.4, -0.4])
    assign_advantages(batch, "std", None, DataParallel(ONE, 4, 2, 8))
    std = (0.4 * 0.6) ** 0.5  # prompt 3: rewards 1, 0, 1, 0, 0
    assert batch.rows["on_policy"].adv_N.tolist() == pytest.approx(
        [0.6 / std, 0.0, -1.0, -0.4 / std, 0.6 / std, 1.0, -0.4 / std, -0.4 / std], rel=1e-5)
    assign_advantages(batch, "loo", None, DataParallel(ONE, 4, 2, 8))  # a lone rollout has no baseline: 0
    assert batch.rows["on_policy"].adv_N.tolist() == pytest.approx([0.75, 0.0, -1.0, -0.5, 0.75, 1.0, -0.5, -0.5])
    metrics = step_metrics(batch, {}, {}, DataParallel(ONE, 4, 2, 8))
    assert metrics["reward/zero_std_groups"] == pytest.approx(1 / 3)  # the lone rollout's group is flat
    assert metrics["rollouts/on_policy"] == 8.0
    from dllm_rl.stages import sample_rows

    samples = sample_rows(batch)  # the first row of every group that has one
    assert [s["prompt"] for s in samples] == [batch.prompt_texts[p] for p in (3, 0, 2)]


def test_two_rounds_merge_counts_and_seconds_by_sum_and_row_means_by_rows(make_rows):
    """Dynamic sampling's rounds as one batch: forwards, publish seconds and a pool's rollouts add up; a mean over
    rows (a pool's utilisation, say) is weighted by each round's rows."""
    first, later = batch_of(ARITHMETIC.examples("train", 2, 0)), batch_of(ARITHMETIC.examples("train", 1, 1), 2)
    first.rows["on_policy"], later.rows["on_policy"] = make_rows("on_policy", 4, prompts=2), make_rows("on_policy", 2)
    first.metrics = {"rollout/forwards": 8.0, "rollout/publish_s": 0.5, "pool/fast/rollouts": 4.0,
                     "pool/fast/utilisation": 0.9}
    later.metrics = {"rollout/forwards": 4.0, "rollout/publish_s": 0.25, "pool/fast/rollouts": 2.0,
                     "pool/fast/utilisation": 0.6}
    merged = merge_batches(first, later, pad_id=0)
    assert merged.metrics == {"rollout/forwards": 12.0, "rollout/publish_s": 0.75, "pool/fast/rollouts": 6.0,
                              "pool/fast/utilisation": pytest.approx((0.9 * 4 + 0.6 * 2) / 6)}
    assert len(merged.rows["on_policy"]) == 6 and merged.prompt_ids == [0, 1, 2]


def test_the_step_is_one_list_whose_every_read_is_written_before_it():
    """dllm_rl/step.py: walking the stages in order, what each reads was written by the collect stage or an earlier
    stage; the streamed step runs the per-group ones, and none of those reads what only a step-wide stage writes."""
    from dllm_rl.step import AFTER_UPDATE, BEFORE_UPDATE, COLLECTED, UPDATE

    written, by_step_only = set(COLLECTED), set()
    for stage in [*BEFORE_UPDATE, UPDATE, *AFTER_UPDATE]:
        missing = set(stage.reads) - written
        assert not missing, f"stage {stage.name!r} reads {sorted(missing)}, which no earlier stage writes"
        if stage.per_group:
            assert not set(stage.reads) & by_step_only - set(COLLECTED), stage.name
        else:
            by_step_only |= set(stage.writes) - written
        written |= set(stage.writes)
    assert [s.name for s in BEFORE_UPDATE if s.per_group] == ["external rollouts", "advantages", "shard",
                                                              "old/ref log-probs", "sampler correction"]


def test_a_stage_added_to_the_list_runs_on_both_paths(monkeypatch, saved_model, tmp_path):
    """Adding a stage is one entry: a stage appended to the list runs in the synchronous step and, per group, in
    the streamed one."""
    from dllm_rl import step as step_list
    from dllm_rl.step import Stage
    from dllm_rl.train import train
    from tests.conftest import DigitShare
    from tests.test_train import SMALL
    from tests.workers.test_pipe import GroupsOneByOne

    seen = []
    extra = Stage("count", "score", ("on_policy rows",), (), True, lambda run, batch: seen.append(len(batch.prompt_ids)))
    monkeypatch.setattr(step_list, "BEFORE_UPDATE", [*step_list.BEFORE_UPDATE, extra])
    monkeypatch.setattr("dllm_rl.train.BEFORE_UPDATE", step_list.BEFORE_UPDATE)
    monkeypatch.setattr("dllm_rl.workers.pipe.BEFORE_UPDATE", step_list.BEFORE_UPDATE)
    options = dict(SMALL, model=saved_model, steps=1, bf16=False, minibatch_size=8)
    train(DigitShare(), run_dir=str(tmp_path / "sync"), **options)
    assert seen == [2]  # the step's two prompts at once
    monkeypatch.setattr("dllm_rl.run_setup.remote_collect",
                        lambda cfg, workers, task, learned, rollouts, prompts, collect, state:
                        GroupsOneByOne(prompts, rollouts, task, cfg.group_size))
    train(DigitShare(), run_dir=str(tmp_path / "piped"), workers={"count": 1, "pipe": True}, **options)
    assert seen == [2, 1, 1]  # then each group as it arrived


def test_each_field_of_the_batch_is_written_by_its_one_owner(monkeypatch, saved_model, tmp_path):
    """dllm_rl/step.py's OWNERS: on a run with every source (on-policy, the solver's external rows, the bandit's
    replayed rows) and hindsight's auxiliary rows, each field of the batch changes only in the stage that owns it
    (metrics are every stage's log; inert stand-ins the shard stage's)."""
    from dllm_rl import step as step_list
    from dllm_rl.collect import StepBatch
    from dllm_rl.train import train
    from tests.conftest import DigitRelabel

    plain = [f.name for f in dataclasses.fields(StepBatch) if f.name not in ("rows", "metrics", "auxiliary")]
    stages = [*step_list.BEFORE_UPDATE, step_list.UPDATE, *step_list.AFTER_UPDATE]
    assert set(step_list.OWNERS) == {*plain, "auxiliary", "rows[on_policy]", "rows[external]", "rows[replay]"}
    assert set(step_list.OWNERS.values()) <= {"collect"} | {s.name for s in stages}

    def fingerprint(batch):
        out = {name: repr(getattr(batch, name)) for name in plain}
        out["auxiliary"] = repr(sorted((k, id(v)) for k, v in batch.auxiliary.items()))
        out.update({f"rows[{s}]": id(batch.real(s)) for s in ("on_policy", "external", "replay")})
        return out

    seen = set()

    def watched(stage):
        def run(run_, batch):
            before = fingerprint(batch)
            stage.run(run_, batch)
            changed = {k for k, v in fingerprint(batch).items() if v != before[k]}
            assert all(step_list.OWNERS[k] == stage.name for k in changed), (stage.name, changed)
            seen.update(changed)
        return dataclasses.replace(stage, run=run)

    monkeypatch.setattr("dllm_rl.train.BEFORE_UPDATE", [watched(s) for s in step_list.BEFORE_UPDATE])
    monkeypatch.setattr("dllm_rl.train.AFTER_UPDATE", [watched(s) for s in step_list.AFTER_UPDATE])
    train(DigitRelabel(), model=saved_model, run_dir=str(tmp_path / "run"), steps=3, bf16=False,
          curation={"bandit": {"capacity": 8, "max_age": 2}, "hindsight": {}}, external={"name": "solver"},
          mixing={"keep": "all"},
          rollout={"gen_length": 32, "block_length": 16, "steps": 16, "temperature": 1.0}, prompts_per_step=4,
          group_size=2, minibatch_size=8, train_pool=4, eval_every=0, sample_every=0, tensorboard=False, lr=1e-3,
          print_fn=lambda *_: None)
    assert {"rows[external]", "rows[replay]", "auxiliary"} <= seen  # each owner wrote its field on this run
