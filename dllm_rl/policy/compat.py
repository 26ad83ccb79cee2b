"""The smallest layer that makes the published LLaDA and Dream code load, run and save under transformers 5.

Both checkpoints ship their modeling code (config.json `auto_map`), written for transformers 4. Read against
transformers 5, each breaks in its own ways; every fix below is applied only to those model types, only when
the quirk is there (checked on the class, the config or the loaded model), and is named so that a test can
leave it out and watch the load fail (`tests/policy/test_remote_checkpoints.py`, with stand-ins that carry the
same quirks):

LLaDA (GSAI-ML/LLaDA-8B-*, `modeling_llada.LLaDAModelLM`):
- `post_init`: its `__init__` never calls `post_init()`, which in transformers 5 sets `all_tied_weights_keys`
  that `from_pretrained` reads; the constructor is wrapped to call it when it was not;
- `tie_weights`: its `tie_weights(self)` takes no arguments, and transformers 5 calls it with `missing_keys`
  and `recompute_mapping`; wrapped to drop them;
- `use_cache`: its forward reads `config.use_cache`, which its config class never defines (transformers 4's
  base config did); set to False when missing.

Dream (Dream-org/Dream-v0-*-7B, `modeling_dream.DreamModel`):
- `rope_default`: its rotary embedding looks up `ROPE_INIT_FUNCTIONS["default"]`, which transformers 5
  removed; the module's own table gets a "default" entry (the plain RoPE frequencies), transformers' is left
  alone;
- `rope_buffers`: its `inv_freq` is a non-persistent buffer made in `__init__`; transformers 5 builds the model
  on the meta device and loads only what the checkpoint holds, so `inv_freq` comes out uninitialised (two loads
  of one checkpoint give different logits); it is recomputed after loading;
- `generation_validate`: its `DreamGenerationConfig.validate(self, is_init=False)` rejects the keywords
  transformers 5 passes (`user_set_attributes`, `strict`), which `update()` and `save_pretrained` use;
  wrapped to drop them;
- `tied_weights_mapping`: its `_tied_weights_keys` is a list; transformers 5 wants a {target: source} mapping
  (`save_pretrained` and `post_init` expand it); converted to tie the output head to the input embedding.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable

import torch

APPLIED = "_dllm_rl_compat"  # the fixes already applied to a class


def accepts(fn: Callable, name: str) -> bool:
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def mark(cls: type, fix: str) -> bool:
    """Record `fix` as applied to `cls` (its own attribute, not a parent's); False when it already was."""
    done = cls.__dict__.get(APPLIED, set())
    if fix in done:
        return False
    setattr(cls, APPLIED, done | {fix})
    return True


# ------------------------------------------------------------------------------------------------ LLaDA


def llada_post_init(model_class: type, config: Any) -> None:
    if not mark(model_class, "post_init"):
        return
    original = model_class.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not hasattr(self, "all_tied_weights_keys"):
            self.post_init()

    model_class.__init__ = __init__


def llada_tie_weights(model_class: type, config: Any) -> None:
    tie = model_class.tie_weights
    if accepts(tie, "recompute_mapping") or not mark(model_class, "tie_weights"):
        return

    @functools.wraps(tie)
    def tie_weights(self, *args, **kwargs):
        return tie(self)

    model_class.tie_weights = tie_weights


def llada_use_cache(model_class: type, config: Any) -> None:
    if not hasattr(config, "use_cache"):
        config.use_cache = False


# ------------------------------------------------------------------------------------------------ Dream


def default_rope(config, device=None, seq_len=None, **kwargs) -> tuple[torch.Tensor, float]:
    """Plain RoPE frequencies theta^(-2i/d) over the rotated part of a head, and no attention scaling."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (config.rope_theta ** exponent), 1.0


def dream_rope_default(model_class: type, config: Any) -> None:
    module = sys.modules[model_class.__module__]
    table = getattr(module, "ROPE_INIT_FUNCTIONS", None)
    if table is not None and "default" not in table:
        module.ROPE_INIT_FUNCTIONS = {**table, "default": default_rope}


def dream_generation_validate(model_class: type, config: Any) -> None:
    from transformers import GenerationConfig

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").rsplit(".", 1)[0] != model_class.__module__.rsplit(".", 1)[0]:
            continue  # only the checkpoint's own modules (its generation_utils)
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, GenerationConfig) and cls is not GenerationConfig):
                continue
            validate = cls.__dict__.get("validate")
            if validate is None or accepts(validate, "user_set_attributes") or not mark(cls, "validate"):
                continue
            cls.validate = keeping_known_keywords(validate)


def keeping_known_keywords(fn: Callable) -> Callable:
    """`fn` called with only the keyword arguments it declares (the others are dropped)."""
    known = set(inspect.signature(fn).parameters) - {"self"}

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **{k: v for k, v in kwargs.items() if k in known})

    return wrapper


def dream_tied_weights(model_class: type, config: Any) -> None:
    keys = model_class.__dict__.get("_tied_weights_keys")
    if isinstance(keys, (list, tuple)) and mark(model_class, "tied_weights"):
        model_class._tied_weights_keys = {key: "model.embed_tokens.weight" for key in keys}


def dream_rope_buffers(model: torch.nn.Module) -> None:
    """Recompute every rotary embedding's frequencies from its config (they are not in the checkpoint)."""
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor) and hasattr(module, "rope_init_fn"):
            inv_freq, scaling = module.rope_init_fn(module.config, module.inv_freq.device,
                                                    **getattr(module, "rope_kwargs", {}))
            module.register_buffer("inv_freq", inv_freq.to(module.inv_freq.device), persistent=False)
            module.original_inv_freq = module.inv_freq
            module.attention_scaling = scaling


# Before loading: fn(model_class, config); after loading: fn(model). By model type, in order.
BEFORE: dict[str, dict[str, Callable]] = {
    "llada": {"post_init": llada_post_init, "tie_weights": llada_tie_weights, "use_cache": llada_use_cache},
    "dream": {"rope_default": dream_rope_default, "generation_validate": dream_generation_validate,
              "tied_weights_mapping": dream_tied_weights},
}
AFTER: dict[str, dict[str, Callable]] = {"dream": {"rope_buffers": dream_rope_buffers}}


def remote_model_class(path: str, kind: str, config, skip: tuple[str, ...] = ()) -> type:
    """The checkpoint's own model class with the fixes for transformers 5 (all but `skip`) applied to it and to
    `config`; registered so that `save_pretrained` copies the code along."""
    from transformers import AutoModel
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model_class = get_class_from_dynamic_module(config.auto_map["AutoModel"], path)
    model_class.register_for_auto_class(AutoModel.__name__)
    for name, fix in BEFORE.get(kind, {}).items():
        if name not in skip:
            fix(model_class, config)
    return model_class


def finish_loading(model: torch.nn.Module, kind: str, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    for name, fix in AFTER.get(kind, {}).items():
        if name not in skip:
            fix(model)
    return model


def load_remote_model(path: str, kind: str, config, dtype: torch.dtype, skip: tuple[str, ...] = ()):
    """The checkpoint's own model, fixed for transformers 5 (all fixes but `skip`), loaded from `path`."""
    model = remote_model_class(path, kind, config, skip).from_pretrained(path, config=config, dtype=dtype)
    return finish_loading(model, kind, skip)
