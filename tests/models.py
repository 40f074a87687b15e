"""Models and checks the rank-side test functions share: TinyLM (GELU blocks), the Llama-shaped
LlamaLM that ring plans shard, and the training loop every trajectory test compares with."""

import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.checkpoint import checkpoint

from rsdp import release_ring_buffers, rsdp_shard
from rsdp._compat import DTensor, fully_shard
from rsdp.memory import MemoryTracker

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from host_overhead import LLAMA_PLAN as HF_PLAN  # noqa: E402  Hugging Face's, keys from the model's root


class Block(nn.Module):
    """Pre-LN transformer block: q/k/v/o attention and a GELU MLP; q and v biased unless ``biases`` is
    False (q/k/v then weights alone: a ring of groups reads their block rank-major)."""

    def __init__(self, dim: int, heads: int, hidden: int, biases: bool = True):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim, bias=biases), nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=biases)
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

    def __init__(self, vocab=37, dim=12, heads=2, hidden=20, layers=2, checkpointing=False, checkpoint_context=None, final_norm=True, biases=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.layers = nn.ModuleList(Block(dim, heads, hidden, biases) for _ in range(layers))
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


def draw_lora_b(model: nn.Module, std: float) -> None:
    """Draw every ``lora_B`` of a peft model from N(0, std²): peft starts them at zero, which would leave
    ``lora_A`` without a gradient."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=std)


def assert_matches_whole(actual, expected, *, what, **tol):
    """``actual`` (a DTensor or a tensor), in ``expected``'s dtype, equals the whole tensor ``expected``.
    A sharded or replicated DTensor is compared where it lies, each rank's local tensor against the same
    part of ``expected`` (``distribute_tensor``'s layout, cut without communication): the ranks together
    compare every element, as after ``full_tensor()``, without an all-gather per parameter. Partial
    values are summed first (``full_tensor``)."""
    if isinstance(actual, DTensor) and not any(p.is_partial() for p in actual.placements):
        assert actual.shape == expected.shape, f"{what}: global shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        expected = distribute_tensor(expected, actual.device_mesh, actual.placements, src_data_rank=None).to_local()
        actual = actual.to_local()
    assert_close(full(actual).to(expected.dtype), expected, what=what, **tol)


def assert_param_grads_match(model, reference, scale, **tol):
    """Every parameter gradient of the sharded model equals ``scale`` times the reference's."""
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected, actual = reference_params[name].grad, param.grad
        if expected is None:
            assert actual is None, f"{name}: unexpected gradient"
            continue
        assert actual is not None, f"{name}: missing gradient"
        assert_matches_whole(actual, expected * scale, what=f"grad of {name}", **tol)


def assert_params_match(model, reference, **tol):
    reference_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert_matches_whole(param.detach(), reference_params[name].detach(), what=name, **tol)


def training_step_transient(model: nn.Module, loss) -> int:
    """Peak bytes allocated by one AdamW step (``loss().backward()``, ``step``, ``zero_grad``) above what
    existed before it, measured after a first step has made the optimizer state and taught the ring
    its buffer sizes; the ring buffers, resident between steps, are counted in the measured step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return warm_step_peak(step)


def forward_backward_peak(model: nn.Module, loss) -> int:
    """Peak bytes allocated by one ``loss().backward()`` above what existed before it, gradients freed
    after as ``zero_grad()`` does, measured after a warm-up step (see ``warm_step_peak``)."""

    def step():
        loss().backward()
        model.zero_grad(set_to_none=True)

    return warm_step_peak(step)


def warm_step_peak(step) -> int:
    """Peak bytes allocated by ``step()`` above what existed before it, measured after a first call has
    taught the ring its buffer sizes; the ring buffers, resident between steps, are released first and
    counted in the measured step."""
    step()
    release_ring_buffers()
    with MemoryTracker() as tracker:
        step()
    return tracker.peak_bytes


TRAJECTORY_RTOL = 1e-6


def shard_lm(model, strategy_per_layer, mesh=None, ring_group_size=1):
    for layer, strategy in zip(model.layers, strategy_per_layer):
        if strategy == "rsdp":
            rsdp_shard(layer, mesh=mesh, ring_group_size=ring_group_size)
        else:
            fully_shard(layer, mesh=mesh or init_device_mesh("cpu", (dist.get_world_size(),)))
    return model


def rsdp_lm(seed, *, mesh=None, ring_group_size=1, **config):
    """A TinyLM with rsdp_shard on every block and the root (rings of groups of ``ring_group_size``),
    and its fp64 reference."""
    torch.manual_seed(seed)
    model = TinyLM(**config).double()
    reference = twin(model)
    shard_lm(model, ["rsdp"] * len(model.layers), mesh=mesh, ring_group_size=ring_group_size)
    rsdp_shard(model, mesh=mesh, ring_group_size=ring_group_size)
    return model, reference


def train_and_compare(model, reference, *, steps, rows, seq, micro_batches=1, sync_last_only=False, clip=None, backward=torch.Tensor.backward):
    """Train both with AdamW on the same global batches; compare losses, gradients and parameters.
    ``backward(loss)`` runs the sharded model's backwards."""
    rank, world = rank_and_world()
    dp_size = world
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    vocab = reference.embed.num_embeddings
    for step in range(steps):
        batches = [torch.randint(0, vocab, (world * rows, seq)) for _ in range(micro_batches)]
        losses = []
        for index, tokens in enumerate(batches):
            if sync_last_only:
                model.set_requires_gradient_sync(index == micro_batches - 1)
            loss = lm_loss(model(local_rows(tokens, rank, world)), local_rows(tokens, rank, world))
            backward(loss / micro_batches)
            losses.append(loss.detach())
        reference_loss = sum(lm_loss(reference(tokens), tokens) for tokens in batches) / micro_batches
        reference_loss.backward()

        mean_loss = torch.stack(losses).mean()
        dist.all_reduce(mean_loss)
        assert_close(mean_loss / dp_size, reference_loss.detach(), what=f"loss at step {step}", rtol=TRAJECTORY_RTOL)
        assert_param_grads_match(model, reference, 1.0, rtol=TRAJECTORY_RTOL, atol=1e-9)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            assert_close(norm.full_tensor(), reference_norm, what="grad norm", rtol=TRAJECTORY_RTOL)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    assert_params_match(model, reference, rtol=TRAJECTORY_RTOL, atol=1e-9)


# torchtitan's vocabulary, keys from the block.
TITAN_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


class Attention(nn.Module):
    """Grouped-query attention with biased q/k/v (Qwen2-style) and a biased o; head counts read from
    the shapes, as tensor parallelism requires. Returns ``(output, None)`` like Hugging Face's."""

    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.head_dim, self.groups = head_dim, heads // kv_heads
        self.q_proj = nn.Linear(dim, heads * head_dim)
        self.k_proj = nn.Linear(dim, kv_heads * head_dim)
        self.v_proj = nn.Linear(dim, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, dim)

    def forward(self, x, attention_bias=None):
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_bias)
        return self.o_proj(out.transpose(1, 2).flatten(2)), None


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Llama-shaped block (RMSNorm, causal attention, SwiGLU) whose sub-blocks a ring plan names."""

    def __init__(self, dim, heads, kv_heads, head_dim, hidden):
        super().__init__()
        self.input_norm, self.post_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.self_attn = Attention(dim, heads, kv_heads, head_dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        seq = x.shape[1]
        causal = torch.full((seq, seq), float("-inf"), dtype=x.dtype).triu(1)
        x = x + self.self_attn(self.input_norm(x), attention_bias=causal)[0]
        return x + self.mlp(self.post_norm(x))


class LlamaLM(nn.Module):
    def __init__(self, vocab, dim, heads, kv_heads, head_dim, hidden, layers):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads, head_dim, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class ScaledMLP(MLP):
    """An MLP that does not return its rowwise Linear's output: a ring plan must refuse it."""

    def forward(self, x):
        return 2 * super().forward(x)  # not the rowwise Linear's own output


def planned_llama(model_class=None, mesh=None, vocab=13, ring_group_size=1):
    """A 2-block fp64 ``LlamaLM`` (or subclass) with heads and hidden units over the shard group,
    sharded with the Hugging Face ring plan (on ``mesh``, else all ranks; rings of groups of
    ``ring_group_size``), and its single-process twin."""
    shards = rank_and_world()[1] if mesh is None else mesh.size(mesh.ndim - 1)
    model = (model_class or LlamaLM)(vocab=vocab, dim=6, heads=2 * shards, kv_heads=shards, head_dim=2, hidden=3 * shards, layers=2)
    model = model.double()
    reference = twin(model)
    for layer in model.layers:
        rsdp_shard(layer, mesh=mesh, ring_plan=HF_PLAN, ring_group_size=ring_group_size)
    rsdp_shard(model, mesh=mesh, ring_group_size=ring_group_size)
    return model, reference


class CustomLinear(nn.Linear):
    """A Linear subclass with its own forward (float8 and LoRA layers look like this)."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) * 1.0


class Conv1D(nn.Module):
    """Hugging Face GPT-2's Conv1D."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class TitanEmbedding(nn.Embedding):
    """torchtitan's Embedding: ``F.embedding`` on the local tensor of a DTensor weight."""

    def forward(self, tokens):
        weight = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        return F.embedding(tokens, weight, self.padding_idx)


class GPTBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.c_attn = Conv1D(dim, dim)
        self.proj = CustomLinear(dim, dim)
        self.c_fc = Conv1D(hidden, dim)
        self.down = nn.Parameter(torch.randn(dim, hidden) * 0.2)  # used as x @ down.t()

    def forward(self, x):
        x = x + self.proj(torch.tanh(self.c_attn(self.ln_1(x))))
        return x + F.gelu(self.c_fc(self.ln_2(x))) @ self.down.t()


class GPTLike(nn.Module):
    def __init__(self, vocab: int = 23, dim: int = 10, hidden: int = 14, layers: int = 2):
        super().__init__()
        self.wte = TitanEmbedding(vocab, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, hidden) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, tokens):
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # the head, tied, in the root's own forward


def loss_of(logits, tokens):
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="sum")


def own_rows(tensor, sizes, rank):
    start = sum(sizes[:rank])
    return tensor[start : start + sizes[rank]]


def check_against_reference(model, reference, inputs, upstream, sizes=None):
    """Outputs, input and parameter gradients against ``reference`` on the whole batch; each rank takes
    its equal share of the rows, or ``sizes[rank]`` rows when ``sizes`` is given."""
    rank, world = rank_and_world()

    def own(tensor):
        return local_rows(tensor, rank, world) if sizes is None else own_rows(tensor, sizes, rank)

    local_inputs = own(inputs).clone()
    if local_inputs.is_floating_point():
        local_inputs.requires_grad_(True)
    out = model(local_inputs)
    (out * own(upstream)).sum().backward()

    reference_inputs = inputs.clone().requires_grad_(inputs.is_floating_point())
    reference_out = reference(reference_inputs)
    (reference_out * upstream).sum().backward()

    assert_close(out, own(reference_out), what="output")
    if local_inputs.is_floating_point():
        assert_close(local_inputs.grad, own(reference_inputs.grad), what="input grad")
    assert_param_grads_match(model, reference, 1 / world)
