"""The learner's DeepSpeed engine: one object for every ZeRO stage and for one process or many.

`Engine` wraps `deepspeed.initialize` around the policy network and a client torch AdamW (no DeepSpeed op
is compiled), and gives the training loop the few verbs it needs: `update(loss)` (backward, the non-finite
checks and the optimizer step, in one call that says whether the update was applied), `gathered()` for
generation, checkpoint save/load, `save_model` (a consolidated Hugging Face model directory) and a frozen
reference copy.

ZeRO-3 specifics:
- parameters live partitioned (shape (0,) outside a gather). Scoring and training forwards go through
  DeepSpeed's hooks, which gather layer by layer, collectively: every rank must make the same number of them
  (`dllm_rl.lockstep`). A denoising rollout runs S forwards, so the trainer wraps the whole rollout in
  `gathered()`: one all-gather per rollout instead of one per layer per step, and DeepSpeed's hooks lifted
  for the duration, so the forwards inside make no collective and a rank may make as many as its own
  rollouts need. Every rank must enter and leave it together;
- the reference model is its own inference-only engine, partitioned the same way (no full copy per rank);
  `sync_reference` copies the policy into it one gathered parameter at a time.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dllm_rl.engine.dist import World, any_rank, barrier
from dllm_rl.errors import require
from dllm_rl.policy.lora import has_adapters, record_base

CHECKPOINT_TAG = "deepspeed"  # the sub-directory of a checkpoint holding DeepSpeed's (sharded) states


@dataclass(frozen=True)
class Update:
    """What `Engine.update` did: `applied` False means the weights did not move; `skipped` says why."""

    applied: bool
    grad_norm: float | None = None  # the pre-clip global gradient norm of an applied update
    skipped: str = ""  # "non-finite loss" | "non-finite gradient"


class Engine:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World, config: dict[str, Any]):
        """`config` from `deepspeed_config`; `optimizer` a torch optimizer over `model`'s parameters."""
        import deepspeed

        self.world, self.config = world, config
        self.stage = config["zero_optimization"]["stage"]
        # a frozen base (LoRA): checkpoints hold the trained parameters only; the base comes from the model path
        self.frozen = any(not p.requires_grad for p in model.parameters())
        self.ds, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    # ------------------------------------------------------------------------------------ generation

    @contextlib.contextmanager
    def gathered(self):
        """Full parameters on every rank for the duration, for decoding: at ZeRO-3 the forwards inside make no
        collective at all (so ranks may make different numbers of them, as confidence-parallel decoding does);
        a no-op at the other stages."""
        if self.stage != 3:
            yield
            return
        self.settle()
        with gather_parameters(self.module, 3), zero3_hooks_removed(self.ds):
            yield

    def settle(self) -> None:
        """ZeRO-3: wait for the parameter prefetches still in flight and partition every parameter again. DeepSpeed
        prefetches along the trace of the last forward; a backward that ends before using what it prefetched leaves
        those parameters in flight, and a gather entered then fails on leaving ("Cannot partition a param in
        flight"). A no-op at the other stages."""
        if self.stage == 3:
            self.ds.empty_partition_cache()

    # ------------------------------------------------------------------------------------ update

    def update(self, losses: torch.Tensor | Sequence[Callable[[], torch.Tensor]],
               poison: Callable[[], torch.Tensor] | None = None) -> Update:
        """One optimizer update, on every rank alike, from `losses`: a loss, or the makers of the losses of a
        minibatch's backward passes (`DataParallel.pieces`, as many on every rank), each made and back-propagated
        in turn so that one pass's activations are freed before the next, their gradients accumulated (DeepSpeed's
        accumulation boundary at the last: ZeRO reduces and the optimizer steps once). A loss that is non-finite on
        any rank skips the update: before any backward nothing is back-propagated; after some, `poison` (a loss
        whose gradient is NaN on every parameter, e.g. a forward times NaN: a NaN loss alone can have a finite
        gradient) is back-propagated at the boundary, so that the optimizer's own non-finite check (`step`)
        discards what had accumulated, whatever the ZeRO stage keeps it in. Else clip and step."""
        makers = [lambda: losses] if isinstance(losses, torch.Tensor) else list(losses)
        for k, make in enumerate(makers):
            loss = make()
            if any_rank(not math.isfinite(float(loss.detach())), self.world):
                if k > 0:
                    del loss
                    self.backward(poison(), boundary=True)
                    if self.step() is not None:
                        raise RuntimeError("the gradient accumulated before a non-finite loss was applied: the "
                                           "weights are no longer trustworthy; resume from the last checkpoint")
                return Update(False, skipped="non-finite loss")
            self.backward(loss, boundary=k == len(makers) - 1)
        norm = self.step()
        if norm is None:
            return Update(False, skipped="non-finite gradient")
        return Update(True, grad_norm=norm)

    def stream_update(self, makers: Iterable[Callable[[], torch.Tensor]], scale: Callable[[], float]) -> Update | None:
        """One optimizer update from losses that arrive one at a time (complete-group pipelining): `makers` may
        block until its next loss can be made, and how many there are is known only at the end (as many on every
        rank). Each loss is made and back-propagated in turn; then the accumulated gradient is multiplied by
        `scale()` (the loss normaliser, known once every group is in), clipped and stepped. None when `makers`
        gave nothing (no update, no step).

        The late factor needs the gradient where it can be rescaled: at stage 0 it is whole in `.grad` (with
        several ranks, summed over them here, once, after the last pass); at stage 3 each pass has reduced its
        gradient into the ranks' fp32 partitions, and the factor is applied by the ZeRO optimizer's own unscaling
        (its loss scale, 1 in fp32 and bf16, set to 1 / factor for the one step: the clipping then sees the
        rescaled norm, as the synchronous update's does). ZeRO 1-2 (gradients reduced at the accumulation
        boundary into partitions of their own) are not served. A non-finite loss skips the update as in `update`
        (with several ranks every pass is still made, so the collectives stay in step, and the optimizer's
        non-finite check discards the step)."""
        require(self.stage in (0, 3),
                f"a streamed update needs ZeRO stage 0 or 3 (got stage {self.stage}): stages 1-2 reduce the gradient "
                f"into partitions at the boundary, where a late normaliser is not applied")
        made, makers = 0, iter(makers)
        for make in makers:
            loss = make()
            if self.world.size == 1 and not math.isfinite(float(loss.detach())):
                del loss
                self.ds.zero_grad()
                for _ in makers:  # the rest still arrive (the step's groups are all taken), unused
                    pass
                return Update(False, skipped="non-finite loss")
            self.backward(loss, boundary=False)
            made += 1
        if not made:
            return None
        self.ds.set_gradient_accumulation_boundary(True)
        factor = scale()
        if self.stage == 3:
            optimizer = self.ds.optimizer
            optimizer.loss_scale = 1.0 / factor
            try:
                norm = self.step()
            finally:
                optimizer.loss_scale = 1.0
        else:
            if self.world.size > 1:
                self.ds.allreduce_gradients()  # the mean over ranks (the losses carry the rank count)
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(factor)
            norm = self.step()
        return Update(True, grad_norm=norm) if norm is not None else Update(False, skipped="non-finite gradient")

    def backward(self, loss: torch.Tensor, boundary: bool = True) -> None:
        """Back-propagate `loss` into the accumulated gradient; `boundary` marks the last pass before `step`."""
        self.ds.set_gradient_accumulation_boundary(boundary)
        self.ds.backward(loss)

    def step(self) -> float | None:
        """Clip (per the config) and step; returns the pre-clip global gradient norm, or None when it was
        non-finite on any rank and the update was skipped. At stage 0 the gradients are whole on every rank and
        the norm is checked here; at stages 1-3 DeepSpeed's ZeRO optimizer checks it and skips the step itself
        (counted in `skipped_steps`). A non-finite norm whose update was applied all the same (possible in
        DeepSpeed's bf16 mode) raises."""
        if self.stage == 0:
            grads = [p.grad for p in self.module.parameters() if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            if any_rank(not math.isfinite(norm), self.world):
                self.ds.zero_grad()
                return None
            self.ds.step()
            return norm
        skipped = self.ds.skipped_steps
        self.ds.step()
        if self.ds.skipped_steps > skipped:
            return None
        norm = self.ds.get_global_grad_norm()
        norm = 0.0 if norm is None else float(norm)
        if not math.isfinite(norm):
            raise RuntimeError(f"non-finite gradient norm {norm} at ZeRO stage {self.stage}: the update was applied "
                               f"and the weights are no longer trustworthy; resume from the last checkpoint")
        return norm

    def zero_grad(self) -> None:
        self.ds.zero_grad()

    # ------------------------------------------------------------------------------------ reference

    def reference(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of the policy for the KL term: an inference-only engine at stage 3 (partitioned like
        the policy), else the module itself. `model` must hold the same weights as the policy."""
        model.requires_grad_(False).eval()
        if self.stage != 3:
            return model
        import deepspeed

        config = {k: v for k, v in self.config.items() if k not in ("gradient_clipping",)}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()
        return engine

    def sync_reference(self, reference: torch.nn.Module) -> None:
        """Copy the policy's current weights into the reference. At stage 3 one parameter at a time is
        gathered (never the whole model), copied on rank 0 and re-partitioned from there; copying the local
        partitions alone would miss the small parameters ZeRO-3 keeps whole on every rank."""
        if self.stage != 3:
            reference.load_state_dict(self.module.state_dict())
            return
        import deepspeed

        with torch.no_grad():
            for ref_p, p in zip(reference.module.parameters(), self.module.parameters()):
                with (deepspeed.zero.GatheredParameters([p]),
                      deepspeed.zero.GatheredParameters([ref_p], modifier_rank=0)):
                    if self.world.is_main:
                        ref_p.data.copy_(p.data)

    # ------------------------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: Path) -> None:
        """DeepSpeed's states (module, optimizer partitions) under directory/deepspeed; every rank calls it."""
        self.ds.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False,
                                exclude_frozen_parameters=self.frozen)

    def load_checkpoint(self, directory: Path) -> None:
        path, _ = self.ds.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                          load_lr_scheduler_states=False, load_module_strict=not self.frozen)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed states under {directory}/{CHECKPOINT_TAG}")

    def save_model(self, directory: Path, tokenizer=None, module: torch.nn.Module | None = None) -> None:
        """A Hugging Face model directory of the full weights of the policy (or of `module`, e.g. the reference),
        written by rank 0; every rank calls it. A LoRA policy writes its adapter only (peft's format)."""
        module = self.module if module is None else getattr(module, "module", module)
        if module is self.module:
            self.settle()
        with gather_parameters(module, self.stage):
            if self.world.is_main:
                with warnings.catch_warnings():  # an adapter on top of an adapter directory (no config.json)
                    warnings.filterwarnings("ignore", message="Could not find a config file in")
                    module.save_pretrained(directory)
                if has_adapters(module):
                    record_base(directory, module)
                if tokenizer is not None:
                    tokenizer.save_pretrained(directory)
        barrier(self.world)


@contextlib.contextmanager
def zero3_hooks_removed(ds_engine):
    """A ZeRO-3 engine's module without DeepSpeed's forward hooks for the duration (its parameters gathered by
    the caller). Those hooks fetch and release parameters per submodule and, at the start of each forward, may
    check the module trace against the other ranks (a collective); with the parameters whole they only cost
    time and tie every rank to the same number of forwards. DeepSpeed's own `unwrap_model_for_generation`
    removes the submodule hooks the same way; this also lifts the start-of-forward hook, and restores all of
    them even when decoding fails."""
    offload = getattr(ds_engine.optimizer, "parameter_offload", ds_engine.optimizer)
    root = offload.module
    start_of_forward = root._forward_pre_hooks[offload.fwd_pre_hook.id]
    offload._remove_module_hooks()
    try:
        yield
    finally:
        offload.forward_hooks, offload.backward_hooks = [], []
        offload.fwd_pre_hook = root.register_forward_pre_hook(start_of_forward)
        offload._register_deepspeed_module(root)  # re-registered hooks start a fresh trace


def deepspeed_state_classes() -> list[type]:
    """The classes DeepSpeed's checkpoint files pickle besides tensors and plain values: records that carry data
    and run no code when unpickled (the allow-list of `checkpoint.vet_pickles`). Found by saving ZeRO stages 0-3,
    with and without CPU offload, in fp32 (DeepSpeed 0.19); a version or mode that pickles another class is
    refused by name: check that class, then add it here."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def gather_parameters(module: torch.nn.Module, stage: int):
    """All of `module`'s parameters whole on every rank for the duration (ZeRO-3 only)."""
    if stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)


@contextlib.contextmanager
def partitioned_loading(config: dict[str, Any]):
    """Under ZeRO-3, models loaded with `from_pretrained` inside this block are created partitioned
    (transformers' DeepSpeed integration runs `deepspeed.zero.Init`), so no rank ever holds a full copy."""
    if config["zero_optimization"]["stage"] != 3:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    keep = HfDeepSpeedConfig(config)  # transformers holds a weak reference: alive for the block only
    try:
        yield
    finally:
        del keep
