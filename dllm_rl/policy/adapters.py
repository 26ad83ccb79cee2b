"""A masked-diffusion model seen as a policy: one protocol, three adapters (native, LLaDA, Dream).

Everything downstream (sampler, likelihood estimators, SFT) calls `policy.logits(ids_BL, attention_mask_BL)`
and gets logits aligned so that `logits[:, i]` scores token i, plus `policy.mask_id`. What each adapter
assumes of a checkpoint:

- `native`: a `DiffusionLM` directory (`dllm_rl.policy.modeling`); `config.mask_token_id` is set.
- `llada`: loaded with `AutoModel.from_pretrained(path, trust_remote_code=True)` (GSAI-ML/LLaDA-8B-*).
  `model(input_ids=...)` returns an object with `.logits` of shape (B, L, V), unshifted. Its code ignores the
  attention mask and numbers positions from 0 whatever the padding, so a padded batch runs one span of real
  tokens at a time (`by_real_span`): every adapter's logits for a row are independent of its batch. The mask
  id is `config.mask_token_id` (126336 for LLaDA-8B), else the tokenizer's `mask_token_id`, else the id of
  `<|mdm_mask|>`.
- `dream`: loaded the same way (Dream-org/Dream-v0-*-7B). Its logits are shifted like an AR model's:
  position i holds the prediction for token i + 1, so the adapter moves them right by one (position 0 keeps
  its own row, which only ever belongs to the prompt). It takes a 4-D boolean attention mask (B, 1, L, L)
  and explicit `position_ids` that count real tokens, as Dream's own sampler passes them. The mask id is
  `config.mask_token_id` (151666), else the tokenizer's.

`kind="auto"` reads `model_type` from config.json as plain JSON ("dllm_rl_diffusion_lm", "llada",
"Dream"/"dream"), so no code runs to find out what a directory holds. A directory holding a LoRA adapter
(`adapter_config.json`, as a LoRA training checkpoint does) loads as its base model with the adapter merged.

Remote code only with consent: LLaDA and Dream ship their modeling code inside the checkpoint (config.json's
`auto_map`), and loading them runs that code. `load_policy` does so only with `trust_remote_code=True` (the
`trust_remote_code=true` key of every command); otherwise it stops with an error naming the directory. The
native model is registered in-process and never runs code from a directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModel

from dllm_rl.data.tokenizers import load_tokenizer
from dllm_rl.device import device_of
from dllm_rl.errors import ConfigError, pick, require
from dllm_rl.policy.compat import load_remote_model


def native_logits(model, ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None, cache=None) -> torch.Tensor:
    if cache is None:
        return model(input_ids=ids_BL, attention_mask=attention_mask_BL).logits
    return model(input_ids=ids_BL, attention_mask=attention_mask_BL, block_cache=cache).logits


def llada_logits(model, ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None) -> torch.Tensor:
    """LLaDA's published code ignores the attention mask (its positions are absolute), so a padded batch is run
    one span of real tokens at a time (`by_real_span`); an unpadded one in one forward, as its sampler does."""
    if attention_mask_BL is None or bool(attention_mask_BL.all()):
        return model(input_ids=ids_BL).logits
    return by_real_span(lambda ids: model(input_ids=ids).logits, ids_BL, attention_mask_BL)


def real_spans(attention_mask_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """(start_B, count_B, the distinct (start, count) spans of real tokens with count > 0, in order). A row's
    real tokens must be contiguous (left or right padding)."""
    real_BL = attention_mask_BL.bool()
    count_B = real_BL.sum(-1)
    start_B = torch.where(count_B > 0, real_BL.int().argmax(-1), torch.zeros_like(count_B))
    position_L = torch.arange(real_BL.shape[1], device=real_BL.device)
    span_BL = (position_L >= start_B[:, None]) & (position_L < (start_B + count_B)[:, None])
    require(bool((span_BL == real_BL).all()), "a row's real tokens are not contiguous in its attention mask; this "
            "model ignores the mask, so only left or right padding can be run exactly")
    spans = sorted((s, c) for s, c in set(zip(start_B.tolist(), count_B.tolist())) if c > 0)
    return start_B, count_B, spans


def by_real_span(forward: Callable[[torch.Tensor], torch.Tensor], ids_BL: torch.Tensor,
                 attention_mask_BL: torch.Tensor) -> torch.Tensor:
    """Logits of a model that ignores the attention mask, exactly: the rows are grouped by where their real
    tokens lie, and each group runs on exactly those positions (one forward per span), so no forward sees
    padding and a row's logits never depend on the rows batched with it. Padding positions get zero logits."""
    B, L = attention_mask_BL.shape
    start_B, count_B, spans = real_spans(attention_mask_BL)
    out_BLV = None
    for start, count in spans:
        rows = ((start_B == start) & (count_B == count)).nonzero().squeeze(-1)
        logits = forward(ids_BL[rows, start:start + count])
        if out_BLV is None:
            out_BLV = logits.new_zeros(B, L, logits.shape[-1])
        out_BLV[rows, start:start + count] = logits
    return forward(ids_BL) if out_BLV is None else out_BLV  # (no real token at all: nothing to keep exact)


def dream_logits(model, ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None) -> torch.Tensor:
    if attention_mask_BL is None or bool(attention_mask_BL.all()):
        logits_BLV = model(input_ids=ids_BL).logits
    else:
        real_BL = attention_mask_BL.bool()
        position_ids_BL = (real_BL.long().cumsum(-1) - 1).clamp(min=0)
        pair_mask_B1LL = real_BL[:, None, :, None] & real_BL[:, None, None, :]
        logits_BLV = model(input_ids=ids_BL, attention_mask=pair_mask_B1LL, position_ids=position_ids_BL).logits
    return torch.cat([logits_BLV[:, :1], logits_BLV[:, :-1]], dim=1)


LOGITS_FNS: dict[str, Callable] = {"native": native_logits, "llada": llada_logits, "dream": dream_logits}
REMOTE_CODE_KINDS = ("llada", "dream")  # their modeling code ships with the checkpoint
MODEL_TYPES = {"dllm_rl_diffusion_lm": "native", "llada": "llada", "dream": "dream"}
MASK_TOKENS = {"llada": "<|mdm_mask|>"}
CONTEXT_FIELDS = ("max_position_embeddings", "max_sequence_length")  # the second is LLaDA's name
# Kinds whose model takes a `BlockCache` (policy/modeling.py). The published LLaDA and Dream code has no block
# cache (Fast-dLLM patches their modeling files); they decode exactly.
CACHED_KINDS = ("native",)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class DiffusionPolicy:
    """A model plus how to call it: the protocol the rest of the package programs against."""

    model: Any
    kind: str
    mask_id: int
    pad_id: int | None = None
    eos_id: int | None = None

    @property
    def shifted(self) -> bool:
        """Whether the checkpoint's raw logits are shifted by one (the adapter undoes it)."""
        return self.kind == "dream"

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model takes (`max_position_embeddings`; LLaDA's `max_sequence_length`), None
        where its config does not say. Read from the network itself: a DeepSpeed engine around it has a `config`
        of its own (a dict)."""
        network = getattr(self.model, "module", self.model)
        config = getattr(network, "config", None)
        for field in CONTEXT_FIELDS:
            if isinstance(getattr(config, field, None), int):
                return getattr(config, field)
        return None

    @property
    def device(self) -> torch.device:
        """Where the network runs, so where every tensor it reads is made (see dllm_rl/device.py)."""
        return device_of(self.model)

    def logits(self, ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """Logits of every position, or with `cache` (a `BlockCache`, decoding only) of its span."""
        if cache is None:
            return LOGITS_FNS[self.kind](self.model, ids_BL, attention_mask_BL)
        require(self.kind in CACHED_KINDS, f"rollout.cache: a {self.kind} model's code has no block cache; "
                f"use rollout.cache=none (its rollouts can still decode in parallel with rollout.threshold)")
        return LOGITS_FNS[self.kind](self.model, ids_BL, attention_mask_BL, cache)

    def forwards(self, attention_mask_BL: torch.Tensor | None) -> int:
        """How many network forwards one `logits` call on rows with this attention mask makes: one, or for LLaDA
        (whose code ignores the mask) one per span of real tokens. ZeRO-3 needs it ahead (dllm_rl/lockstep.py)."""
        if self.kind != "llada" or attention_mask_BL is None or bool(attention_mask_BL.all()):
            return 1
        return max(len(real_spans(attention_mask_BL)[2]), 1)

    def parameters(self):
        return self.model.parameters()


def resolve_mask_id(config, tokenizer, kind: str) -> int:
    mask_id = getattr(config, "mask_token_id", None)
    if mask_id is None and tokenizer is not None:
        mask_id = tokenizer.mask_token_id
        if mask_id is None and kind in MASK_TOKENS:
            found = tokenizer.convert_tokens_to_ids(MASK_TOKENS[kind])
            mask_id = None if found == tokenizer.unk_token_id else found
    if mask_id is None:
        raise ConfigError(f"cannot find the mask token id of this {kind} checkpoint: set config.mask_token_id")
    return int(mask_id)


def read_config(path: str, key: str = "model") -> dict[str, Any]:
    """A model directory's config.json as plain JSON (no code runs); a named error where it is missing or bad.
    A LoRA adapter directory's config is its base model's."""
    from dllm_rl.policy.lora import adapter_base

    base = adapter_base(path, key)
    if base is not None:
        return read_config(base, key)
    require_not_a_run(path, key)
    file = Path(path).expanduser() / "config.json"
    require(file.is_file(), f"{key}={path!r}: no config.json there (expected a Hugging Face model directory)")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{key}={path!r}: {file} is not valid JSON ({error})") from None
    require(isinstance(config, dict), f"{key}={path!r}: {file} holds no JSON object")
    return config


def require_not_a_run(path: str, key: str = "model") -> None:
    """A training run's directory (metrics.jsonl, checkpoints/) given where a model directory belongs: a named
    error that points at its newest checkpoint, which is a model directory."""
    from dllm_rl.checkpoint import latest_checkpoint

    run = Path(path).expanduser()
    if (run / "checkpoints").is_dir() and (run / "metrics.jsonl").is_file():
        newest = latest_checkpoint(run)
        which = f"{key}={newest}" if newest is not None else f"{key}={run}/checkpoints/step_NNNNNN"
        raise ConfigError(f"{key}={path!r} is a training run directory, not a model; give one of its checkpoints "
                          f"({which} is the newest), or export one with dllm-rl export checkpoint={path}")


def detect_kind(config: dict[str, Any]) -> str:
    model_type = str(config.get("model_type", "")).lower()
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"cannot tell which adapter fits model_type {model_type!r}; set policy kind to one of {sorted(LOGITS_FNS)}"
        )
    return MODEL_TYPES[model_type]


def kind_of(path: str) -> str:
    """The adapter a model directory needs, from its config.json (an adapter directory's: its base's)."""
    return detect_kind(read_config(path))


def require_consent(path: str, kind: str, trust_remote_code: bool, key: str = "model") -> None:
    """Stop before a checkpoint's own code runs, unless the user said it may."""
    require(kind not in REMOTE_CODE_KINDS or trust_remote_code,
            f"{key}={path!r} is a {kind} checkpoint: its model code ships in the directory (config.json auto_map) "
            f"and loading it runs that code; pass trust_remote_code=true if you trust {path}")


def wrap_model(model, kind: str, tokenizer=None) -> DiffusionPolicy:
    """A policy around an already-built model (used by tests and by the trainer)."""
    pick(LOGITS_FNS, kind, "policy kind")
    config = model.config
    pad_id = getattr(config, "pad_token_id", None)
    eos_id = getattr(config, "eos_token_id", None)
    if tokenizer is not None:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else pad_id
        eos_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_id
    mask_id, vocab = resolve_mask_id(config, tokenizer, kind), getattr(config, "vocab_size", None)
    require(vocab is None or 0 <= mask_id < vocab,
            f"the mask token id {mask_id} is outside the model's vocabulary of {vocab} (config.mask_token_id)")
    require(mask_id != pad_id, f"the mask token id equals the pad token id ({mask_id}): a dLLM must tell a masked "
            f"position from padding; give the tokenizer a separate pad token")
    return DiffusionPolicy(model, kind, mask_id, pad_id, eos_id)


def hidden_size_of(path: str) -> int | None:
    """The width of a checkpoint's residual stream from its config.json (`hidden_size`; LLaDA's `d_model`),
    without importing its code (an adapter directory's: its base model's); None when the file or the field is
    missing."""
    from dllm_rl.policy.lora import adapter_base

    while (base := adapter_base(path)) is not None:  # an adapter's base (which may itself be an adapter's)
        path = base
    if not (Path(path).expanduser() / "config.json").is_file():
        return None
    config = read_config(path)
    for field in ("hidden_size", "d_model"):
        value = config.get(field)
        if value is not None:
            require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
                    f"model={path!r}: config.json has {field}={value!r}; expected a positive integer")
            return value
    return None


def check_cache_kind(path: str, cache: str, kind: str = "auto", key: str = "rollout.cache") -> None:
    """A block cache asked of a model whose code has none is a named error before the model loads."""
    if cache == "none":
        return
    kind = kind_of(path) if kind == "auto" else kind
    require(kind in CACHED_KINDS, f"{key}={cache!r}: a {kind} model's code has no block cache (model={path!r}); use "
            f"{key}=none (its rollouts can still decode in parallel with rollout.threshold)")


def load_policy(path: str, kind: str = "auto", dtype: str = "float32", device: str | torch.device = "cpu",
                trust_remote_code: bool = False):
    """(policy, tokenizer) from a local checkpoint directory, on `device`; never downloads. A LLaDA or Dream
    checkpoint runs its own code, so it needs `trust_remote_code=True` (see the module docstring)."""
    require(Path(path).expanduser().is_dir(), f"model path {path!r}: expected a local model directory")
    from dllm_rl.policy.lora import adapter_base, merged_with_adapter

    base = adapter_base(path)
    if base is not None:  # a LoRA checkpoint: its base model with the adapter merged in
        policy, tokenizer = load_policy(base, kind, dtype, device, trust_remote_code)
        if (Path(path).expanduser() / "tokenizer_config.json").is_file():
            tokenizer = load_tokenizer(path, "model", trust_remote_code=policy.kind in REMOTE_CODE_KINDS)
        return wrap_model(merged_with_adapter(policy.model, path).eval(), policy.kind, tokenizer), tokenizer
    torch_dtype = pick(DTYPES, dtype, "dtype")
    kind = detect_kind(read_config(path)) if kind == "auto" else kind
    pick(LOGITS_FNS, kind, "policy kind")
    require_consent(path, kind, trust_remote_code)
    remote = kind in REMOTE_CODE_KINDS
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=remote)
        if remote:  # the checkpoint's own code, with the transformers 5 fixes of compat.py
            model = load_remote_model(path, kind, config, torch_dtype)
        else:
            model = AutoModel.from_pretrained(path, config=config, dtype=torch_dtype)
    except (OSError, ValueError, RuntimeError, SafetensorError) as error:  # a missing, truncated or mismatched file
        raise ConfigError(f"model={path!r}: cannot load the model from it ({type(error).__name__}: "
                          f"{str(error).strip().splitlines()[0][:300]})") from None
    model = model.to(device).eval()
    tokenizer = load_tokenizer(path, "model", trust_remote_code=remote)
    return wrap_model(model, kind, tokenizer), tokenizer
