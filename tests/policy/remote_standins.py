"""Small stand-ins for the published LLaDA and Dream checkpoints, as awkward as the real files under transformers 5.

Each is a directory with its own modeling code (config.json `auto_map`), a tokenizer and weights, written the way
the published code is written (read from GSAI-ML/LLaDA-8B-Instruct and Dream-org/Dream-v0-Instruct-7B), with the
quirks that break under transformers 5 (see dllm_rl/policy/compat.py):

LLaDA: `LLaDAModelLM.__init__(config, model=None, init_params=False)` never calls `post_init()`; no
`supports_gradient_checkpointing`, but its inner `LLaDAModel.set_activation_checkpointing(strategy)`;
`tie_weights(self)` takes no arguments; the forward reads `config.use_cache`, which `LLaDAConfig` does not define; the
attention mask is accepted and ignored, positions are absolute (0..L-1 whatever the padding); the context is
`max_sequence_length`, the width `d_model`; logits are not shifted.

Dream: the rotary embedding looks up `ROPE_INIT_FUNCTIONS["default"]` and keeps `inv_freq` as a non-persistent
buffer; `DreamGenerationConfig.validate(self, is_init=False)`; `DreamPreTrainedModel.from_pretrained` replaces the
generation config with `DreamGenerationConfig.from_pretrained(path)`; `_tied_weights_keys` is a list; the forward
takes a 4-D boolean mask or "full" and explicit position ids; logits[:, i] predicts token i + 1.
"""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

LLADA_CONFIG = '''
from enum import Enum

from transformers import PretrainedConfig


class ActivationCheckpointingStrategy(str, Enum):
    whole_layer = "whole_layer"
    one_in_two = "one_in_two"


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"

    def __init__(self, d_model=32, n_heads=4, n_layers=2, mlp_hidden_size=64, vocab_size=128, embedding_size=128,
                 max_sequence_length=64, rope_theta=10000.0, mask_token_id=None, weight_tying=False, **kwargs):
        self.d_model, self.n_heads, self.n_layers, self.mlp_hidden_size = d_model, n_heads, n_layers, mlp_hidden_size
        self.vocab_size, self.embedding_size, self.max_sequence_length = vocab_size, embedding_size, max_sequence_length
        self.rope_theta, self.mask_token_id, self.weight_tying = rope_theta, mask_token_id, weight_tying
        super().__init__(**kwargs)
'''

LLADA_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_llada import ActivationCheckpointingStrategy, LLaDAConfig


def rotate(x, theta):
    L, half = x.shape[-2], x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float) / (2 * half))
    angles = torch.arange(L, dtype=torch.float)[:, None] * inv_freq  # absolute positions, as published
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


class LLaDABlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.heads, self.theta = config.n_heads, config.rope_theta
        self.attn_norm, self.ff_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=False)

    def forward(self, x):
        B, L, D = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(B, L, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        a = F.scaled_dot_product_attention(rotate(q, self.theta), rotate(k, self.theta), v)  # no mask at all
        x = x + self.attn_out(a.transpose(1, 2).reshape(B, L, D))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.embedding_size, config.d_model),
            blocks=nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
            ln_f=nn.LayerNorm(config.d_model),
            ff_out=nn.Linear(config.d_model, config.embedding_size, bias=False),
        ))
        self.activation_checkpointing_strategy = None

    def set_activation_checkpointing(self, strategy):
        self.activation_checkpointing_strategy = strategy

    def forward(self, input_ids, attention_mask=None):
        from torch.utils.checkpoint import checkpoint

        x = self.transformer.wte(input_ids)
        for i, block in enumerate(self.transformer.blocks):
            if (self.activation_checkpointing_strategy == ActivationCheckpointingStrategy.whole_layer
                    or (self.activation_checkpointing_strategy == ActivationCheckpointingStrategy.one_in_two and i % 2 == 0)):
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.transformer.ff_out(self.transformer.ln_f(x))


class LLaDAModelLM(PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock"]

    def __init__(self, config, model=None, init_params=False):
        super().__init__(config)
        self.model = model if model is not None else LLaDAModel(config)  # (no post_init(), as published)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, **kwargs):
        if use_cache is None:
            use_cache = self.config.use_cache
        return CausalLMOutputWithPast(logits=self.model(input_ids, attention_mask), past_key_values=None)

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        return self.model.transformer.ff_out

    def tie_weights(self):
        if self.config.weight_tying:
            self.model.transformer.ff_out.weight = self.model.transformer.wte.weight
'''

DREAM_CONFIG = '''
from transformers import PretrainedConfig


class DreamConfig(PretrainedConfig):
    model_type = "Dream"

    def __init__(self, vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, rope_theta=10000.0, rope_scaling=None,
                 mask_token_id=None, tie_word_embeddings=False, **kwargs):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.max_position_embeddings, self.rope_theta, self.rope_scaling = max_position_embeddings, rope_theta, rope_scaling
        self.mask_token_id = mask_token_id
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
'''

DREAM_GENERATION = '''
from transformers import GenerationConfig


class DreamGenerationConfig(GenerationConfig):
    def __init__(self, **kwargs):
        self.temperature = kwargs.pop("temperature", 0.0)
        self.steps = kwargs.pop("steps", 512)
        self.alg = kwargs.pop("alg", "origin")
        self.mask_token_id = kwargs.pop("mask_token_id", None)
        self.pad_token_id = kwargs.pop("pad_token_id", None)
        self.eos_token_id = kwargs.pop("eos_token_id", None)
        self._from_model_config = kwargs.pop("_from_model_config", False)
        self.transformers_version = kwargs.pop("transformers_version", None)
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.validate(is_init=True)

    def validate(self, is_init=False):
        pass


class DreamGenerationMixin:
    def diffusion_generate(self, inputs=None, generation_config=None, **kwargs):
        raise NotImplementedError("the stand-in does not generate by itself")
'''

DREAM_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import MaskedLMOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import PreTrainedModel

from .configuration_dream import DreamConfig
from .generation_utils import DreamGenerationConfig, DreamGenerationMixin


class DreamRotaryEmbedding(nn.Module):
    def __init__(self, config, device=None):
        super().__init__()
        self.rope_kwargs = {}
        self.rope_type = "default" if config.rope_scaling is None else config.rope_scaling.get("rope_type")
        self.config = config
        self.rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = self.rope_init_fn(self.config, device, **self.rope_kwargs)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DreamLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_attention_heads
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=True) for _ in range(3))
        self.o_proj = nn.Linear(d, d, bias=False)
        self.gate_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, d, bias=False)
        self.rotary_emb = DreamRotaryEmbedding(config)

    def forward(self, x, attention_mask, position_ids):
        B, L, D = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(B, L, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = self.rotary_emb(v, position_ids)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        mask = None if isinstance(attention_mask, str) or attention_mask is None else attention_mask
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        x = x + self.o_proj(a.transpose(1, 2).reshape(B, L, D))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DreamPreTrainedModel(PreTrainedModel):
    config_class = DreamConfig
    base_model_prefix = "model"

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.2)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        _model = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        # as published: the generation config loaded by from_pretrained lacks Dream's attributes
        _model.generation_config = DreamGenerationConfig.from_pretrained(pretrained_model_name_or_path)
        return _model


class DreamBaseModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DreamLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)


class DreamModel(DreamGenerationMixin, DreamPreTrainedModel):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config):
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        B, L = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(L)[None].expand(B, L)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, attention_mask, position_ids)
        logits = self.lm_head(self.model.norm(x))
        return MaskedLMOutput(logits=torch.cat([logits[:, 1:], logits[:, :1]], 1))  # [:, i] predicts token i + 1
'''


def write_llada(path: Path, tokenizer, seed: int = 0) -> Path:
    """A LLaDA stand-in directory; its weights come from the published class built directly (no transformers
    loading involved), so a test can compare against them."""
    config = {"model_type": "llada", "architectures": ["LLaDAModelLM"],
              "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"},
              "d_model": 32, "n_heads": 4, "n_layers": 2, "mlp_hidden_size": 64, "vocab_size": len(tokenizer),
              "embedding_size": len(tokenizer), "max_sequence_length": 64, "rope_theta": 10000.0,
              "mask_token_id": tokenizer.mask_token_id, "weight_tying": False}
    return write(path, tokenizer, config, {"configuration_llada.py": LLADA_CONFIG, "modeling_llada.py": LLADA_MODEL},
                 "modeling_llada", "LLaDAModelLM", seed)


def write_dream(path: Path, tokenizer, seed: int = 0) -> Path:
    config = {"model_type": "Dream", "architectures": ["DreamModel"],
              "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
              "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 64, "rope_theta": 10000.0, "rope_scaling": None,
              "mask_token_id": tokenizer.mask_token_id, "tie_word_embeddings": False}
    path = write(path, tokenizer, config, {"configuration_dream.py": DREAM_CONFIG,
                                           "generation_utils.py": DREAM_GENERATION,
                                           "modeling_dream.py": DREAM_MODEL}, "modeling_dream", "DreamModel", seed)
    (path / "generation_config.json").write_text(json.dumps({"steps": 512, "alg": "entropy", "temperature": 0.2,
                                                             "mask_token_id": tokenizer.mask_token_id}))
    return path


def write(path: Path, tokenizer, config: dict, files: dict[str, str], module: str, cls: str, seed: int) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    (path / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(path)
    weights = {name: random_like(t, seed, i) for i, (name, t) in enumerate(direct_model(path).state_dict().items())}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def random_like(t: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + index)
    noise = torch.randn(t.shape, generator=generator)
    return (noise * 0.3 if t.dim() > 1 else 1 + 0.1 * noise).contiguous()


def direct_model(path: Path, weights: bool = False):
    """The stand-in's published class built directly from its config, outside `from_pretrained` (what the code
    computes when nothing about transformers 5 gets in the way); with `weights`, the saved weights loaded."""
    import sys

    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from dllm_rl.policy.compat import default_rope

    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    config.use_cache = False  # LLaDA's forward reads it
    model_class = get_class_from_dynamic_module(config.auto_map["AutoModel"], str(path))
    module = sys.modules[model_class.__module__]
    table = getattr(module, "ROPE_INIT_FUNCTIONS", None)
    if table is not None and "default" not in table:  # Dream: the frequencies transformers 4 computed
        module.ROPE_INIT_FUNCTIONS = {**ROPE_INIT_FUNCTIONS, "default": default_rope}
    model = model_class(config).eval()
    if table is not None:
        module.ROPE_INIT_FUNCTIONS = table  # as published again
    if weights:
        model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model
