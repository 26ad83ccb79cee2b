"""Evaluation protocols: the settings a published dLLM number was measured with, pinned by name.

Numbers in this field are hard to reproduce because generation length, denoising steps, block length, decoding
rule and answer parsing are rarely stated together. A protocol (`dllm-rl eval protocol=<name>`,
`configs/protocol/`) fixes all of them, so two runs under one protocol compare, and a run compares with a paper's
table line by line:

| protocol | lengths         | steps         | blocks    | decoding                         | parsers               |
|----------|-----------------|---------------|-----------|----------------------------------|-----------------------|
| none     | the rollout's   | the rollout's | the       | the `rollout` group as given     | the task's            |
|          |                 |               | rollout's |                                  |                       |
| d1       | 128 / 256 / 512 | length / 2    | 32        | greedy, low-confidence remasking | d1's prompts, rewards |
| justgrpo | 128 / 256 / 512 | length        | 32        | greedy, low-confidence remasking | the task's prompt,    |
|          |                 |               |           |                                  | by value              |
| fast     | 128 / 256 / 512 | as needed     | 32        | greedy, threshold 0.9, dual      | d1's prompts, rewards |
|          |                 |               |           | block cache                      |                       |

(Sources and what each leaves out: the YAML files.) A protocol's lengths are
evaluated in one call and printed as one table; each result records the protocol, the package versions, the
device and the dtype. Batch size and padding do not change a result (every adapter computes a row's logits
independently of its batch: `policy.adapters`), so `batch_size` is not part of a protocol; "independently" is up
to float noise (about 1e-7 in the logits, from kernels whose reduction order follows the padded width), which
flips a greedy choice only between tokens that near-tie: in a trained model's peaked distributions practically
never (tested on the embedded model, every protocol and adapter), in a random model's flat ones often.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from dllm_rl.errors import check_kwargs, check_types, require
from dllm_rl.rollout.sampler import check_sampler_settings


@dataclass(frozen=True)
class Protocol:
    """The `protocol` group of `dllm-rl eval` (configs/protocol/<name>.yaml)."""

    name: str = "none"
    lengths: list[int] | None = None  # generation lengths, each evaluated in turn; None: the rollout's gen_length
    steps_per_token: float | None = None  # denoising steps = length x this; None: the rollout's steps
    rollout: dict[str, Any] = field(default_factory=dict)  # sampler settings over the `rollout` group
    task: dict[str, Any] = field(default_factory=dict)  # task settings: its prompt style and answer parsers
    source: str = ""  # where the protocol comes from

    def __post_init__(self) -> None:
        check_types(Protocol, self.__dict__, "protocol")
        require(self.lengths is None or (len(self.lengths) > 0 and all(n >= 1 for n in self.lengths)),
                f"protocol.lengths={self.lengths!r}: "
                "expected a non-empty list of positive generation lengths (or null)")
        require(self.steps_per_token is None or self.steps_per_token > 0,
                f"protocol.steps_per_token={self.steps_per_token!r}: expected > 0 (steps = length x it) or null")

    def settings(self, rollout: dict[str, Any]) -> list[dict[str, Any]]:
        """The sampler's settings at each of the protocol's lengths, checked: the protocol's `rollout` over the
        given one, `gen_length` the length and `steps` = length x `steps_per_token` (a whole number)."""
        out = []
        for length in self.lengths or [rollout["gen_length"]]:
            settings = {**rollout, **self.rollout, "gen_length": length}
            if self.steps_per_token is not None:
                steps = length * self.steps_per_token
                require(steps == int(steps), f"protocol={self.name}: length {length} x steps_per_token "
                        f"{self.steps_per_token} = {steps:g} steps; expected a whole number")
                settings["steps"] = int(steps)
            check_kwargs(check_sampler_settings, settings, "rollout", exclude=("key",))
            if self.name != "none":  # a protocol decodes with a dLLM; none leaves the rollout to the model's loader
                check_sampler_settings(**settings, key=f"protocol={self.name} at length {length}: rollout")
            out.append(settings)
        return out


def environment(device: Any, dtype: str) -> dict[str, Any]:
    """What a result was measured with besides its settings: package versions, the device and the dtype."""
    import torch

    versions = {"python": platform.python_version()}
    for package in ("dllm-rl", "torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    name = torch.cuda.get_device_name(device) if str(device).startswith("cuda") else platform.processor() or "cpu"
    return {"versions": versions, "device": str(device), "device_name": name, "dtype": dtype}
