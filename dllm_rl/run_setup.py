"""How `dllm-rl train` sets a run up, before its first step: the config checked, the process group joined, the
run directory and the checkpoint to resume from chosen, the models, optimizer and DeepSpeed engine loaded (or
restored), and the stages of a step built from their configs into a `Run` (dllm_rl/train.py runs its loop).
With rollout workers (`workers.count` or `workers.pools`), the collect stage is theirs (`remote_collect`,
dllm_rl/workers/).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from dllm_rl.checkpoint import complete_checkpoints, load_trainer_state, resumable_checkpoint
from dllm_rl.data.task import Task, describe_splits
from dllm_rl.data_parallel import DataParallel
from dllm_rl.device import autocast as autocast_on, default_device
from dllm_rl.engine import (Engine, World, broadcast_object, deepspeed_config, init_distributed,
                            partitioned_loading, roll_call)
from dllm_rl.errors import ConfigError, require
from dllm_rl.external.mixer import build_mixer
from dllm_rl.external.provenance import describe as describe_provenance, external_solves
from dllm_rl.likelihood.estimators import build_estimator, replays_rollout
from dllm_rl.optim import lr_factor
from dllm_rl.policy.adapters import MODEL_TYPES, check_cache_kind, hidden_size_of, load_policy, read_config
from dllm_rl.policy.lora import (AdapterOff, add_adapters, enable_gradient_checkpointing, merged_state_dict,
                                 trainable_parameters)
from dllm_rl.precision import resolve_bf16
from dllm_rl.seeds import derive_seed
from dllm_rl.resume import decide_resume, read_run_config, record_resume, with_absolute_paths, write_run_config
from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.curation import Bandit, build_curation, check_curation
from dllm_rl.curation.replay import ReplaySource
from dllm_rl.envs.collect import CollectEpisodes, EpisodeHeldOut
from dllm_rl.envs.external import ExternalEpisodes, assign_turn_advantages
from dllm_rl.envs.task import EnvTask
from dllm_rl.collect import CollectRollouts, InProcessRollouts, PromptSource, inference
from dllm_rl.held_out import HeldOut, build_probe
from dllm_rl.learner import Learner
from dllm_rl.stages import ExternalRollouts, SamplerCorrectionStage, assign_advantages, score_old_and_reference
from dllm_rl.step import StepParts
from dllm_rl.tracking import NullTracker, Tracker, run_header
from dllm_rl.train_config import TrainConfig, engine_options, split_algo
from dllm_rl.workers.config import WorkersConfig
from dllm_rl.workers.pools import describe_pools
from dllm_rl.workers.pipelined import PipelinedRollouts
from dllm_rl.workers.ray_pool import RayStore
from dllm_rl.workers.remote import build_remote_rollouts, start_workers
from dllm_rl.workers.versions import Publisher

def writable_directory(path: Path) -> None:
    """Make `path` (and its parents) or stop with a named error, before anything is loaded."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ConfigError(f"run_dir={str(path)!r}: cannot write there ({error.strerror or error})") from None


def holds_run(path: Path) -> bool:
    """Whether a run has logged a step or saved a checkpoint in `path`."""
    metrics = path / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or bool(complete_checkpoints(path))


def starting_point(cfg: TrainConfig, task: Task, world: World) -> tuple[Path, Path | None]:
    """(the run directory, the checkpoint to resume from or None). Rank 0 decides: it checks the directory (a
    new run never appends to an old one) and verifies the checkpoint's files (checksums, pickles); every rank
    takes its choice. `resume` of a run that stopped before its first checkpoint starts it again."""
    chosen = None
    if world.is_main:
        run_dir = Path(cfg.resume or cfg.run_dir or time.strftime(f"runs/{task.name}-%Y%m%d-%H%M%S"))
        writable_directory(run_dir)
        checkpoint = None
        if cfg.resume is None:
            require(not holds_run(run_dir), f"run_dir={str(run_dir)!r} holds a run already (its metrics.jsonl or "
                    f"checkpoints); continue it with resume={run_dir}, or choose another run_dir")
        else:
            checkpoint = resumable_checkpoint(run_dir)
            require(checkpoint is not None or not complete_checkpoints(run_dir),
                    f"resume={cfg.resume!r}: no complete, intact checkpoint in {run_dir}/checkpoints")
        chosen = (str(run_dir), None if checkpoint is None else str(checkpoint))
    roll_call("the run directory check")
    run_dir, checkpoint = broadcast_object(chosen, world)
    return Path(run_dir), None if checkpoint is None else Path(checkpoint)


@dataclass
class Learned:
    """The models and optimizer state a run trains, as loaded (or restored from a checkpoint)."""

    engine: Engine
    policy: Any  # DiffusionPolicy over the engine
    reference: Any  # DiffusionPolicy over the frozen reference, or None
    tokenizer: Any
    scheduler: torch.optim.lr_scheduler.LRScheduler
    net: torch.nn.Module  # the policy network (the engine's module)


def load_learner(cfg: TrainConfig, world: World, ds_options: dict[str, Any], checkpoint: Path | None,
                 with_reference: bool, device: torch.device) -> Learned:
    """Policy, reference (beta > 0: the starting policy, or the checkpoint's synced copy; with LoRA the policy's
    own network with the adapter off), AdamW over what trains, the LR schedule and the DeepSpeed engine, on
    `device`; ZeRO-3 loads both models partitioned (onto DeepSpeed's device, this rank's GPU)."""
    ds_config = deepspeed_config(**ds_options, grad_clip=cfg.grad_clip, world_size=world.size,
                                 micro_batch_size=-(-cfg.minibatch_size // world.size),
                                 hidden_size=hidden_size_of(cfg.model))
    lora = cfg.lora["r"] > 0
    place = None if ds_config["zero_optimization"]["stage"] == 3 else device  # ZeRO-3 places its partitions itself
    with partitioned_loading(ds_config):
        policy, tokenizer = load_policy(cfg.model, device=place, trust_remote_code=cfg.trust_remote_code)
        reference_net = None
        if with_reference and not lora:
            synced = checkpoint / "reference" if checkpoint is not None else None
            source = synced if synced is not None and synced.is_dir() else cfg.model
            reference_net = load_policy(str(source), kind=policy.kind, device=place,
                                        trust_remote_code=cfg.trust_remote_code)[0].model
    roll_call("the end of model loading")  # before the engine's collectives
    net = policy.model.train().requires_grad_(True)  # a merged LoRA checkpoint comes frozen from peft
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(net)
    if lora:
        net = add_adapters(net, cfg.lora, base_path=cfg.model, seed=derive_seed(cfg.seed, "lora"))
    optimizer = torch.optim.AdamW(trainable_parameters(net), lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.steps, cfg.lr_schedule, cfg.warmup))
    engine = Engine(net, optimizer, world, ds_config)
    policy = dataclasses.replace(policy, model=engine.ds)
    reference = None
    if with_reference:
        reference_model = AdapterOff(engine.ds) if lora else engine.reference(reference_net)
        reference = dataclasses.replace(policy, model=reference_model)
    return Learned(engine, policy, reference, tokenizer, scheduler, net)


@dataclass
class Run:
    """Everything the loop needs: the config, where results go, the step's stages and the loop's own state."""

    cfg: TrainConfig
    task: Task
    run_dir: Path
    tracker: Tracker
    learned: Learned
    state: dict[str, Any]  # step, data_position, bad_steps, external_baseline: saved with checkpoints
    prompts: PromptSource  # the stream of train prompts (its position is saved with checkpoints)
    parts: StepParts  # the step's stages (collect ... update), what dllm_rl/step.py's list runs; no config in it
    held_out: HeldOut
    mixer: Any  # the ExternalMixer (its running baseline is saved with checkpoints), or None
    print_fn: Callable[[str], None]


def check_model_files(cfg: TrainConfig) -> None:
    """What the model directory's config.json says, read as JSON before anything loads: that it is there and
    valid, a width of the right type (the DeepSpeed config is sized by it), and a block cache only for a model
    whose code has one."""
    require(Path(cfg.model).expanduser().is_dir(), f"model path {cfg.model!r}: expected a local model directory")
    model_type = str(read_config(cfg.model).get("model_type", "")).lower()
    require(model_type in MODEL_TYPES, f"model={cfg.model!r} is not a masked-diffusion model (model_type "
            f"{model_type!r}); train trains a dLLM (native, LLaDA, Dream). A causal LM takes part as the external "
            f"policy: external=causal_lm external.path={cfg.model}")
    hidden_size_of(cfg.model)
    check_cache_kind(cfg.model, cfg.sampler["cache"])


def run_record(cfg: TrainConfig, task: Task, saved: dict | None) -> dict[str, Any]:
    """The config.json of a run started from Python (no Hydra config): every option, and the task by name (the
    run's own task record where the name is the same)."""
    saved_task = (saved or {}).get("task")
    same = isinstance(saved_task, dict) and saved_task.get("name") == task.name
    return {**dataclasses.asdict(cfg), "task": saved_task if same else {"name": task.name}}


def setup(task: Task, cfg: TrainConfig, print_fn, saved_config: dict | None, allow_changes: bool = False) -> Run:
    """Check the config, join the process group, load the models and build the stages (or restore them)."""
    if saved_config is None:
        saved_config = run_record(cfg, task, read_run_config(cfg.resume) if cfg.resume else None)
    saved_config = with_absolute_paths(saved_config)  # a resume from another directory finds them
    resumed = decide_resume(cfg.resume, saved_config, allow_changes) if cfg.resume else None
    advantage, loss_options = split_algo(cfg.algo)
    estimator = build_estimator(cfg.likelihood)
    ds_options, timeout_s = engine_options(cfg.deepspeed)
    # Join first, then read files: a rank that fails on them (the model's config, the external model, the data
    # files) posts its reason for its peers (engine/rendezvous.py) instead of leaving them at the rendezvous.
    world = init_distributed(timeout_s)  # rank 0 of 1 without a launcher
    torch.manual_seed(derive_seed(cfg.seed, "global", world.rank))  # dropout's draws (`train` forks the state)
    check_model_files(cfg)
    device = default_device()  # this rank's GPU (LOCAL_RANK) where there is one: every stage's tensors go there
    autocast_enabled = resolve_bf16(cfg.bf16, device)
    autocast = autocast_on(device, autocast_enabled)
    mixer = build_mixer(cfg.external, cfg.mixing, estimator, device=device)
    require(cfg.micro_batch_forwards == 0 or estimator.spanned or (mixer is not None and mixer.estimator.spanned),
            f"micro_batch_forwards={cfg.micro_batch_forwards} cuts the forwards of likelihood=ordered or left_to_right "
            f"into backward passes; this run scores with likelihood={estimator.name!r}: set micro_batch_forwards=0 "
            f"(micro_batch_rows bounds the rows of a pass with any estimator)")
    if mixer is not None:
        loss_options["shaping_gamma"] = mixer.config.shaping_gamma
    env = cfg.environment()
    if env.on:  # a multi-turn run: the environment is the task (dllm_rl/envs/task.py)
        task = EnvTask(env)
    splits = describe_splits(task, needed=("train", "test") if cfg.eval_every > 0 else ("train",))
    print_fn = print_fn if world.is_main else (lambda *_: None)
    if splits:
        print_fn(splits)
    # a multi-turn step holds up to max_turns rows per episode (its minibatches count turn rows)
    rows_per_group = cfg.group_size * (task.max_turns if env.on else 1)
    dp = DataParallel(world, cfg.prompts_per_step, rows_per_group, cfg.minibatch_size, ds_options.get("stage", 0))
    run_dir, checkpoint = starting_point(cfg, task, world)
    restart = cfg.resume is not None and checkpoint is None  # stopped before its first checkpoint
    if restart:
        print_fn(f"resume: {run_dir} has no checkpoint yet (it stopped before its first); starting it again")
    learned = load_learner(cfg, world, ds_options, checkpoint, with_reference=loss_options.get("beta", 0.0) > 0,
                           device=device)
    state = {"step": 0, "data_position": 0, "bad_steps": 0, "external_baseline": 0.0, "curation": {},
             "policy_version": 0, "trained_after": []}
    if checkpoint is not None:
        state = {**state, **load_trainer_state(checkpoint, learned.engine, learned.scheduler)}
    resumed_at = state["step"] if checkpoint is not None else (-1 if restart else None)  # logs are cut back to it
    tracker = (Tracker(run_dir, cfg.tensorboard, resume_step=resumed_at, logger=cfg.logger, config=saved_config)
               if world.is_main else NullTracker())
    if world.is_main:  # the run's effective config: a change made at a resume lasts for the next one
        if resumed is None or checkpoint is None:
            write_run_config(run_dir, saved_config)
        else:
            record_resume(run_dir, saved_config, resumed)
    if mixer is not None:
        mixer.baseline = state["external_baseline"]
    start = f"resumed from {checkpoint} at step {state['step']}" if checkpoint is not None else "a new run"
    print_fn(run_header(run_dir, world.size, device, cfg.bf16, autocast_enabled, saved_config, start,
                        cfg.decided()))
    return build_stages(task, cfg, dp, run_dir, tracker, learned, state, estimator, mixer, advantage, loss_options,
                        autocast, print_fn)


def curation_of(cfg: TrainConfig, task, tokenizer, policy, dp, generating, pool_size: int, external: bool,
                window: int):
    """The run's curation strategies, with what some need: the task and tokenizer (hindsight), and for the bandit
    the data-parallel group (its decisions are global) and a held-out probe (its reward)."""
    probe = None
    if "bandit" in check_curation(cfg.curation):
        config = Bandit.check(dict(cfg.curation["bandit"] or {}))
        probe = build_probe(task, tokenizer, policy, window, config.probe_prompts, cfg.seed, generating)
    return build_curation(cfg.curation, group_size=cfg.group_size, prompts_per_step=cfg.prompts_per_step,
                          seed=cfg.seed, pool_size=pool_size, external=external, task=task, tokenizer=tokenizer,
                          dp=dp, probe=probe)


def held_out_settings(sampler: dict[str, Any]) -> dict[str, Any]:
    """The sampler of held-out pass@1: the rollouts' window and schedule, decoded exactly and greedily whatever
    the rollouts use (fast decoding, a temperature floor), so runs with fast and exact rollouts compare."""
    exact = {"threshold": None, "factor": None, "cache": "none", "random_first": False, "temperature_floor": 0.0}
    return {**sampler, **exact, "temperature": 0.0}


def build_stages(task, cfg: TrainConfig, dp, run_dir, tracker, learned: Learned, state, estimator, mixer, advantage,
                 loss_options, autocast, print_fn) -> Run:
    policy, tokenizer, engine = learned.policy, learned.tokenizer, learned.engine
    correction = cfg.correction()
    workers = WorkersConfig(**cfg.workers)
    # prompts an asynchronous checkpoint trained ahead of its position: the pipeline passes over them itself, the
    # synchronous loop here
    pipelined = workers.size > 0 and (workers.max_staleness > 0 or workers.pipe)
    prompts = PromptSource(task, tokenizer, dp, cfg.prompts_per_step, cfg.train_pool, cfg.seed, state["data_position"],
                           skip=() if pipelined else state["trained_after"])
    if mixer is not None:
        mixer.check_source(prompts.examples, print_fn)
    generating = lambda: inference(learned.net, engine, autocast)  # noqa: E731
    sampler = TextGenerator(policy, tokenizer, **cfg.sampler)
    curation = curation_of(cfg, task, tokenizer, policy, dp, generating, len(prompts.examples),
                           mixer is not None, sampler.gen_length)
    curation.load_state_dict(state["curation"])
    greedy = TextGenerator(policy, tokenizer, **held_out_settings(cfg.sampler))
    external = None if mixer is None else ExternalRollouts(
        mixer, task, tokenizer, window=sampler.gen_length, eos_id=policy.eos_id,
        max_length=policy.context_length, seed=cfg.seed, dp=dp, autocast=autocast, device=policy.device)
    # the old log-probs are the current ones detached where nothing reads them otherwise: one update per step
    # (d1), or the plain policy gradient (algo.objective=pg), unless the mixer's importance weights need them
    reuse_current = ((cfg.inner_iterations == 1 and dp.num_minibatches == 1) or loss_options.get("objective") == "pg") \
        and not (mixer is not None and mixer.config.correction == "is")
    learner = Learner(engine, policy, learned.reference, learned.scheduler, loss_options, cfg.inner_iterations,
                      reuse_current, mixer.config.minibatch_mix if mixer is not None else "stratified", cfg.seed, dp,
                      autocast, cfg.ref_sync_every, cfg.max_bad_steps, bad_steps=state["bad_steps"],
                      micro_rows=cfg.micro_batch_rows, micro_forwards=cfg.micro_batch_forwards)
    rollouts = InProcessRollouts(sampler, estimator, cfg.seed, generating)
    if isinstance(task, EnvTask):  # multi-turn: episodes in, advantages per turn (the config refuses what does not fit)
        collect = CollectEpisodes(prompts, rollouts, task, tokenizer, cfg.group_size, tokenizer.pad_token_id)
        held_out = EpisodeHeldOut(InProcessRollouts(greedy, estimator, cfg.seed, generating), task, tokenizer,
                                  cfg.eval_prompts, cfg.seed, tokenizer.pad_token_id, generating)
        advantages = functools.partial(assign_turn_advantages, advantage=advantage, task=task, mixer=mixer,
                                       gather=dp.gather)
        if mixer is not None:  # ERILS: the external policy plays episodes of the same groups
            external = ExternalEpisodes(mixer, task, tokenizer, cfg.group_size, window=sampler.gen_length,
                                        eos_id=policy.eos_id, max_length=policy.context_length, seed=cfg.seed,
                                        device=policy.device)
    else:
        collect = CollectRollouts(prompts, rollouts, task, curation, dp, pad_id=tokenizer.pad_token_id,
                                  before_generate=external.prefetch if external is not None else None)
        held_out = HeldOut(greedy, sampler, task, tokenizer, cfg.eval_prompts, cfg.eval_samples, cfg.seed, generating)
        advantages = functools.partial(assign_advantages, advantage=advantage, mixer=mixer, dp=dp)
    # provenance (which held-out prompts the external policy solves) is single-turn's: a multi-turn run has none
    if mixer is not None and cfg.eval_every > 0 and cfg.eval_external_samples > 0 and not isinstance(task, EnvTask):
        held_out.external_solved = external_solves(mixer.source, task, held_out.examples(), cfg.eval_external_samples,
                                                   cfg.seed)
        print_fn(describe_provenance(held_out.external_solved, mixer.source.name, cfg.eval_external_samples))
    if workers.size > 0:  # last: nothing after it can fail before `train` owns the workers (and stops them)
        print_fn(describe_pools(workers.pool_list()))
        collect = remote_collect(cfg, workers, task, learned, rollouts, prompts, collect, state)
    parts = StepParts(
        collect=collect,
        curation=curation,
        external=external,
        replay=ReplaySource(curation, estimator, tokenizer.pad_token_id, dp.world.rank, dp.size)
        if curation.replays else None,
        advantages=advantages,
        estimators={"on_policy": estimator, **({"external": mixer.estimator} if mixer is not None else {}),
                    **({"replay": estimator} if curation.replays else {})},
        score=functools.partial(score_old_and_reference, policy=policy, reference=learned.reference,
                                iterations=cfg.inner_iterations, reuse_current=reuse_current, seed=cfg.seed,
                                autocast=autocast, mixer=mixer, dp=dp,
                                replay=cfg.replay_rollout_logp and replays_rollout(estimator, cfg.sampler),
                                micro_rows=cfg.micro_batch_rows),
        correct=SamplerCorrectionStage(correction, policy, generating) if correction.on else None,
        learner=learner, dp=dp, pad_id=tokenizer.pad_token_id, piped=bool(cfg.workers["pipe"]))
    return Run(cfg, task, run_dir, tracker, learned, state, prompts, parts, held_out, mixer, print_fn)


def remote_collect(cfg: TrainConfig, workers: WorkersConfig, task, learned: Learned, rollouts: InProcessRollouts,
                   prompts: PromptSource, collect: CollectRollouts, state: dict[str, Any]):
    """The collect stage with rollout workers: synchronous (S = 0, the in-process stage's rollouts from Ray
    actors) or the pipeline (S > 0, prompts drawn ahead; or `workers.pipe`, groups streamed into the update at
    any S; dllm_rl/workers/pipelined.py)."""
    bf16 = resolve_bf16(cfg.bf16, learned.policy.device)
    # the workers hold the plain model: with LoRA they get the adapter merged into the base weights
    weights = functools.partial(merged_state_dict, learned.net) if cfg.lora["r"] > 0 else learned.net.state_dict
    if workers.max_staleness == 0 and not workers.pipe:
        collect.rollouts = build_remote_rollouts(workers, cfg.model, cfg.sampler, bf16, cfg.trust_remote_code,
                                                 weights, rollouts, learned.tokenizer.pad_token_id, collect.dp,
                                                 learned.engine.gathered, version=state["policy_version"])
        return collect
    # several learner ranks: rank 0 alone holds the workers, the pipeline and its admission
    pool, owns, publisher = None, False, None
    if collect.dp.world.is_main:
        pool, owns = start_workers(workers, cfg.model, cfg.sampler, bf16, cfg.trust_remote_code)
        publisher = Publisher(RayStore(), version=state["policy_version"])
    return PipelinedRollouts(prompts, rollouts, pool, publisher, weights, task, cfg.group_size, workers.max_staleness,
                             learned.tokenizer.pad_token_id, dp=collect.dp, gathered=learned.engine.gathered,
                             owns_ray=owns, sync_every=workers.sync_every, step=state["step"],
                             version_seen=state["policy_version"], skip=set(state["trained_after"]))
