"""`dllm-rl export`: a training checkpoint's DeepSpeed states consolidated into a Hugging Face model directory.

At ZeRO >= 1 the fp32 master weights live in per-rank optimizer shards; DeepSpeed's `zero_to_fp32` joins them
(on one CPU process, no launcher). At stage 0 the module states hold the whole model. The weights are
loaded into a model built from the checkpoint's config and saved with its tokenizer, so the result loads
with `from_pretrained` (and `dllm-rl eval model=...`) anywhere. A LoRA checkpoint holds its adapter only: the
base model it names is loaded and the adapter merged into it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModel

from dllm_rl.checkpoint import damage, resumable_checkpoint, vet_pickles
from dllm_rl.data.tokenizers import load_tokenizer
from dllm_rl.device import resolve_device
from dllm_rl.engine.engine import CHECKPOINT_TAG
from dllm_rl.errors import ConfigError, require
from dllm_rl.policy.adapters import MODEL_TYPES, REMOTE_CODE_KINDS, load_policy, read_config, require_consent
from dllm_rl.policy.compat import finish_loading, remote_model_class
from dllm_rl.policy.lora import adapter_base


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory whose files match their manifest, or a run directory (its newest intact checkpoint,
    as `resume` takes it: a damaged newest one falls back to the previous with a warning)."""
    path = Path(path)
    if (path / "checkpoints").is_dir():
        found = resumable_checkpoint(path)  # checked against its manifest there
        require(found is not None, f"checkpoint={str(path)!r}: the run has no complete, intact checkpoint")
        return found
    require((path / CHECKPOINT_TAG).is_dir(), f"checkpoint={str(path)!r}: expected a training checkpoint directory "
            f"(checkpoints/step_NNNNNN, with a {CHECKPOINT_TAG}/ folder) or a run directory")
    why = damage(path)
    require(why is None, f"checkpoint={str(path)!r} is damaged ({why}); export an earlier checkpoint of the run, or "
            f"give the run directory to take its newest intact one")
    return path


def consolidated_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a checkpoint, from whichever ZeRO stage wrote it."""
    states = checkpoint / CHECKPOINT_TAG
    if any(states.glob("*optim_states.pt")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=CHECKPOINT_TAG)
    return torch.load(states / "mp_rank_00_model_states.pt", weights_only=False, map_location="cpu")["module"]


def export_checkpoint(checkpoint: str, output_dir: str, trust_remote_code: bool = False, device: str = "cpu",
                      print_fn=print) -> Path:
    """Write the checkpoint's consolidated weights, config and tokenizer to `output_dir`. A LLaDA or Dream
    checkpoint builds its model from the code it ships, so it needs `trust_remote_code=True`. A LoRA checkpoint's
    base model is loaded, and the adapter merged, on `device`; DeepSpeed's shards are joined on the CPU."""
    target = resolve_device(device)  # checked whatever the checkpoint (only a LoRA one is loaded on it)
    source, out = resolve_checkpoint(checkpoint), Path(output_dir)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"output_dir={output_dir!r} exists and is not empty; choose a new directory")
    if adapter_base(source) is not None:  # LoRA: the base model with the checkpoint's adapter merged in
        policy, tokenizer = load_policy(str(source), device=target, trust_remote_code=trust_remote_code)
        return publish(out, policy.model, tokenizer, f"exported {source} (base {adapter_base(source)} with its LoRA "
                       f"adapter merged) to {out}", print_fn)
    kind = MODEL_TYPES.get(str(read_config(str(source), "checkpoint").get("model_type", "")).lower(), "other")
    require_consent(str(source), kind, trust_remote_code, key="checkpoint")
    remote = kind in REMOTE_CODE_KINDS
    config = AutoConfig.from_pretrained(source, trust_remote_code=remote)
    if remote:  # the checkpoint's own code, with the transformers 5 fixes of policy/compat.py
        model = finish_loading(remote_model_class(str(source), kind, config)._from_config(config), kind)
    else:
        model = AutoModel.from_config(config)
    vet_pickles(source)  # DeepSpeed unpickles its states unsafely: check them first
    state = consolidated_state_dict(source)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(config, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise ConfigError(f"{source}: the consolidated weights do not fit the model of its config.json "
                          f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    tokenizer = load_tokenizer(str(source), "checkpoint", trust_remote_code=remote)
    return publish(out, model, tokenizer, f"exported {source} ({sum(t.numel() for t in state.values()) / 1e6:.2f}M "
                   f"parameters) to {out}", print_fn)


def publish(out: Path, model, tokenizer, message: str, print_fn) -> Path:
    """Save `model` and `tokenizer` under a temporary name, then rename it to `out` (never half a directory)."""
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    print_fn(message)
    return out
