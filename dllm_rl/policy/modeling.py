"""The native masked-diffusion transformer: a bidirectional LLaMA-style encoder that predicts masked tokens.

Architecture as in LLaDA (arXiv 2502.09992): pre-norm blocks with RMSNorm, rotary position embeddings,
SwiGLU feed-forward, no causal mask. Attention runs through `torch.nn.functional.scaled_dot_product_attention`.
Differences from LLaDA: a key-padding mask for left-padded batches, positions that count only real tokens (so
a row's outputs do not depend on how much left padding it got), and a block cache for decoding (`BlockCache`,
Fast-dLLM's prefix and dual caches, arXiv 2505.22618).

Registered with the transformers Auto classes on `import dllm_rl`, so `AutoModel.from_pretrained(dir)`
and `AutoModelForMaskedLM.from_pretrained(dir)` load a saved model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, PretrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MaskedLMOutput


class DiffusionLMConfig(PretrainedConfig):
    model_type = "dllm_rl_diffusion_lm"

    def __init__(
        self,
        vocab_size: int = 128,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int | None = None,
        max_position_embeddings: int = 512,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-6,
        initializer_range: float = 0.02,
        mask_token_id: int | None = None,
        pad_token_id: int | None = None,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        # SwiGLU's usual width: 8/3 of the hidden size, rounded up to a multiple of 32.
        self.intermediate_size = intermediate_size or 32 * ((8 * hidden_size // 3 + 31) // 32)
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        if hidden_size % num_attention_heads or (hidden_size // num_attention_heads) % 2:
            raise ValueError(
                f"hidden_size={hidden_size} must split into num_attention_heads={num_attention_heads} heads "
                "of even size (rotary embeddings rotate pairs of channels)"
            )
        super().__init__(pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=bos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))  # cpu: a parameter is made where the module is built
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 even under bf16 autocast: the mean of squares loses precision in bf16.
        x32 = x.float()
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * self.weight).to(x.dtype)


def rotary(x_BHLD: torch.Tensor, positions_BL: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate channel pairs (i, i + D/2) by angle position * theta^(-2i/D) (the GPT-NeoX/LLaMA layout)."""
    half = x_BHLD.shape[-1] // 2
    inv_freq_D2 = theta ** (-torch.arange(half, device=x_BHLD.device, dtype=torch.float32) / half)
    angles_BL1D2 = (positions_BL.float()[:, :, None] * inv_freq_D2)[:, None]
    cos, sin = angles_BL1D2.cos(), angles_BL1D2.sin()
    x1, x2 = x_BHLD[..., :half].float(), x_BHLD[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BHLD.dtype)


@dataclass
class BlockCache:
    """Every layer's keys and values for the whole sequence, as of the last refresh (Fast-dLLM's block cache).

    A forward with `span=None` (a refresh) runs the whole sequence and stores them; a forward with `span=(a, b)`
    runs only positions a..b-1 and lets them attend to the stored keys and values of every other position with
    their own fresh ones in place. The decoder refreshes at the start of every block, then runs the current block
    and everything after it (the prefix cache: the prompt and finished blocks are not recomputed) or the current
    block alone (the dual cache: the masked suffix is not recomputed either). Not exact: in a bidirectional model
    the stored keys and values of the other positions would change with the block's new tokens; refreshing
    every step makes it exact."""

    span: tuple[int, int] | None = None
    keys: list[torch.Tensor] = field(default_factory=list)  # per layer: k_BHLD
    values: list[torch.Tensor] = field(default_factory=list)

    def attend_over(self, layer: int, k_BHAD: torch.Tensor, v_BHAD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values the span's queries attend over: stored on a refresh, spliced in otherwise."""
        if self.span is None:
            self.keys.append(k_BHAD)
            self.values.append(v_BHAD)
            return k_BHAD, v_BHAD
        a, b = self.span
        k, v = self.keys[layer], self.values[layer]
        return (torch.cat([k[:, :, :a], k_BHAD, k[:, :, b:]], dim=2),
                torch.cat([v[:, :, :a], v_BHAD, v[:, :, b:]], dim=2))


class Block(GradientCheckpointingLayer):  # gradient_checkpointing_enable() recomputes it in backward
    def __init__(self, cfg: DiffusionLMConfig):
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.heads, self.theta = cfg.num_attention_heads, cfg.rope_theta
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.gate_up = nn.Linear(d, 2 * f, bias=False)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x_BLD, positions_BL, key_mask_B11L, cache: BlockCache | None = None, layer: int = 0):
        B, L, D = x_BLD.shape  # L: the positions run (a cached forward's span)
        q, k, v = self.qkv(self.attn_norm(x_BLD)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotary(q, positions_BL, self.theta), rotary(k, positions_BL, self.theta)
        if cache is not None:
            k, v = cache.attend_over(layer, k, v)
        attn_BHLD = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask_B11L)
        x_BLD = x_BLD + self.out(attn_BHLD.transpose(1, 2).reshape(B, L, D))
        gate, up = self.gate_up(self.mlp_norm(x_BLD)).chunk(2, dim=-1)
        return x_BLD + self.down(F.silu(gate) * up)


class DiffusionLM(PreTrainedModel):
    """`forward(input_ids, attention_mask)` -> `MaskedLMOutput(logits)`; logits[:, i] predicts token i."""

    config_class = DiffusionLMConfig
    base_model_prefix = "diffusion_lm"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = True
    # With config.tie_word_embeddings the output projection is the input embedding (transformers ties them).
    _tied_weights_keys = {"lm_head.weight": "embed.weight"}

    def __init__(self, config: DiffusionLMConfig):
        super().__init__(config)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        block_cache: BlockCache | None = None,
        **kwargs,
    ) -> MaskedLMOutput:
        """With `block_cache` (decoding only), a refresh or a forward of its span; the logits are the span's."""
        ids_BL = input_ids
        if attention_mask is None:
            attention_mask = torch.ones_like(ids_BL)
        real_BL = attention_mask.bool()
        if position_ids is None:
            # Count real tokens only, so left padding does not shift a row's positions.
            position_ids = (real_BL.long().cumsum(-1) - 1).clamp(min=0)
        key_mask_B11L = real_BL[:, None, None, :]
        a, b = (0, ids_BL.shape[1]) if block_cache is None or block_cache.span is None else block_cache.span
        if block_cache is not None and block_cache.span is None:
            block_cache.keys.clear()
            block_cache.values.clear()
        x_BLD = self.embed(ids_BL[:, a:b])
        for layer, block in enumerate(self.blocks):
            x_BLD = block(x_BLD, position_ids[:, a:b], key_mask_B11L, cache=block_cache, layer=layer)
        return MaskedLMOutput(logits=self.lm_head(self.norm(x_BLD)))


def register_auto_classes() -> None:
    AutoConfig.register(DiffusionLMConfig.model_type, DiffusionLMConfig, exist_ok=True)
    AutoModel.register(DiffusionLMConfig, DiffusionLM, exist_ok=True)
    AutoModelForMaskedLM.register(DiffusionLMConfig, DiffusionLM, exist_ok=True)
