"""A small LLaMA-style decoder whose parameters are the protocol's gradient components.

Each block holds exactly the nine block components, registered in protocol order (w_q, w_k,
w_v, w_o, gate, up, down, input_norm, post_attn_norm), so a block's gradients flatten straight
into the wire layout; the model adds the embedding, the final norm and the LM head (tied to the
embedding when `tied`). RMSNorm, grouped-query attention with rotary positions, SwiGLU MLP.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from gradserver.common.components import BlockComponent, NonBlockComponent
from gradserver.common.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    num_layers: int
    vocab: int
    max_seq_len: int
    tied: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"model {self.name}: hidden {self.hidden} must divide by num_heads {self.num_heads}, "
                f"which must divide by num_kv_heads {self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def kv_hidden(self) -> int:
        return self.num_kv_heads * self.head_dim


CONFIGS = {
    "tiny": ModelConfig(
        "tiny",
        hidden=64,
        num_heads=4,
        num_kv_heads=2,
        intermediate=128,
        num_layers=2,
        vocab=256,
        max_seq_len=64,
    ),
    "small": ModelConfig(
        "small",
        hidden=192,
        num_heads=6,
        num_kv_heads=2,
        intermediate=512,
        num_layers=4,
        vocab=256,
        max_seq_len=128,
    ),
    # Few, wide layers and a large (mostly unused) vocabulary: many gradient bytes per token, so
    # a step's communication is a large share of it (bench/training.py over shared memory).
    "wide": ModelConfig(
        "wide",
        hidden=512,
        num_heads=8,
        num_kv_heads=2,
        intermediate=2048,
        num_layers=4,
        vocab=8192,
        max_seq_len=16,
    ),
    "350m": ModelConfig(
        "350m",
        hidden=1024,
        num_heads=16,
        num_kv_heads=4,
        intermediate=4096,
        num_layers=24,
        vocab=32768,
        max_seq_len=1024,
    ),
}


def model_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise InvalidArgumentError(f"--model {name!r} is not one of {', '.join(CONFIGS)}")
    return CONFIGS[name]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dimension of [batch, heads, seq, head_dim]."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        h, kv, i = config.hidden, config.kv_hidden, config.intermediate
        # Registration order is the protocol order of BlockComponent.
        self.w_q = nn.Parameter(torch.empty(h, h))
        self.w_k = nn.Parameter(torch.empty(kv, h))
        self.w_v = nn.Parameter(torch.empty(kv, h))
        self.w_o = nn.Parameter(torch.empty(h, h))
        self.gate = nn.Parameter(torch.empty(i, h))
        self.up = nn.Parameter(torch.empty(i, h))
        self.down = nn.Parameter(torch.empty(h, i))
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))

    def components(self) -> list[nn.Parameter]:
        """The nine parameters in protocol order."""
        return [getattr(self, c.name.lower()) for c in BlockComponent]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        b, t, _ = x.shape
        h = _rms_norm(x, self.input_norm, cfg.norm_eps)
        q = F.linear(h, self.w_q).view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = F.linear(h, self.w_k).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = F.linear(h, self.w_v).view(b, t, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = _rotary(q), _rotary(k)
        repeat = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, cfg.hidden), self.w_o)
        h = _rms_norm(x, self.post_attn_norm, cfg.norm_eps)
        return x + F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Parameter(torch.empty(config.vocab, config.hidden))
        self.blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden))
        self.lm_head = None if config.tied else nn.Parameter(torch.empty(config.vocab, config.hidden))
        self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """Deterministic initialisation: the same seed gives every worker the same weights."""
        generator = torch.Generator().manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.num_layers)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if param.dim() == 1:
                    param.fill_(1.0)
                    continue
                scale = out_std if name.endswith(("w_o", "down")) else std
                values = torch.randn(param.shape, generator=generator) * scale
                param.copy_(values.to(param.device, param.dtype))

    def block_list(self) -> list[TransformerBlock]:
        return [block for block in self.blocks if isinstance(block, TransformerBlock)]

    def non_block_parameters(self) -> dict[NonBlockComponent, nn.Parameter]:
        """LM head, final norm and embedding; a tied LM head is the embedding, sent once."""
        params = {NonBlockComponent.FINAL_NORM: self.final_norm, NonBlockComponent.EMBEDDING: self.embedding}
        if self.lm_head is not None:
            params = {NonBlockComponent.LM_HEAD: self.lm_head, **params}
        return params

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embedding)
        for block in self.blocks:
            x = block(x)
        x = _rms_norm(x, self.final_norm, self.config.norm_eps)
        return F.linear(x, self.embedding if self.lm_head is None else self.lm_head)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.forward(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
