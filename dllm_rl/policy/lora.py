"""LoRA adapters (through `peft`) and gradient checkpointing: what lets an 8B dLLM's RL fit in GPU memory.

d1 trains LLaDA-8B with LoRA (r=128) and a KL reference that is the same network with the adapter switched off,
so no second copy of the model is loaded. Here:

- `lora.r > 0` wraps the policy network in a `peft` LoRA model (`lora.alpha`, `lora.dropout`,
  `lora.target_modules`: module names, or `all-linear`, every linear layer but the output head); only the
  adapter weights train, and the optimizer holds only them;
- the reference (`algo.beta > 0`) is `AdapterOff(network)`: the policy's own network called with the adapter
  disabled. Syncing the reference (`ref_sync_every`) would need a second copy, so it is refused with LoRA;
- a checkpoint saves the adapter only (`adapter_config.json`, `adapter_model.safetensors`, naming the base
  model's directory by its absolute path, and `base_model.json`, the base's identity: a different model at
  that path is a named error); `load_policy` loads such a directory as base + adapter from any working
  directory, and `dllm-rl export` merges it into a plain `from_pretrained` directory; `train model=<adapter
  directory>` starts a new run from the merged model (fully, or with a fresh adapter on top of it);
- `gradient_checkpointing=true` recomputes each block's activations in the backward pass, through LLaDA's own
  strategy (`whole_layer`) for LLaDA, and otherwise transformers' own switch (`activation_checkpointing_enable`,
  formerly `gradient_checkpointing_enable`); a model that does not support it is a named error.
"""

from __future__ import annotations

import hashlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dllm_rl.errors import ConfigError, check_kwargs, check_ranges, require

LORA_DEFAULTS: dict[str, Any] = {"r": 0, "alpha": 16.0, "dropout": 0.0, "target_modules": "all-linear"}
ADAPTER_CONFIG = "adapter_config.json"
BASE_RECORD = "base_model.json"  # the base model's absolute path and identity (`record_base`)


def check_lora(options: dict[str, Any]) -> dict[str, Any]:
    """The `lora` group with its defaults, checked by name, type and range."""
    check_kwargs(lambda r, alpha, dropout, target_modules: None, options, "lora")
    options = {**LORA_DEFAULTS, **options}
    r, targets = options["r"], options["target_modules"]
    require(isinstance(r, int) and not isinstance(r, bool), f"lora.r={r!r}: expected int (0 = no LoRA)")
    require(isinstance(options["alpha"], (int, float)), f"lora.alpha={options['alpha']!r}: expected a number")
    require(isinstance(options["dropout"], (int, float)), f"lora.dropout={options['dropout']!r}: expected a number")
    check_ranges(options, {"r": "non_negative", "alpha": "positive", "dropout": "probability_below_1"}, "lora")
    require(targets == "all-linear" or (isinstance(targets, (list, tuple)) and targets
                                         and all(isinstance(t, str) and t for t in targets)),
            f"lora.target_modules={targets!r}: expected all-linear or a list of module names, e.g. [q_proj, v_proj]")
    return options


def add_adapters(network: nn.Module, options: dict[str, Any], base_path: str, seed: int) -> nn.Module:
    """`network` wrapped in a peft LoRA model (the base weights frozen) whose saved adapters name `base_path`
    (made absolute); a named error when no module matches `target_modules`. The adapters' random initialisation
    is a function of `seed` alone (the global RNG is left as it was)."""
    from peft import LoraConfig, get_peft_model

    targets = options["target_modules"]
    check_targets(network, targets, options["r"])
    base = str(Path(base_path).expanduser().resolve())
    config = LoraConfig(r=options["r"], lora_alpha=options["alpha"], lora_dropout=options["dropout"],
                        target_modules=targets if targets == "all-linear" else list(targets), bias="none",
                        base_model_name_or_path=base)
    network.name_or_path = base  # what peft records as the base (it would take the path as typed)
    try:
        gpus = sorted({p.device.index for p in network.parameters() if p.device.type == "cuda"})
        with torch.random.fork_rng(devices=gpus), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            torch.manual_seed(seed)  # peft asks transformers by the name it deprecated
            return get_peft_model(network, config)
    except ValueError as error:  # peft: "Target modules ... not found in the base model"
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in network.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"lora.target_modules={targets!r}: {str(error).splitlines()[0][:200]}; this model's "
                          f"linear layers are named {linear}") from None


def adapted_layers(network: nn.Module, targets) -> dict[str, nn.Linear]:
    """The linear layers `targets` names: every one but the output head for all-linear (as peft takes it), else
    those whose name is a target or ends with `.target`."""
    linear = {name: m for name, m in network.named_modules() if isinstance(m, nn.Linear)}
    if targets == "all-linear":
        head = network.get_output_embeddings() if hasattr(network, "get_output_embeddings") else None
        return {name: m for name, m in linear.items() if m is not head}
    return {name: m for name, m in linear.items() if any(name == t or name.endswith("." + t) for t in targets)}


def check_targets(network: nn.Module, targets, r: int) -> None:
    """Named errors for adapters that would train something else than asked: a listed target that matches no
    linear layer (a typo peft passes over while another target matches), and a rank no adapted layer has room
    for (r > min(in, out) everywhere: no longer low-rank, only more weights). Targeting the output head by name
    is allowed (all-linear leaves it out)."""
    names = sorted({name.rsplit(".", 1)[-1] for name, m in network.named_modules() if isinstance(m, nn.Linear)})
    for target in [] if targets == "all-linear" else targets:
        require(adapted_layers(network, [target]), f"lora.target_modules: {target!r} matches no linear layer of "
                f"this model; its linear layers are named {names}")
    layers = adapted_layers(network, targets)
    room = max((min(m.in_features, m.out_features) for m in layers.values()), default=0)
    require(not layers or r <= room, f"lora.r={r}: larger than the rank of every adapted layer (at most {room}, "
            f"min(in, out)); such an adapter is no longer low-rank. Use lora.r <= {room}")


def has_adapters(network: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(getattr(network, "module", network), PeftModel)


@torch.no_grad()
def merged_state_dict(network: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of `network` (a peft LoRA model) with its active adapters merged in, named as the base model's
    own state dict (what rollout workers holding the plain model load); `network` itself is left as it is."""
    from peft.tuners.lora import LoraLayer

    base = network.get_base_model()
    deltas = {name: sum(m.get_delta_weight(a) for a in m.active_adapters if a in m.lora_A)
              for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        module, _, leaf = key.rpartition(".")
        delta = deltas.get(module) if leaf == "weight" else None
        out[key] = (value + delta.to(value.dtype)) if isinstance(delta, torch.Tensor) else value
    return out


class AdapterOff(nn.Module):
    """The policy's own network with its LoRA adapter switched off: the base model, used as the KL reference
    without a second copy. `network` is the peft model (or a DeepSpeed engine around it)."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = network  # registered, but never trained through this module
        self.peft = getattr(network, "module", network)

    @property
    def config(self):
        return self.peft.config

    def forward(self, *args, **kwargs):
        with self.peft.disable_adapter():
            return self.network(*args, **kwargs)


def enable_gradient_checkpointing(network: nn.Module) -> None:
    """Recompute activations in the backward pass, through transformers' switch, or LLaDA's own
    (`set_activation_checkpointing(whole_layer)` on its inner model, which transformers' switch does not reach);
    a named error where the model supports neither."""
    base = network.get_base_model() if hasattr(network, "get_base_model") else network
    if not getattr(base, "supports_gradient_checkpointing", False):
        own = next((m for m in base.modules() if callable(getattr(m, "set_activation_checkpointing", None))), None)
        strategies = getattr(sys.modules.get(type(own).__module__), "ActivationCheckpointingStrategy", None)
        require(own is not None and hasattr(strategies, "whole_layer"),
                f"gradient_checkpointing=true: {type(base).__name__} does not support gradient checkpointing "
                f"(its supports_gradient_checkpointing is False); set gradient_checkpointing=false")
        own.set_activation_checkpointing(strategies.whole_layer)
        return
    if hasattr(base, "activation_checkpointing_enable"):  # the name from transformers 5.x on
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def base_identity(base: str | Path) -> dict[str, Any]:
    """What tells one base model directory from another without reading its weights: the sha256 of its
    config.json (an adapter directory's adapter_config.json, for an adapter trained on top of one) and the names
    and sizes of its weight files."""
    base = Path(base).expanduser()
    config = next((base / n for n in ("config.json", ADAPTER_CONFIG) if (base / n).is_file()), None)
    weights = sorted(p for p in base.iterdir() if p.name.endswith((".safetensors", ".bin", ".safetensors.index.json")))
    return {"config_sha256": hashlib.sha256(config.read_bytes()).hexdigest() if config else None,
            "weights": {p.name: p.stat().st_size for p in weights}}


def record_base(directory: str | Path, network: nn.Module) -> None:
    """Beside a saved adapter, `base_model.json`: its base model's absolute path and identity, so that the adapter
    finds its base from any working directory and a different model at that path is named, not merged."""
    peft_model = getattr(network, "module", network)
    base = next(iter(peft_model.peft_config.values())).base_model_name_or_path
    record = {"path": str(Path(base).expanduser().resolve()), **base_identity(base)}
    (Path(directory) / BASE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


def adapter_base(path: str | Path, key: str = "model") -> str | None:
    """The base model directory an adapter directory names, or None when `path` holds no adapter. The base
    must be where the adapter says (an absolute path), and the model it was trained on (`base_model.json`)."""
    file = Path(path).expanduser() / ADAPTER_CONFIG
    if not file.is_file():
        return None
    try:
        base = json.loads(file.read_text()).get("base_model_name_or_path")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise ConfigError(f"{key}={str(path)!r}: {file} is not an adapter config ({error})") from None
    where = ("" if isinstance(base, str) and Path(base).is_absolute() else
             " (a path relative to the directory its run started in: run this command from there)")
    require(isinstance(base, str) and Path(base).expanduser().is_dir(),
            f"{key}={str(path)!r} holds a LoRA adapter for the base model {base!r}, which is not a directory here"
            f"{where}; put that model there (a link will do), or export the checkpoint with dllm-rl export on the "
            f"machine that has it")
    record = Path(path).expanduser() / BASE_RECORD
    if record.is_file():
        try:
            expected = {k: v for k, v in json.loads(record.read_text()).items() if k != "path"}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
            raise ConfigError(f"{key}={str(path)!r}: {record} is damaged ({error})") from None
        found = base_identity(base)
        differs = [k for k in ("config_sha256", "weights") if found.get(k) != expected.get(k)]
        require(not differs, f"{key}={str(path)!r}: the base model at {base} is not the one its LoRA adapter was "
                f"trained on ({' and '.join(k.replace('_sha256', '.json') for k in differs)} differ from {record}); "
                f"put the original base model there")
    return base


def merged_with_adapter(network: nn.Module, path: str | Path, key: str = "model") -> nn.Module:
    """`network` (the base) with the adapter saved in `path` merged into its weights: a plain model again. A
    missing, truncated or mismatched adapter file is a named error."""
    from peft import PeftModel
    from safetensors import SafetensorError

    try:
        return PeftModel.from_pretrained(network, str(path)).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as error:
        files = sorted(p.name for p in Path(path).expanduser().glob("adapter_model.*")) or ["no adapter_model file"]
        raise ConfigError(f"{key}={str(path)!r}: cannot load its LoRA adapter ({', '.join(files)}: "
                          f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200]})") from None


def trainable_parameters(network: nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in network.parameters() if p.requires_grad]
