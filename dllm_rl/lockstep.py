"""ZeRO-3's forward-count rule, in one place: in every phase that runs a partitioned model, every rank makes the
same number of network forwards.

At ZeRO-3 a forward gathers each layer's parameters from all ranks as it reaches it (and the backward gathers
them again and reduce-scatters their gradients), so a rank that makes one forward fewer than its peers leaves
them waiting in a collective until `deepspeed.timeout_s`, or worse, pairs its next collective with theirs. How
many forwards a rank makes depends on its rows: the `ordered` estimator makes one per group of denoising steps
its rows used (confidence-parallel rollouts use as many as their tokens allowed), LLaDA's adapter one per span
of real tokens (its code ignores the attention mask), `left_to_right` one per group of window positions.

The phases, and how each keeps the rule:

| phase                                             | model             | how                                          |
|---------------------------------------------------|-------------------|----------------------------------------------|
| rollouts, sampler correction, held-out evaluation | policy            | `Engine.gathered()`: parameters whole,       |
|                                                   |                   | DeepSpeed's hooks lifted: no collective per  |
|                                                   |                   | forward, any count                           |
| old / reference log-probs                         | policy, reference | `Lockstep.score`: declared count, agreed     |
|                                                   |                   | maximum, stand-in forwards                   |
| the update (loss and backward)                    | policy            | `Lockstep.score`, stand-in forwards joined   |
|                                                   |                   | to the loss with weight 0                    |

`Lockstep.score` asks the estimator how many forwards it will make on this rank's rows (`Estimator.forwards`:
its logits calls times `DiffusionPolicy.forwards`, LLaDA's spans), takes the largest count over ranks (one
all-reduce), runs the estimator, and then makes the missing forwards on a one-token input. Under autograd the
stand-in forwards' outputs are added to the returned log-probs times 0, so the backward runs through them too
and every rank makes the same backward collectives. A forward hook counts what the estimator really made; a
count other than the declared one is an error that names the estimator, never a hang. Off (one process, or a
stage below 3) it only runs the estimator.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from dllm_rl.engine import World, all_max


@contextlib.contextmanager
def counting_forwards(network: Any) -> Iterator[list[int]]:
    """A one-element list holding how many times `network` (an nn.Module) was called inside the block."""
    count = [0]
    handle = network.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1)) \
        if isinstance(network, torch.nn.Module) else None
    try:
        yield count
    finally:
        if handle is not None:
            handle.remove()


class Lockstep:
    """Equal forward counts on every rank of a ZeRO-3 run (see the module docstring); `enabled` is False for one
    process and for stages below 3."""

    def __init__(self, world: World, enabled: bool):
        self.world, self.enabled = world, enabled and world.size > 1

    def score(self, estimator, policy, ids_NL: torch.Tensor, attention_mask_NL: torch.Tensor, prompt_length: int,
              seeds_N, order_NC, mask_NC: torch.Tensor, adv_N=None, span=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`estimator.score(...)`, with as many network forwards as the rank that needs the most."""
        run = lambda: estimator.score(policy, ids_NL, attention_mask_NL, prompt_length, seeds_N, order_NC,  # noqa: E731
                                      mask_NC, adv_N, span)
        if not self.enabled:
            return run()
        declared = estimator.forwards(policy, attention_mask_NL, prompt_length, order_NC, span)
        target = int(all_max([declared], self.world)[0])
        with counting_forwards(policy.model) as made:
            logp, level_mask = run()
        if made[0] != declared:
            raise RuntimeError(f"the {estimator.name!r} estimator declared {declared} forwards of a {policy.kind} "
                               f"model and made {made[0]}: ZeRO-3's ranks would fall out of step (the declaration "
                               f"is LOGITS_CALLS in dllm_rl/likelihood/estimators.py)")
        return logp + self.stand_in_forwards(policy, ids_NL, target - declared), level_mask

    @staticmethod
    def stand_in_forwards(policy, ids_NL: torch.Tensor, count: int, scale: float = 0.0) -> torch.Tensor | float:
        """`count` forwards of one real token, their outputs summed times `scale` (0: a tensor in the autograd
        graph when gradients are on, so the backward runs through them too, with a zero gradient; NaN: a gradient
        that is NaN on every parameter, what `Engine.update` discards an accumulated gradient with)."""
        if count <= 0:
            return 0.0
        token_11 = ids_NL[:1, -1:]
        one_11 = torch.ones_like(token_11)
        total = None
        for _ in range(count):
            out = policy.logits(token_11, one_11).float().mean().nan_to_num(0.0, 0.0, 0.0) * scale
            total = out if total is None else total + out
        return total if torch.is_grad_enabled() else 0.0
