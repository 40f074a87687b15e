"""Models and checks the rank-side test functions share."""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.utils.checkpoint import checkpoint

from rsdp import release_ring_buffers
from rsdp._compat import DTensor
from rsdp.memory import MemoryTracker


class Block(nn.Module):
    """Pre-LN transformer block: q/k/v/o attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.mlp_norm = nn.LayerNorm(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.attn_norm(x)
        q, k, v = (rearrange(proj(h), "b s (h d) -> b h s d", h=self.heads) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(rearrange(attn, "b h s d -> b s (h d)"))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nn.Module):
    """Embedding, transformer blocks, final LayerNorm, LM head tied to the embedding. Without the final
    norm (``final_norm=False``) the root holds no gathered parameters, as in the benchmark LM."""

    def __init__(self, vocab=37, dim=12, heads=2, hidden=20, layers=2, checkpointing=False, checkpoint_context=None, final_norm=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim) if final_norm else nn.Identity()
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight
        self.checkpointing = checkpointing
        # torch.utils.checkpoint's context_fn (selective activation checkpointing); None: full
        self.checkpoint_kwargs = {} if checkpoint_context is None else {"context_fn": checkpoint_context}

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False, **self.checkpoint_kwargs) if self.checkpointing else layer(x)
        return self.lm_head(self.norm(x))


def lm_loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def rank_and_world():
    return dist.get_rank(), dist.get_world_size()


def local_rows(tensor, rank, world):
    """This rank's equal share of a global batch (dim 0)."""
    per_rank = tensor.shape[0] // world
    return tensor[rank * per_rank : (rank + 1) * per_rank]


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def twin(model):
    """A single-process fp64 reference with the same weights."""
    return copy.deepcopy(model).double()


def assert_close(actual, expected, *, what, rtol=1e-9, atol=1e-11):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_param_grads_match(model, reference, scale, **tol):
    """Every parameter gradient of the sharded model equals ``scale`` times the reference's."""
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = reference_params[name].grad
        actual = None if param.grad is None else full(param.grad)
        if expected is None:
            assert actual is None, f"{name}: unexpected gradient"
            continue
        assert actual is not None, f"{name}: missing gradient"
        assert_close(actual.to(expected.dtype), expected * scale, what=f"grad of {name}", **tol)


def assert_params_match(model, reference, **tol):
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert_close(full(param.detach()).to(torch.float64), reference_params[name].detach(), what=name, **tol)


def training_step_transient(model: nn.Module, loss) -> int:
    """Peak bytes allocated by one AdamW step (``loss().backward()``, ``step``, ``zero_grad``) above what
    existed before it, measured after a first step has made the optimizer state and taught the ring
    its buffer sizes; the ring buffers, resident between steps, are counted in the measured step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    release_ring_buffers()
    with MemoryTracker() as tracker:
        step()
    return tracker.peak_bytes
