"""Text in, text out, for any supported model: a dLLM (native, LLaDA, Dream) or a causal LM.

`TextGenerator(prompts, seeds)` encodes the prompts (left-padded), samples one completion per prompt with
the row's own seed, and decodes it up to the first EOS. Used by `dllm-rl generate`, `dllm-rl eval` and
later by the trainer for external rollouts. Settings are flat keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM

from dllm_rl.data.tokenizers import load_tokenizer

from dllm_rl.device import device_of, resolve_device
from dllm_rl.errors import ConfigError, check_kwargs, check_ranges, pick, require
from dllm_rl.policy.adapters import (DTYPES, LOGITS_FNS, MODEL_TYPES, DiffusionPolicy, check_cache_kind, load_policy,
                                     read_config)
from dllm_rl.rollout.causal import Drafter, SpeculativeStats, sample_causal, sample_speculative
from dllm_rl.rollout.sampler import check_sampler_settings, completion_texts, denoise, first_eos, left_pad
from dllm_rl.seeds import row_generators
from dllm_rl.types import Samples


KINDS = ("auto", *LOGITS_FNS, "causal")  # what a checkpoint is loaded as (auto: from its config.json)


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int  # tokens before the first EOS


@dataclass
class TextGenerator:
    model: Any  # a DiffusionPolicy or a causal LM
    tokenizer: Any
    gen_length: int = 64
    block_length: int = 32
    steps: int = 64
    temperature: float = 0.0
    remasking: str = "low_confidence"
    cfg_scale: float = 0.0
    threshold: float | None = None  # parallel decoding (see rollout/sampler.py); dLLMs only
    factor: float | None = None
    random_first: bool = False
    cache: str = "none"  # block cache: none | prefix | dual (see rollout/sampler.py); native dLLMs only
    cache_refresh: int = 0
    temperature_floor: float = 0.0  # the lowest temperature it samples at (see `sampling_temperature`)

    @property
    def is_diffusion(self) -> bool:
        return isinstance(self.model, DiffusionPolicy)

    @property
    def sampling_temperature(self) -> float:
        """`temperature`, raised to `temperature_floor` where it is lower."""
        return max(self.temperature, self.temperature_floor)

    @property
    def eos_id(self) -> int:
        return self.model.eos_id if self.is_diffusion else self.tokenizer.eos_token_id

    def encode(self, prompts: Sequence[str], seeds: Sequence[int]):
        """(ids_BP, mask_BP, generators): the prompts left-padded and one generator per row, where the model is."""
        require(len(prompts) == len(seeds), f"got {len(prompts)} prompts but {len(seeds)} seeds")
        encoded = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        device = device_of(self.model)  # the prompts, the rollout and the rows' generators live with the model
        ids_BP, mask_BP = left_pad(encoded, self.tokenizer.pad_token_id, device)
        return ids_BP, mask_BP, row_generators(seeds, device)

    def sample(self, prompts: Sequence[str], seeds: Sequence[int]) -> Samples:
        ids_BP, mask_BP, generators = self.encode(prompts, seeds)
        if self.is_diffusion:
            max_length = self.model.context_length
            return denoise(self.model, ids_BP, mask_BP, gen_length=self.gen_length, block_length=self.block_length,
                           steps=self.steps, temperature=self.temperature, remasking=self.remasking,
                           cfg_scale=self.cfg_scale, threshold=self.threshold, factor=self.factor,
                           random_first=self.random_first, cache=self.cache, cache_refresh=self.cache_refresh,
                           temperature_floor=self.temperature_floor,
                           generators=generators, max_length=max_length)
        return sample_causal(self.model, ids_BP, mask_BP, max_new_tokens=self.gen_length, eos_id=self.eos_id,
                             temperature=self.sampling_temperature, generators=generators)

    def speculate(self, prompts: Sequence[str], seeds: Sequence[int], drafter: Drafter,
                  draft_tokens: int) -> tuple[Samples, SpeculativeStats]:
        """A causal LM's samples by speculative decoding (rollout/causal.py, drafts: rollout/speculative.py):
        `drafter(row, tokens)` proposes up to `draft_tokens` tokens per forward; the output does not depend on the
        drafts."""
        require(not self.is_diffusion, "speculative decoding drafts for a causal LM; this model is a dLLM")
        ids_BP, mask_BP, generators = self.encode(prompts, seeds)
        return sample_speculative(self.model, ids_BP, mask_BP, max_new_tokens=self.gen_length, eos_id=self.eos_id,
                                  temperature=self.sampling_temperature, generators=generators, drafter=drafter,
                                  draft_tokens=draft_tokens)

    def __call__(self, prompts: Sequence[str], seeds: Sequence[int]) -> list[Completion]:
        return self.completions(self.sample(prompts, seeds))

    def completions(self, samples: Samples) -> list[Completion]:
        """Each row's text up to its first EOS, and its length in tokens."""
        texts = completion_texts(self.tokenizer, samples.completion_BC, self.eos_id)
        lengths = first_eos(samples.completion_BC, self.eos_id).tolist()
        return [Completion(t, n) for t, n in zip(texts, lengths)]


def is_diffusion_checkpoint(path: str) -> bool:
    """Whether config.json names a masked-diffusion model type (read as JSON: no code runs)."""
    return str(read_config(path).get("model_type", "")).lower() in MODEL_TYPES


def load_causal_lm(path: str, dtype: str = "float32", trust_remote_code: bool = False, key: str = "model",
                   device: str | torch.device = "cpu"):
    """A causal LM from a local directory, on `device`. One whose code ships in the directory (a model type
    transformers does not know) loads only with `trust_remote_code=True`; without it, a named error instead of
    running the code. A masked-diffusion model, a malformed config or truncated weights are named errors too."""
    model_type = str(read_config(path, key).get("model_type", ""))
    require(model_type.lower() not in MODEL_TYPES, f"{key}={path!r} is a masked-diffusion model (model_type "
            f"{model_type!r}); expected a causal LM directory (e.g. models/tiny-ar, a Qwen checkpoint)")
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=pick(DTYPES, dtype, "dtype"),
                                                    trust_remote_code=trust_remote_code).to(device).eval()
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise ConfigError(f"{key}={path!r}: its model code ships in the directory (config.json auto_map) and "
                              f"loading it runs that code; pass trust_remote_code=true if you trust {path}") from None
        raise ConfigError(f"{key}={path!r}: cannot load a causal LM from it (model_type {model_type!r}: "
                          f"{str(error).strip().splitlines()[0][:200]})") from None
    except (OSError, RuntimeError, SafetensorError) as error:  # a missing, truncated or mismatched file
        raise ConfigError(f"{key}={path!r}: cannot load a causal LM from it ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:200]})") from None


# Sampler options that only a denoising sampler reads, with the value that leaves them off: given to a causal LM
# they would change nothing, so they are named errors instead
DENOISING_ONLY = {"threshold": None, "factor": None, "random_first": False, "cache": "none", "cache_refresh": 0,
                  "cfg_scale": 0.0, "remasking": "low_confidence"}


def load_generator(path: str, kind: str = "auto", dtype: str = "float32", trust_remote_code: bool = False,
                   device: str | torch.device = "auto", key: str = "model", **settings: Any) -> TextGenerator:
    """A TextGenerator for a local checkpoint on `device` (auto: this process's GPU where there is one, else the
    CPU); `kind` is auto, native, llada, dream or causal; `key` names the path in errors. Code that ships with a
    checkpoint runs only with `trust_remote_code=True`."""
    pick(dict.fromkeys(KINDS), kind, "kind")
    pick(DTYPES, dtype, "dtype")
    device = resolve_device(device)
    check_kwargs(check_sampler_settings, settings, "rollout", exclude=("key",))
    require(Path(path).expanduser().is_dir(), f"{key}={path!r}: expected a local model directory")
    if kind == "causal" or (kind == "auto" and not is_diffusion_checkpoint(path)):
        check_ranges(settings, {"gen_length": "at_least_1", "temperature": "non_negative"}, "rollout")
        for option, off in DENOISING_ONLY.items():
            given = settings.get(option, off)
            require(given == off, f"rollout.{option}={given!r} applies to a masked-diffusion model's denoising; "
                    f"{key}={path!r} is a causal LM (leave it at {off!r})")
        model = load_causal_lm(path, dtype, trust_remote_code, key=key, device=device)
        return TextGenerator(model, load_tokenizer(path, key, trust_remote_code=trust_remote_code), **settings)
    check_sampler_settings(**settings)
    check_cache_kind(path, settings.get("cache", "none"), kind)
    policy, tokenizer = load_policy(path, kind=kind, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    return TextGenerator(policy, tokenizer, **settings)


def run_generate(*, model: str, prompt: str, rollout: dict[str, Any], kind: str = "auto", dtype: str = "float32",
                 chat: bool = False, num_samples: int = 1, seed: int = 0, trust_remote_code: bool = False,
                 device: str = "auto", print_fn=print) -> list[Completion]:
    """`dllm-rl generate`: print `num_samples` completions of `prompt`."""
    from dllm_rl.data.task import render_prompt

    check_ranges({"num_samples": num_samples}, {"num_samples": "at_least_1"})
    if "\\n" in prompt:  # Hydra keeps a typed backslash-n as two characters; a prompt rarely means that
        print_fn("note: the prompt holds a literal backslash-n, not a newline (the override grammar does not "
                 "unescape it); for newlines pass real ones, e.g. in bash $'prompt=\\'line one\\nline two\\''")
    generator = load_generator(model, kind=kind, dtype=dtype, trust_remote_code=trust_remote_code, device=device,
                               **rollout)
    text = render_prompt(prompt, generator.tokenizer) if chat else prompt
    completions = generator([text] * num_samples, [seed + i for i in range(num_samples)])
    for i, c in enumerate(completions):
        print_fn(f"--- sample {i} ({c.num_tokens} tokens)\n{c.text}")
    return completions
