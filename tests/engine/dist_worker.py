"""Run under `torchrun --nproc_per_node 2` by tests/engine/test_distributed.py (and alone, for the
single-process baseline): short training runs at each ZeRO stage, a ZeRO-3 resume, a ZeRO-3 rollout, and the
live logits of a ZeRO-3 engine restored from a checkpoint. Results go to files under OUT; the test compares.

usage: dist_worker.py OUT MODEL (train STAGE... | workers STAGE... | lora STAGE... | dropout | uneven NAME |
       ragged NAME STAGE... | async (kill | resume | fail) STAGE | pipe STAGE... | resume | rollout | logits CHECKPOINT | hang)
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.conftest
from tests.conftest import DigitAny, DigitPass, DigitRelabel, DigitShare  # noqa: E402

from dllm_rl.engine import Engine, all_sum, deepspeed_config, init_distributed, partitioned_loading, shutdown
from dllm_rl.policy.adapters import load_policy
from dllm_rl.rollout.generate import TextGenerator

# ERILS with the solver on arithmetic prompts with a dense reward (tests/conftest.py's DigitShare: the share of
# digits, which an untrained model earns in varying amounts), so the on-policy rows carry a loss of their own
# besides the solver's rows (all kept: the solver's texts are not "correct" under this reward); trigger=schedule fires
# for a random share of the prompts after step 0, so ranks get unequal external rows; beta > 0 keeps a reference model
# (partitioned at stage 3), synced at step 2 and saved with it.
SETTINGS = dict(
    rollout={"gen_length": 32, "block_length": 16, "steps": 16, "temperature": 1.0, "threshold": None,
             "random_first": False},  # the exact sampler, written out: the numbers are pinned
    likelihood={"name": "mean_field", "prompt_mask_prob": 0.15},  # d1's, written out: the numbers are pinned
    algo={"advantage": "mean", "beta": 0.04},
    external={"name": "solver"},
    mixing={"per_prompt": 1, "trigger": "schedule", "decay_steps": 3, "keep": "all", "likelihood": None},
    prompts_per_step=4, group_size=2, minibatch_size=4, eval_every=0, sample_every=0, tensorboard=False,
    lr=1e-3, lr_schedule="constant", warmup=0, bf16=False, ref_sync_every=2, checkpoint_every=2,
    print_fn=lambda *_: None,
)
PROMPTS = ["12+7=", "3*4=", "9-5=", "8+8="]


LORA = {"r": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}
# Runs whose ranks make different numbers of forwards (dllm_rl/lockstep.py): confidence-parallel rollouts (a
# threshold the tiny random model's confidences cross now and then) scored in the order they were decoded; and
# a model that ignores the attention mask (the LLaDA stand-in: one forward per prompt length); both with held-out
# evaluation, which decodes in the gathered phase.
UNEVEN = {
    "threshold": dict(rollout={**SETTINGS["rollout"], "threshold": 0.011}, likelihood={"name": "ordered", "group": 2},
                      inner_iterations=2, eval_every=2, eval_prompts=3),
    "llada": dict(trust_remote_code=True, eval_every=2, eval_prompts=3),
    # the newest estimators: ESPO's normalised sequence ELBO (k2 KL, leave-one-out), and JustGRPO's recipe, whose
    # old log-probs replay the sampler's record (no forward on any rank) over two inner iterations
    "espo": dict(likelihood={"name": "espo", "num_masks": 2}, algo={"advantage": "loo", "beta": 0.04, "kl": "k2"},
                 inner_iterations=2, eval_every=2, eval_prompts=3),
    "spg": dict(likelihood={"name": "spg", "num_masks": 2, "block_length": 8},
                algo={"advantage": "mean", "beta": 0.04, "objective": "pg"}, inner_iterations=2, eval_every=2,
                eval_prompts=3),
    "justgrpo": dict(rollout={**SETTINGS["rollout"], "gen_length": 16, "block_length": 1, "steps": 16},
                     likelihood={"name": "left_to_right", "group": 1}, algo={"advantage": "std", "beta": 0.04},
                     inner_iterations=2, eval_every=2, eval_prompts=3),
}
# JustGRPO's recipe with the solver's rows cut to the 16-token window (so that they are kept), whole, and
# back-propagated in pieces (dllm_rl/data_parallel.py, `pieces`): one row and at most 5 of its 16 forwards per
# backward pass, the gradient accumulated over a minibatch's passes; the ranks hold different rows, so their counts
# of pieces and of forwards per piece differ before they agree
UNEVEN["pieces_whole"] = dict(UNEVEN["justgrpo"], mixing={**SETTINGS["mixing"], "length_rule": "truncate"})
UNEVEN["pieces"] = dict(UNEVEN["pieces_whole"], micro_batch_rows=1, micro_batch_forwards=5)


# Runs whose ranks hold uneven numbers of rows (dllm_rl/curation/): SERA gives each prompt its own group size from
# step 2 on (a pool of 4 prompts: every step is an epoch, so the posterior moves), n_min 1 allows groups of one;
# dynamic sampling drops the groups with equal rewards and draws more prompts in rounds, and DARTS keeps 2 of
# 2 + delta rollouts per prompt, and GRPODropout drops positive rollouts (loss weight 0) and recentres the rest;
# echo clips (with SERA, on a reward most rollouts earn) are rows of an auxiliary loss that only some ranks hold; the
# bandit's picks are global and its replayed rows spread over the ranks (with hindsight's rows beside them).
RAGGED = {
    "sera": dict(curation={"sera": {"n_min": 1, "n_max": 8}}, train_pool=4, group_size=4, minibatch_size=8,
                 algo={"advantage": "maxrl", "beta": 0.04}),
    "ds_darts": dict(curation={"dynamic_sampling": {"max_extra": 40}, "darts": {"delta": 1}, "grpo_dropout": {}},
                     train_pool=6),
    "echo": dict(curation={"sera": {"n_min": 1, "n_max": 4}, "echo": {"weight": 0.5}}, train_pool=4, task="any"),
    "bandit": dict(curation={"bandit": {"capacity": 6, "max_age": 2}, "hindsight": {}}, train_pool=4,
                   task="relabel"),
    # a multi-turn run: each rank plays its whole groups' episodes, one row per turn (the ranks hold different
    # numbers of turns), CRBC's credit per group over the dLLM's episodes and the solver's (ERILS), the external
    # episodes' running baseline moved by every rank's returns
    "multi_turn": dict(env={"name": "tests.conftest:Counter", "credit": "crbc"}, external={"name": "solver"},
                       mixing={"per_prompt": 1, "statistic": "running"},
                       rollout={**SETTINGS["rollout"], "gen_length": 8, "block_length": 8, "steps": 4},
                       minibatch_size=16, train_pool=8),
}



def run_ragged(out: Path, model: str, name: str, stage: int) -> None:
    """A RAGGED run at `stage`; every rank writes, per step, how many real on-policy rows it held and in which
    group sizes."""
    from dllm_rl import data_parallel
    from dllm_rl.train import train

    held, shard = [], data_parallel.DataParallel.shard_sources

    def recording(self, rows, estimators):
        on = rows["on_policy"]
        held.append([0, []] if on.inert else [len(on), sorted(on.prompt_id_N.unique(return_counts=True)[1].tolist())])
        return shard(self, rows, estimators)

    data_parallel.DataParallel.shard_sources = recording
    try:
        options = {**SETTINGS, **RAGGED[name]}
        task = {"any": DigitAny(), "relabel": DigitRelabel(), None: DigitPass()}[options.pop("task", None)]
        train(task, model=model, deepspeed={"stage": stage}, steps=3, run_dir=str(out / f"ragged_{name}_zero{stage}"),
              **options)
    finally:
        data_parallel.DataParallel.shard_sources = shard
    rank = int(os.environ.get("RANK", 0))
    (out / f"ragged_{name}_zero{stage}_rows_rank{rank}.json").write_text(json.dumps(held))


ASYNC_STEPS = 4


def run_async(out: Path, model: str, mode: str, stage: int) -> None:
    """Asynchronous rollout workers (S = 1, two Ray actors on rank 0) under the launch's ranks, ASYNC_STEPS steps,
    a checkpoint every 2. `kill`: a new run whose worker 1 is SIGKILLed at the start of step 2 and whose rank 0
    is SIGKILLed once step 3 is logged (before its checkpoint); `resume`: the run resumed to its end; `fail`: a run
    of its own whose rank 0 raises at step 2. Every rank
    appends, per step, the prompt ids of the on-policy groups it trained on to a file of its own."""
    from dllm_rl import data_parallel, train as training
    from dllm_rl.workers import pipelined

    rank = int(os.environ.get("RANK", 0))
    held = out / f"async_{mode}_groups_rank{rank}.jsonl"
    shard, shares, record = (data_parallel.DataParallel.shard_sources, pipelined.PipelinedRollouts.shares,
                             training.record_step)

    def recording(self, rows, estimators):
        on = rows["on_policy"]
        with held.open("a") as f:
            f.write(json.dumps([] if on.inert else on.prompt_id_N.tolist()) + "\n")
        return shard(self, rows, estimators)

    def killing_a_worker(self, step, *args):
        if mode == "fail" and step == 1:  # a failed run: rank 0 raises at step 2, its Ray must stop with it
            raise ValueError("a planted failure on rank 0 at step 2")
        if mode == "kill" and step == 1:  # what was queued on it, or its next load, fails: regenerated
            import ray

            os.kill(ray.get(self.pool.actors[1].pid.remote()), signal.SIGKILL)
        return shares(self, step, *args)

    def killing_the_learner(run, step, *args):
        record(run, step, *args)
        if mode == "kill" and step == 2 and rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    data_parallel.DataParallel.shard_sources = recording
    pipelined.PipelinedRollouts.shares = killing_a_worker
    training.record_step = killing_the_learner
    run = out / (f"async_zero{stage}" if mode != "fail" else "async_failed")
    where = {"resume": str(run)} if mode == "resume" else {"run_dir": str(run)}
    try:
        training.train(DigitShare(), model=model, deepspeed={"stage": stage}, **where,
                       **{**SETTINGS, "steps": ASYNC_STEPS, "checkpoint_every": 2,
                          "workers": {"count": 2, "max_staleness": 1, "timeout_s": 120}})
    finally:
        data_parallel.DataParallel.shard_sources, pipelined.PipelinedRollouts.shares = shard, shares
        training.record_step = record


# Complete-group pipelining under the launch's ranks: 3 prompts a step (two rounds of one group per rank, the second
# with a stand-in on rank 1), one update per step (minibatch = the step's 6 rows), ERILS's solver rows and beta > 0
PIPE = dict(prompts_per_step=3, minibatch_size=6, steps=2, checkpoint_every=2)


def run_pipe(out: Path, model: str, stage: int) -> None:
    """PIPE synchronously with in-process rollouts, then streamed from two Ray workers (S = 0: this step's weights),
    at `stage`."""
    from dllm_rl.train import train

    for name, workers in ((f"pipe_sync_zero{stage}", {}), (f"pipe_zero{stage}", {"count": 2, "pipe": True,
                                                                                  "timeout_s": 120})):
        train(DigitShare(), model=model, deepspeed={"stage": stage}, run_dir=str(out / name),
              **{**SETTINGS, **PIPE, "workers": workers})


def run_train(out: Path, model: str, stage: int, steps: int = 2, resume: bool = False, lora: bool | dict = False,
              name: str | None = None, **extra) -> None:
    """A SETTINGS run at `stage`; `lora`: True (LORA) or the lora options."""
    from dllm_rl.train import train

    run = out / (name or f"{'lora_' if lora else ''}zero{stage}")
    settings = {**SETTINGS, "ref_sync_every": 0, "lora": LORA if lora is True else lora} if lora else SETTINGS
    train(DigitShare(), model=model, deepspeed={"stage": stage}, steps=steps,
          **({"resume": str(run)} if resume else {"run_dir": str(run)}), **{**settings, **extra})


def run_uneven(out: Path, model: str, name: str, stage: int) -> None:
    """An UNEVEN run at `stage`; on several ranks, every forward count each rank declared goes to a file."""
    from dllm_rl import lockstep
    from dllm_rl.train import train

    declared, score = [], lockstep.Lockstep.score

    def recording(self, estimator, policy, ids_NL, attention_mask_NL, prompt_length, *args):
        declared.append(estimator.forwards(policy, attention_mask_NL, prompt_length, args[1]))
        return score(self, estimator, policy, ids_NL, attention_mask_NL, prompt_length, *args)

    lockstep.Lockstep.score = recording
    try:
        train(DigitShare(), model=model, deepspeed={"stage": stage}, steps=2, run_dir=str(out / f"{name}_zero{stage}"),
              **{**SETTINGS, **UNEVEN[name]})
    finally:
        lockstep.Lockstep.score = score
    rank = int(os.environ.get("RANK", 0))
    (out / f"{name}_declared_rank{rank}.json").write_text(json.dumps(declared))


def engine_for(model: str, stage: int, world):
    config = deepspeed_config(stage=stage, world_size=world.size)
    with partitioned_loading(config):
        policy, tokenizer = load_policy(model)
    net = policy.model
    engine = Engine(net, torch.optim.AdamW(net.parameters(), lr=1e-3), world, config)
    return engine, policy, tokenizer


def group_timeouts() -> list[float]:
    """The timeout of every process group this process has (DeepSpeed's included), in seconds."""
    import torch.distributed.distributed_c10d as c10d

    return [pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in c10d._world.pg_map]


def main(out: Path, model: str, command: str, *args: str) -> None:
    world = init_distributed(timeout_s=5 if command == "hang" else 60)
    if command == "hang":  # rank 1 never joins the collective: rank 0 must fail with a timeout, not hang
        if world.rank == 1:
            time.sleep(120)
        all_sum([1.0], world)
    if command == "train":
        for stage in map(int, args):
            run_train(out, model, stage)
        (out / f"group_timeouts_rank{world.rank}.json").write_text(json.dumps(group_timeouts()))
    elif command == "workers":  # the train runs with their rollouts from two Ray actors (rank 0's local Ray)
        for stage in map(int, args):
            run_train(out, model, stage, name=f"workers_zero{stage}", workers={"count": 2, "timeout_s": 120})
    elif command == "async":  # asynchronous workers under several ranks: kill (worker and learner), or resume
        run_async(out, model, args[0], int(args[1]))  # (then, in the same launch, the synchronous workers' run
        if args[0] == "resume":  # (and the pipelined workers' runs)
            run_train(out, model, int(args[1]), name=f"workers_zero{args[1]}", workers={"count": 2, "timeout_s": 120})
            run_pipe(out, model, int(args[1]))
    elif command == "pipe":  # complete-group pipelining from two Ray workers against the synchronous update
        for stage in map(int, args):
            run_pipe(out, model, stage)
    elif command == "lora":  # LoRA with the adapter-off reference at the given stages, and at stage 3 with
        for stage in map(int, args):  # gradient checkpointing
            run_train(out, model, stage, lora=True)
        run_train(out, model, 3, lora=True, name="lora_gc_zero3", gradient_checkpointing=True)
    elif command == "dropout":  # LoRA dropout (global RNG): 2 steps + resume to 3 against 3 straight, at stage 2
        lora = {**LORA, "dropout": 0.3}
        run_train(out, model, 2, lora=lora, name="dropout")
        run_train(out, model, 2, steps=3, resume=True, lora=lora, name="dropout")
        run_train(out, model, 2, steps=3, lora=lora, name="dropout_straight")
    elif command == "uneven":  # UNEVEN[name] (names joined by commas) at the given stages (ZeRO-3 by default);
        for name in args[0].split(","):  # a name may carry its own stages: pieces@2@3
            name, *own = name.split("@")
            for stage in map(int, own or args[1:] or ["3"]):
                run_uneven(out, model, name, stage)
    elif command == "ragged":  # RAGGED[name] (names joined by commas) at the given stages
        for name in args[0].split(","):
            for stage in map(int, args[1:]):
                run_ragged(out, model, name, stage)
    elif command == "resume":  # zero3 ran 2 steps; continue to 3, and run 3 straight for comparison
        run_train(out, model, 3, steps=3, resume=True)
        straight = out / "straight"
        straight.mkdir(exist_ok=True)
        run_train(straight, model, 3, steps=3)
    elif command == "rollout":  # one ZeRO-3 rollout per rank (different prompts), gathered once
        engine, policy, tokenizer = engine_for(model, 3, world)
        import dataclasses

        generator = TextGenerator(dataclasses.replace(policy, model=engine.ds), tokenizer, gen_length=16,
                                  block_length=8, steps=8, temperature=1.0)
        rows = PROMPTS[world.rank * 2:(world.rank + 1) * 2]
        with engine.gathered():
            samples = generator.sample(rows, [11 + world.rank * 2 + i for i in range(2)])
        torch.save(samples.completion_BC, out / f"rollout_rank{world.rank}.pt")
    elif command == "logits":  # a live ZeRO-3 engine restored from a checkpoint
        engine, policy, tokenizer = engine_for(model, 3, world)
        engine.load_checkpoint(Path(args[0]))
        ids = torch.tensor([tokenizer("12+7=19", add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = engine.ds(input_ids=ids).logits
        if world.is_main:
            torch.save(logits, out / "live_logits.pt")
    (out / f"done_{command}_rank{world.rank}.json").write_text(json.dumps({"world": world.size}))
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
