"""`TrainConfig`: every option of `dllm-rl train` in one dataclass, checked by name, type and range at the edge.

The defaults are those of `configs/train.yaml` (a test composes the YAML and compares), so a script that calls
`train()` runs the trainer that `dllm-rl train` runs. Each field is documented in the YAML, where users read
it. The config groups (`rollout`, `likelihood`, `algo`, `external`, `deepspeed`, `mixing`, `lora`,
`sampler_correction`, `logger`, `curation`) stay plain dicts: their keys depend on the option chosen (an estimator's
options, an external source's). `check_groups` checks each by name, type and range with the same functions that later
build it (`build_estimator`, `check_sampler_settings`, `split_algo`, `MixingConfig`, ...), so a bad value fails before
anything loads.

A group given as a dict overrides the keys it names, as `rollout.gen_length=16` does on the command line; a
dict with another `name` replaces the group, as `likelihood=elbo` does (the other option's YAML is not read
here, so give the keys it needs; each builder has defaults for the rest).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dllm_rl.curation import check_curation
from dllm_rl.tracking import check_logger
from dllm_rl.algo.advantages import ADVANTAGE_FNS
from dllm_rl.algo.correction import SamplerCorrection, resolved_mode
from dllm_rl.algo.losses import AGGREGATIONS, KL_FNS, OBJECTIVES, grpo_loss
from dllm_rl.engine import ENGINE_OPTIONS, deepspeed_config
from dllm_rl.errors import check_kwargs, check_ranges, check_types, pick, require
from dllm_rl.external.mixer import MixingConfig, external_likelihood
from dllm_rl.external.sources import check_source_options
from dllm_rl.envs.task import EnvConfig
from dllm_rl.likelihood.estimators import build_estimator, replays_rollout
from dllm_rl.optim import LR_SCHEDULES
from dllm_rl.policy.lora import LORA_DEFAULTS, check_lora
from dllm_rl.rollout.sampler import check_sampler_settings
from dllm_rl.workers.config import WorkersConfig

# The default option of each config group: configs/<group>/<option>.yaml, as configs/train.yaml picks them.
GROUP_DEFAULTS: dict[str, dict[str, Any]] = {
    "rollout": {"name": "rl", "gen_length": 64, "block_length": 32, "steps": 32, "temperature": 1.0,
                "remasking": "low_confidence", "cfg_scale": 0.0, "threshold": 0.9, "factor": None,
                "random_first": True, "cache": "none", "cache_refresh": 0, "temperature_floor": 0.0},
    "likelihood": {"name": "mean_field", "prompt_mask_prob": 0.0},
    "algo": {"name": "grpo", "advantage": "mean", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.0, "kl": "k3",
             "aggregation": "token", "constant": None, "objective": "clipped"},
    "external": {"name": "solver", "trace_steps": 0},
    "deepspeed": {"name": "zero0", "stage": 0, "bf16": False, "offload_optimizer": "none", "offload_params": "none",
                  "timeout_s": 600},
    "mixing": dataclasses.asdict(MixingConfig()),
    "lora": dict(LORA_DEFAULTS),
    "sampler_correction": dataclasses.asdict(SamplerCorrection()),
    "logger": {"name": "tensorboard"},
    "curation": {},  # none: every prompt gets group_size rollouts (dllm_rl/curation/)
    "workers": dataclasses.asdict(WorkersConfig()),
    "env": {"name": "none"},  # none: a single-turn task; else a multi-turn environment (dllm_rl/envs/task.py)
}


def _group(name: str):
    return field(default_factory=lambda: dict(GROUP_DEFAULTS[name]))


@dataclass
class TrainConfig:
    model: str = "models/tiny-dllm"
    trust_remote_code: bool = False
    run_dir: str | None = None
    resume: str | None = None
    steps: int = 80
    prompts_per_step: int = 8
    group_size: int = 6
    inner_iterations: int = 1
    minibatch_size: int = 48
    micro_batch_rows: int = 0
    micro_batch_forwards: int = 0
    lr: float = 1.0e-4
    lr_schedule: str = "cosine"
    warmup: int = 5
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bf16: bool | str = "auto"
    seed: int = 0
    train_pool: int = 5000
    eval_every: int = 80
    eval_prompts: int = 512
    eval_samples: int = 0
    eval_external_samples: int = 4
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    sample_every: int = 5
    ref_sync_every: int = 0
    max_bad_steps: int = 5
    tensorboard: bool = True
    gradient_checkpointing: bool = False
    replay_rollout_logp: bool = True
    rollout: dict[str, Any] = _group("rollout")
    likelihood: dict[str, Any] = _group("likelihood")
    algo: dict[str, Any] = _group("algo")
    external: dict[str, Any] = _group("external")
    deepspeed: dict[str, Any] = _group("deepspeed")
    mixing: dict[str, Any] = _group("mixing")
    lora: dict[str, Any] = _group("lora")
    sampler_correction: dict[str, Any] = _group("sampler_correction")
    logger: dict[str, Any] = _group("logger")
    curation: dict[str, Any] = _group("curation")
    workers: dict[str, Any] = _group("workers")
    env: dict[str, Any] = _group("env")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> TrainConfig:
        """The config from flat keyword options (the keys of configs/train.yaml); unknown keys and values of
        the wrong type are ConfigErrors that name them."""
        check_kwargs(cls, options, "")
        return cls(**options)

    def __post_init__(self) -> None:
        for name, default in GROUP_DEFAULTS.items():
            given = getattr(self, name)
            require(isinstance(given, dict), f"{name}={given!r}: expected a mapping of the group's keys, e.g. "
                    f"{name}={{'name': {default.get('name', '...')!r}}} (external={{'name': 'none'}} turns ERILS off)")
            setattr(self, name, merge_group(default, given))
        check_types(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "")
        for key, ok, expected in (
            ("steps", self.steps >= 1, ">= 1"), ("prompts_per_step", self.prompts_per_step >= 1, ">= 1"),
            ("group_size", self.group_size >= 2, ">= 2 (advantages compare rollouts of a prompt)"),
            ("inner_iterations", self.inner_iterations >= 1, ">= 1"),
            ("minibatch_size", self.minibatch_size >= 1, ">= 1"),
            ("micro_batch_rows", self.micro_batch_rows >= 0, ">= 0 (0 = a rank's whole minibatch)"),
            ("micro_batch_forwards", self.micro_batch_forwards >= 0, ">= 0 (0 = all of a row's forwards)"),
            ("lr", math.isfinite(self.lr) and self.lr > 0, "> 0 and finite"), ("warmup", self.warmup >= 0, ">= 0"),
            ("weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0, ">= 0"),
            ("grad_clip", self.grad_clip > 0, "> 0"), ("train_pool", self.train_pool >= 1, ">= 1"),
            ("eval_every", self.eval_every >= 0, ">= 0 (0 = never)"), ("eval_prompts", self.eval_prompts >= 1, ">= 1"),
            ("eval_samples", self.eval_samples >= 0, ">= 0"),
            ("eval_external_samples", self.eval_external_samples >= 0, ">= 0 (0 = no provenance split)"),
            ("checkpoint_every", self.checkpoint_every >= 0, ">= 0 (0 = never)"),
            ("keep_checkpoints", self.keep_checkpoints >= 0, ">= 0 (0 = all)"),
            ("sample_every", self.sample_every >= 0, ">= 0"),
            ("ref_sync_every", self.ref_sync_every >= 0, ">= 0 (0 = never)"),
            ("max_bad_steps", self.max_bad_steps >= 1, ">= 1"),
        ):
            require(ok, f"{key} must be {expected}, got {getattr(self, key)!r}")
        require(self.lr_schedule in LR_SCHEDULES,
                f"lr_schedule must be {' or '.join(map(repr, LR_SCHEDULES))}, got {self.lr_schedule!r}")
        require(self.bf16 in (True, False, "auto"), f"bf16 must be true, false or auto, got {self.bf16!r}")
        self.check_groups()

    def correction(self) -> SamplerCorrection:
        """`sampler_correction` with its mode resolved (`auto`: weight with asynchronous workers, else none)."""
        mode, _ = resolved_mode(self.sampler_correction.get("mode", "auto"), self.workers.get("max_staleness", 0))
        return SamplerCorrection(**{**self.sampler_correction, "mode": mode})

    def decided(self) -> list[str]:
        """What the config's `auto` settings became here, for the run header (bf16=auto says its own)."""
        _, why = resolved_mode(self.sampler_correction.get("mode", "auto"), self.workers.get("max_staleness", 0))
        return [why] if why else []

    def check_groups(self) -> None:
        """Every group by name, type and range, as far as it can be without loading anything."""
        check_kwargs(check_sampler_settings, self.sampler, "rollout", exclude=("key",))
        check_sampler_settings(**self.sampler)
        estimator = build_estimator(self.likelihood)
        split_algo(self.algo)
        engine_options(self.deepspeed)
        self.lora = check_lora(self.lora)
        check_logger(self.logger)
        check_curation(self.curation)
        check_kwargs(SamplerCorrection, self.sampler_correction, "sampler_correction")
        self.correction()
        self.check_workers()
        self.check_env()
        require(not (self.lora["r"] > 0 and self.ref_sync_every > 0),
                f"ref_sync_every={self.ref_sync_every} with lora.r={self.lora['r']}: with LoRA the reference is the "
                f"base model (the adapter switched off), which never moves; set ref_sync_every=0")
        rollout = self.sampler
        deterministic = (max(rollout["temperature"], rollout["temperature_floor"]) == 0
                         and rollout["remasking"] == "low_confidence" and not rollout["random_first"])
        require(not (deterministic and self.external.get("name") == "none"),
                "rollout.temperature=0 with low-confidence remasking draws no randomness: every rollout of a prompt "
                "is the same and GRPO's advantages are all zero. Set rollout.temperature > 0, "
                "rollout.temperature_floor > 0, rollout.random_first=true or rollout.remasking=random "
                "(or mix in external rollouts)")
        source = {k: v for k, v in self.external.items() if k != "name"}
        if self.external.get("name") != "none":
            check_source_options(self.external.get("name"), source)
            check_kwargs(MixingConfig, self.mixing, "mixing")
            likelihood = MixingConfig(**self.mixing).likelihood
            build_estimator(external_likelihood(estimator.config, likelihood), "mixing.likelihood")

    def environment(self) -> EnvConfig:
        """The `env` group: a multi-turn environment, or none."""
        check_kwargs(EnvConfig, self.env, "env")
        check_types(EnvConfig, self.env, "env")
        return EnvConfig(**self.env)

    def check_env(self) -> None:
        """A multi-turn run, and what it cannot be combined with yet (named)."""
        env = self.environment()
        if not env.on:
            return
        for key, off, why in (
                ("external", self.external.get("name") != "jsonl", "a JSONL file holds single-turn completions; "
                 "use external=solver (the environment's solver), causal_lm or openai, or external=none"),
                ("mixing", self.external.get("name") == "none" or self.mixing.get("length_rule", "drop") == "drop",
                 "an external action that does not fit the window is dropped with its episode (a cut action is "
                 "another action); set mixing.length_rule=drop"),
                ("curation", not check_curation(self.curation), "the curation strategies decide on single-turn "
                 "groups; set curation=none"),
                ("workers", WorkersConfig(**self.workers).size == 0, "rollout workers generate single-turn "
                 "rollouts; set workers.count=0 (episodes are played in the learner's process)")):
            require(off, f"env={env.name} with {key}={getattr(self, key)!r}: {why}")

    def check_workers(self) -> None:
        """The `workers` group, and what rollout workers cannot yet be combined with (named)."""
        check_kwargs(WorkersConfig, self.workers, "workers")
        check_types(WorkersConfig, self.workers, "workers")
        workers = WorkersConfig(**self.workers)
        require(workers.size > 0 or not workers.pipe, "workers.pipe=true needs rollout workers (workers.count >= 1 or "
                "workers.pools): it trains on each group while the workers generate the others")
        require(workers.size > 0 or workers.max_staleness == 0,
                f"workers.max_staleness={workers.max_staleness} needs rollout workers (workers.count >= 1 or "
                f"workers.pools): without them the learner generates its own rollouts, synchronously")
        self.check_pools(workers)
        if workers.size > 0:
            if workers.max_staleness > 0:
                require(self.correction().mode in ("weight", "both"),
                        f"workers.max_staleness={workers.max_staleness}: rows generated by older policies need the "
                        f"truncated importance correction; set sampler_correction.mode=weight (or both)")
                require(not check_curation(self.curation),
                        f"workers.max_staleness={workers.max_staleness} with curation={check_curation(self.curation)}: "
                        f"curation decides each step's prompts from the last step's groups, which asynchronous "
                        f"rollouts draw ahead of; use workers.max_staleness=0 with curation")
            if workers.pipe:
                self.check_pipe(workers)

    def check_pools(self, workers: WorkersConfig) -> None:
        """Each pool's sampler (the run's with the pool's decoding settings) valid, and scored as the run's is:
        where the old log-probs are the sampler's own records (`replay_rollout_logp`), every pool's must be."""
        estimator = build_estimator(self.likelihood)
        replay = self.replay_rollout_logp and replays_rollout(estimator, self.sampler)
        for pool in workers.pool_list():
            settings = pool.settings(self.sampler)
            check_sampler_settings(**settings, key=f"workers.pools.{pool.name}.sampler")
            require(not replay or replays_rollout(estimator, settings),
                    f"workers.pools.{pool.name}.sampler={pool.sampler}: its rollouts' recorded log-probs are not the "
                    f"policy's (a block cache), but this run reads them as the old policy's (likelihood="
                    f"{self.likelihood.get('name')!r} with replay_rollout_logp=true); set replay_rollout_logp=false "
                    f"or give the pool an exact cache setting")

    def check_pipe(self, workers: WorkersConfig) -> None:
        """What complete-group pipelining needs: every stage before the update local to a group (named)."""
        rows = self.prompts_per_step * self.group_size
        for ok, what in (
                (self.inner_iterations == 1 and self.minibatch_size >= rows,
                 f"one update per step (inner_iterations={self.inner_iterations}, minibatch_size="
                 f"{self.minibatch_size} for {rows} rows): set inner_iterations=1 minibatch_size={rows}"),
                (not check_curation(self.curation), f"no curation (curation={check_curation(self.curation)} decides "
                 f"over the whole step): set curation=none"),
                (engine_options(self.deepspeed)[0].get("stage", 0) in (0, 3),
                 f"ZeRO stage 0 or 3 (deepspeed.stage={engine_options(self.deepspeed)[0].get('stage', 0)} reduces "
                 f"gradients into partitions at the boundary, where a normaliser known only at the end is not "
                 f"applied): set deepspeed=zero0 or zero3"),
                (not self.deepspeed.get("bf16", False),
                 "DeepSpeed's fp32 weights (deepspeed.bf16=true accumulates the gradient in fp32 buffers of its own, "
                 "which a normaliser known only at the end does not reach): set deepspeed.bf16=false (bf16 autocast, "
                 "the top-level bf16, still applies)"),
                (self.external.get("name") == "none" or self.mixing.get("correction") != "is"
                 or not self.mixing.get("is_self_normalize", True),
                 "no self-normalised external importance weights (mixing.correction='is' with "
                 "mixing.is_self_normalize=true divides by their mean over the whole step): set "
                 "mixing.is_self_normalize=false (each row's capped weight alone) or mixing.correction=none")):
            require(ok, f"workers.pipe=true trains each group as it arrives and needs {what}, or workers.pipe=false")

    @property
    def sampler(self) -> dict[str, Any]:
        """The rollout group as the sampler's keyword arguments."""
        return {k: v for k, v in self.rollout.items() if k != "name"}


# grpo_loss's keyword arguments that the trainer passes itself; every other one is an `algo.*` option
LOSS_RUNTIME_ARGS = ("weights_N", "shaped_N", "shaping_gamma", "global_units", "ranks")


def split_algo(algo: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the advantage estimator's name, grpo_loss's options) of the `algo` group, checked."""
    advantage = algo.get("advantage", "mean")
    pick(ADVANTAGE_FNS, advantage, "algo.advantage")
    options = {k: v for k, v in algo.items() if k not in ("name", "advantage")}
    positional = ("logp_NC", "old_logp_NC", "ref_logp_NC", "adv_N", "mask_NC")
    check_kwargs(grpo_loss, options, "algo", exclude=(*positional, *LOSS_RUNTIME_ARGS))
    check_types(grpo_loss, options, "algo")
    require(options.get("eps_low", 1) > 0, f"algo.eps_low must be > 0, got {options.get('eps_low')}")
    require(options.get("eps_high", 1) > 0, f"algo.eps_high must be > 0, got {options.get('eps_high')}")
    require(options.get("beta", 0) >= 0, f"algo.beta must be >= 0, got {options.get('beta')}")
    check_ranges(options, {"eps_low": "open_unit", "eps_high": "positive", "beta": "non_negative",
                           "constant": "positive"}, "algo")
    pick(KL_FNS, options.get("kl", "k3"), "algo.kl")
    pick(AGGREGATIONS, options.get("aggregation", "token"), "algo.aggregation")
    pick(dict.fromkeys(OBJECTIVES), options.get("objective", "clipped"), "algo.objective")
    require(options.get("aggregation") != "constant" or options.get("constant") is not None,
            "algo.aggregation=constant divides by algo.constant (Dr.GRPO: the completion window): set it")
    return advantage, options


def engine_options(deepspeed: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """(deepspeed_config's options, the collective timeout) of the `deepspeed` group, checked."""
    options = {k: v for k, v in deepspeed.items() if k != "name"}
    timeout_s = options.pop("timeout_s", 600)
    check_ranges({"timeout_s": timeout_s}, {"timeout_s": "positive"}, "deepspeed")
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    require(not unknown, f"unknown config key(s) {['deepspeed.' + k for k in unknown]}; valid keys under 'deepspeed': "
            f"{sorted(ENGINE_OPTIONS + ('timeout_s',))}")
    deepspeed_config(**options)  # bad stage / offload values fail here, before any process group exists
    return options, timeout_s


def merge_group(default: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """`given` over the group's default keys, unless it names another option (then `given` alone)."""
    if "name" in given and "name" in default and given["name"] != default["name"]:
        return dict(given)
    return {**default, **given}
