"""The model of the RTP benchmarks: fairscale's GPT-2-like transformer language model.

Sequence-first (``[seq, batch]`` tokens in, ``[seq, batch, vocab]`` logits out), embedding scaled by
sqrt(ninp), sinusoidal positions, post-LN decoder layers with causal self-attention and a ReLU FFN, and a
Linear to the vocabulary. Two departures from fairscale, neither of which changes the arithmetic:

- attention is written with separate q/k/v/out ``nn.Linear``s and ``scaled_dot_product_attention``
  instead of ``nn.MultiheadAttention``, whose packed ``in_proj`` and functional forward bypass module
  forwards, so neither tensor parallelism nor rsdp could shard its projections;
- dropout is 0 (for determinism), so the layers have no dropout modules at all;
- the FFN's two Linears sit in a module of their own (``ffn``), so that a tensor-parallel plan names
  the MLP as a sub-block (``DECODER_LAYER_PLAN``, used by tensor parallelism and by rsdp's ring plan).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

INIT_RANGE = 0.1  # fairscale's ``initrange`` for the embedding and the output Linear
# Megatron's split of a decoder layer: heads and FFN columns (q/k/v, linear1) column-wise, the out
# projection and linear2 row-wise.
DECODER_LAYER_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.out_proj": RowwiseParallel(),
    "ffn.linear1": ColwiseParallel(),
    "ffn.linear2": RowwiseParallel(),
}


class ScaledEmbedding(nn.Module):
    """Token embedding times sqrt(ninp). It wraps a stock ``nn.Embedding`` rather than subclassing it
    (as fairscale does) so that rsdp and tensor parallelism recognise the embedding."""

    def __init__(self, vocab_size: int, ninp: int):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, ninp)
        nn.init.uniform_(self.embedding.weight, -INIT_RANGE, INIT_RANGE)
        self.scale = math.sqrt(ninp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens) * self.scale


class PositionalEncoding(nn.Module):
    """Adds the fixed sinusoidal encoding of "Attention Is All You Need" to ``[seq, batch, ninp]``."""

    def __init__(self, ninp: int, max_len: int):
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float32)
        inverse_wavelength = torch.exp(torch.arange(0, ninp, 2, dtype=torch.float32) * (-math.log(10000.0) / ninp))
        angle = torch.outer(position, inverse_wavelength)
        encoding = rearrange([angle.sin(), angle.cos()], "sin_cos seq half -> seq 1 (half sin_cos)")
        self.register_buffer("encoding", encoding, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Cast to the activations' dtype so that bf16 activations are not promoted to fp32 here.
        return x + self.encoding[: x.shape[0]].to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, ninp: int, nhead: int):
        super().__init__()
        if ninp % nhead:
            raise ValueError(f"ninp ({ninp}) must be divisible by nhead ({nhead})")
        self.head_dim = ninp // nhead
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(ninp, ninp) for _ in range(3))
        self.out_proj = nn.Linear(ninp, ninp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Split by head size, not head count: under tensor parallelism a rank holds nhead / world heads.
        q, k, v = (
            rearrange(proj(x), "seq batch (head dim) -> batch head seq dim", dim=self.head_dim)
            for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(rearrange(attended, "batch head seq dim -> seq batch (head dim)"))


class FeedForward(nn.Module):
    def __init__(self, ninp: int, nhid: int):
        super().__init__()
        self.linear1 = nn.Linear(ninp, nhid)
        self.linear2 = nn.Linear(nhid, ninp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(F.relu(self.linear1(x)))


class DecoderLayer(nn.Module):
    """fairscale's decoder layer (a post-LN ``nn.TransformerEncoderLayer`` with a causal mask)."""

    def __init__(self, ninp: int, nhead: int, nhid: int):
        super().__init__()
        self.self_attn = CausalSelfAttention(ninp, nhead)
        self.norm1 = nn.LayerNorm(ninp)
        self.ffn = FeedForward(ninp, nhid)
        self.norm2 = nn.LayerNorm(ninp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x))
        return self.norm2(x + self.ffn(x))


class TransformerLM(nn.Module):
    def __init__(self, vocab_size: int, ninp: int, nhead: int, nhid: int, num_decoder_layers: int, max_len: int):
        super().__init__()
        self.embed = ScaledEmbedding(vocab_size, ninp)
        self.pos_encoder = PositionalEncoding(ninp, max_len)
        self.layers = nn.ModuleList(DecoderLayer(ninp, nhead, nhid) for _ in range(num_decoder_layers))
        self.lm_head = nn.Linear(ninp, vocab_size)
        nn.init.uniform_(self.lm_head.weight, -INIT_RANGE, INIT_RANGE)
        nn.init.zeros_(self.lm_head.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.pos_encoder(self.embed(tokens))
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)
