"""torchtitan's Llama 3 decoder, without torchtitan: the same modules, names, shapes and computation.

torchtitan 0.3's ``Llama3Model`` (``torchtitan/models/llama3``) is what rsdp's torchtitan users train,
but it cannot be sharded by a ring plan as it is (its projections are torchtitan's own ``Linear``
subclass, and q/k/v are fused into one ``wqkv`` inside a ``qkv_linear`` module, not siblings of
``wo``), and the GPU machines that run the benchmarks do not have torchtitan. This copy keeps its
structure and its checkpoint names (torchtitan writes the fused ``wqkv`` as ``wq``/``wk``/``wv``):
``tok_embeddings``, ``layers.<i>.attention_norm``, ``layers.<i>.attention.{wq,wk,wv,wo}``,
``layers.<i>.ffn_norm``, ``layers.<i>.feed_forward.{w1,w2,w3}``, ``norm``, ``lm_head``; RMSNorm, RoPE on
q and k, grouped-query attention through SDPA (FlashAttention first, as torchtitan 0.3's ``varlen``
backend computes it) with ``enable_gqa``, SwiGLU ``w2(silu(w1 x) * w3 x)``. tests/test_benchmarks.py checks the names and
shapes against torchtitan's model.

Pitfalls:
- RoPE is applied with real cos/sin tables (each interleaved pair rotated), which computes what
  torchtitan's complex multiply computes, without Llama 3.1's frequency scaling (other angles, the same
  work); the tables are passed into the attention as arguments, so
  the attention holds no tensors besides its Linears (a ring plan's sub-block may hold no others).
- Head counts are read from the shapes (``unflatten(-1, (-1, head_dim))``), as tensor parallelism and
  a ring plan need: a sub-block step runs on 1/W of the heads.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# FlashAttention first: torchtitan 0.3's language models attend with FlashAttention (``varlen``) or
# FlexAttention, and no longer take SDPA; its SDPA wrapper's other backends follow.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class Llama3Config:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_hidden: int = 14336  # torchtitan's compute_ffn_hidden_dim(4096, multiple_of=1024, ffn_dim_multiplier=1.3)
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_tables(config: Llama3Config, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, ``[seq_len, head_dim]`` (each angle twice, for
    the interleaved pairs)."""
    frequencies = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2, device=device).float() / config.head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), frequencies).repeat_interleave(2, dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each interleaved pair (x0, x1) of ``x`` ``[B, L, N, H]`` by its position's angle."""
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (x.float() * cos[:, None] + rotated.float() * sin[:, None]).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: Llama3Config):
        super().__init__()
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = (linear(x).unflatten(-1, (-1, self.head_dim)) for linear in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        with sdpa_kernel(SDPA_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=q.shape[2] != k.shape[2],
            )
        return self.wo(out.transpose(1, 2).contiguous().flatten(2))


class FeedForward(nn.Module):
    def __init__(self, config: Llama3Config):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: Llama3Config):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama3(nn.Module):
    def __init__(self, config: Llama3Config):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.config, tokens.shape[1], tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.lm_head(self.norm(h))


# torchtitan's Llama 3 tensor-parallel plan (``set_llama3_sharding_config``: colwise q/k/v, w1, w3;
# rowwise wo, w2), as an rsdp ring plan with keys from a block.
RING_PLAN = {
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.wo": "rowwise",
    "feed_forward.w1": "colwise",
    "feed_forward.w3": "colwise",
    "feed_forward.w2": "rowwise",
}
