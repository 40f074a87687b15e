"""The models ``rsdp plan --model`` plans for, built on the meta device from an installed package.

- ``torchtitan:<family>:<flavor>`` (``torchtitan:llama3:8B``): the family's ``model_registry(flavor)``;
- ``hf:<path to config.json>``: ``transformers``' causal LM for that config;
- ``benchmark``: the RTP benchmarks' transformer LM (a source checkout's ``benchmarks/rtp``).

Each is counted as it trains: next-token cross-entropy on logits cast to fp32 (torchtitan's loss and
Hugging Face's), activation checkpointing applied to every block as torchtitan 0.3 defines it
(:func:`apply_activation_checkpointing`), and attention counted as flash attention does it.

Pitfalls:
- On the meta device SDPA's kernel is the math one, which saves the L x L scores; FlexAttention cannot
  run there at all. Attention is replaced by :class:`FlashAttentionCount`, which has flash attention's
  FLOPs and saved tensors (q, k, v, output, log-sum-exp). With grouped-query attention it counts k and
  v expanded to every head, a small overestimate.
- Mixture-of-experts layers: the meta device's ``_grouped_mm`` has no FLOP formula and refuses fp32, so
  the experts' grouped GEMMs run as :func:`grouped_mm` (torchtitan's ``GroupedExperts._grouped_mm`` seam;
  Hugging Face's ``rsdp_counted_experts`` experts implementation). torchtitan's router enters
  ``torch.autocast`` on its input's device, which torch refuses for "meta": :class:`_MetaAutocast`
  does what autocast would to its gate. Selective checkpointing saves ``topk``, whose values Hugging
  Face's routers then divide in place; :class:`_TopkValuesCopied` hands them a copy.
- Values narrower than queries (multi-head latent attention) are padded to the queries' width for
  the flash attention kernel and the output cut back: that attention's activations are overestimated.
- torchtitan's chunked loss (``--loss-chunks N``, :func:`chunked_next_token_loss`) runs the head
  once per chunk, each chunk's backward inside the loss: the head is the one unit whose forward may run
  again after its backward (``_profile.StepPhases``), and its calls are counted as they run.
"""

import contextlib
import functools
import importlib
import importlib.util
import json
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula

from .._compat import TorchDispatchMode, flash_attention_op
from ._cost_model import attention_window

AC_MODES = ("none", "selective", "full")


class FlashAttentionCount(nn.Module):
    """Flash attention's memory and FLOPs on the meta device, for a torchtitan ``inner_attention``:
    takes and returns ``(batch, seq, heads, head_dim)``."""

    def forward(self, q_BLNH, k_BLNH, v_BLNH, *, scale=None, enable_gqa=False, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        return flash_attention(q, k, v, scale).transpose(1, 2)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Causal flash attention of ``(batch, heads, seq, head_dim)`` tensors, k and v expanded to q's heads;
    values narrower than the queries (multi-head latent attention) padded to their width, the output
    cut back to the values'."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    value_dim = v.shape[-1]
    if value_dim != q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    return flash_attention_op(q, k, v, is_causal=True, scale=scale)[0][..., :value_dim]


def _hf_flash_count(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """Hugging Face's attention interface (``attn_implementation``): output ``(batch, seq, heads, dim)``;
    a sliding-window layer's (gpt-oss, Mistral, Qwen2, Gemma: ``sliding_window``) executed FLOPs are its
    window's band."""
    with attention_window(sliding_window):
        return flash_attention(query, key, value, scaling).transpose(1, 2), None


@torch.library.custom_op("rsdp_planner::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)`` for a ``(rows, k)`` and b ``(groups, k, n)``: the rows of
    group g (``offs[g-1]:offs[g]``, cumulative ends) times ``b[g]``; rows past the last end are left unset,
    as the kernel leaves them. Counted as the experts run: each routed token once, by its own expert."""
    out, start = a.new_empty(a.shape[0], b.shape[-1]), 0
    for group, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end] @ b[group]
        start = end
    return out


@grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty(a.shape[0], b.shape[-1])


@torch.library.custom_op("rsdp_planner::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of :func:`grouped_mm` for its ``b``: per group, its rows of ``a`` transposed times theirs of ``grad``."""
    out, start = a.new_zeros(groups, a.shape[1], grad.shape[1]), 0
    for group, end in enumerate(offs.tolist()):
        out[group] = a[start:end].T @ grad[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _(a, grad, offs, groups):
    return a.new_empty(groups, a.shape[1], grad.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad_b = grouped_mm_weight_grad(a, grad, offs, b.shape[0])  # first, as the kernel's backward makes them
    return grouped_mm(grad, b.transpose(-2, -1), offs), grad_b, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@register_flop_formula(torch.ops.rsdp_planner.grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _torchtitan_grouped_mm(*, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts._grouped_mm`` seam, counted (:func:`grouped_mm`)."""
    return grouped_mm(A, B_t, offs)


def _hf_counted_experts(self, hidden_states, top_k_index, top_k_weights):
    """Hugging Face's ``grouped_mm`` experts implementation with its grouped GEMMs counted
    (:func:`grouped_mm`); registered as the ``rsdp_counted_experts`` experts implementation."""
    from transformers.integrations import moe

    kernel = moe._grouped_mm  # looked up per call by HF's grouped linear; restored at once
    moe._grouped_mm = lambda input, weight, offs: grouped_mm(input.to(weight.dtype), weight, offs)
    try:
        return moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    finally:
        moe._grouped_mm = kernel


class _MetaAutocast(TorchFunctionMode):
    """``torch.autocast(device_type="meta", dtype=...)``, which torch refuses: the floating inputs of the
    matrix products autocast casts (linear, matmul, mm, bmm, addmm) are cast to ``dtype``."""

    CAST = {F.linear, torch.matmul, torch.mm, torch.bmm, torch.addmm, torch.Tensor.matmul, torch.Tensor.__matmul__}

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.CAST:
            cast = lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            args, kwargs = tuple(map(cast, args)), {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _autocast_with_meta(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True, cache_enabled=None):
    if device_type == "meta":
        return _MetaAutocast(dtype) if enabled and dtype is not None else contextlib.nullcontext()
    return _AUTOCAST(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


_AUTOCAST = torch.autocast


class _MetaAutocastForward:
    """Mixed into a module whose forward enters ``torch.autocast`` on its input's device (torchtitan's
    MoE router computes its gate in fp32 so): on the meta device, that autocast is :class:`_MetaAutocast`."""

    def forward(self, *args, **kwargs):
        torch.autocast = _autocast_with_meta  # looked up per call; restored at once
        try:
            return super().forward(*args, **kwargs)
        finally:
            torch.autocast = _AUTOCAST


@functools.cache
def _with_meta_autocast(cls: type) -> type:
    """``cls`` with :class:`_MetaAutocastForward` mixed in."""
    return type(f"{cls.__name__}OnMeta", (_MetaAutocastForward, cls), {})


class _TopkValuesCopied(TorchDispatchMode):
    """Inside a selective checkpoint region, below the caller and above the region's cache: ``topk``'s
    values are handed out as a copy. torchtitan's policy saves ``topk`` (so the experts a token goes to
    stay the same when the region is recomputed); Hugging Face's routers normalise its values in place
    (``router_top_value /= ...``), which would change the cached tensor, and the checkpoint refuses that."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.topk.default:
            return out[0].clone(), out[1]
        return out


class _TopkSafeBlock(nn.Module):
    """A block whose forward runs under :class:`_TopkValuesCopied`; other attributes are the block's."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        with _TopkValuesCopied():
            return self.block(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.block, name)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The planner's training step for a decoder that maps ``(batch, seq)`` token ids to logits (or to an
    output with ``.logits``): it reads ``seq_len`` tokens and predicts the next ones."""
    logits = model(tokens[:, :-1])
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def chunked_next_token_loss(num_chunks: int) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """torchtitan's ``ChunkedLossWrapper`` as a planner training step: the model's forward without its
    head (torchtitan's decoders' ``_skip_lm_head``), then per sequence chunk the head, the
    cross-entropy and that chunk's backward, the chunks' gradients gathered in fp32, and the decoder's
    backward when the returned loss's is called. torchtitan's own code runs, so what it allocates and
    what it asks of an FSDP head (kept unsharded across the chunks, reduced once) is what the step does."""
    try:
        from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    except ImportError as error:
        raise ValueError(
            f"rsdp plan: --loss-chunks {num_chunks} counts torchtitan's chunked loss, and torchtitan cannot be imported "
            f"({error}); install torchtitan or pass --loss-chunks 1."
        ) from None
    wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=num_chunks, loss_fn=CrossEntropyLoss.Config()))

    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        if not hasattr(model, "_skip_lm_head") or not isinstance(getattr(model, "lm_head", None), nn.Module):
            raise ValueError(
                f"rsdp plan: a chunked loss needs a torchtitan decoder (one with _skip_lm_head and lm_head); "
                f"{type(model).__name__} is not one: pass --loss-chunks 1."
            )
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if inputs.shape[1] % num_chunks:
            raise ValueError(
                f"rsdp plan: the chunked loss splits the sequence into {num_chunks} equal chunks, and "
                f"{inputs.shape[1]} tokens do not divide; pick a --seq-len that {num_chunks} divides."
            )
        wrapper.set_lm_head(model.lm_head)
        model._skip_lm_head = True
        try:
            hidden = model(inputs)
        finally:
            model._skip_lm_head = False
        valid_tokens = torch.tensor(float(labels.numel()), device=tokens.device)  # the mean, as next_token_loss
        return wrapper(hidden, labels, valid_tokens)[0]

    return loss


def flash_attention_for_counting(model: nn.Module) -> nn.Module:
    """``model`` with torchtitan's inner attention modules replaced by :class:`FlashAttentionCount`."""
    for name, _ in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] == "inner_attention":
            model.set_submodule(name, FlashAttentionCount())
    return model


def _block_stack(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the transformer blocks, and its name: a ModuleList or ModuleDict named
    ``layers`` (torchtitan's, most of Hugging Face's), else the longest one whose children are all of one
    type (the GPT-2 family's ``h``)."""
    stacks = [(name, module) for name, module in model.named_modules() if isinstance(module, (nn.ModuleList, nn.ModuleDict))]
    for name, module in stacks:
        if name.rsplit(".", 1)[-1] == "layers":
            return module, name
    alike = [(len(module), name, module) for name, module in stacks
             if len(module) > 1 and len({type(child) for child in module.children()}) == 1]
    if alike:
        _, name, module = max(alike, key=lambda entry: entry[0])
        return module, name
    raise ValueError(
        f"rsdp plan: activation checkpointing wraps each transformer block, but {type(model).__name__} has no "
        "'layers' ModuleList or ModuleDict, nor another list of blocks of one type; pass --activation-checkpoint none."
    )


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Wrap every block of ``model`` as torchtitan 0.3's ``activation_checkpoint`` does: ``full``
    recomputes the whole block, ``selective`` (per op) saves the outputs of compute-intensive ops
    (matmuls, attention) but every second matmul, and recomputes the rest."""
    if mode not in AC_MODES:
        raise ValueError(f"rsdp plan: --activation-checkpoint must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return model
    _prepare_torchtitan_imports()
    try:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    except ImportError as error:
        raise ValueError(
            f"rsdp plan: --activation-checkpoint {mode} counts torchtitan's policy, and torchtitan cannot be "
            f"imported ({error}); install torchtitan or pass --activation-checkpoint none."
        ) from None
    policy = (SelectiveAC if mode == "selective" else FullAC).Config().build()
    stack, stack_name = _block_stack(model)
    for name, block in list(stack.named_children()):
        block = _TopkSafeBlock(block) if mode == "selective" else block
        stack.register_module(name, policy._wrap_block(block, base_fqn=f"{stack_name}.{name}"))
    return model


def _prepare_torchtitan_imports() -> None:
    """Before the first import of torchtitan on a machine without triton: its model modules import triton
    kernels (``rsdp.torchtitan._cpu`` stands in for them)."""
    if "torchtitan" not in sys.modules and importlib.util.find_spec("triton") is None:
        from ..torchtitan import _cpu

        _cpu.prepare_imports()


def _torchtitan_model(family: str, flavor: str) -> nn.Module:
    _prepare_torchtitan_imports()
    try:
        registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    except ModuleNotFoundError as error:
        if error.name is not None and f"torchtitan.models.{family}".startswith(error.name):
            import torchtitan.models

            families = sorted(m.name for m in pkgutil.iter_modules(torchtitan.models.__path__) if m.ispkg and m.name != "common")
            raise ValueError(f"rsdp plan: no torchtitan model family {family!r}; torchtitan has {', '.join(families)}.") from None
        raise ValueError(f"rsdp plan: torchtitan's {family} needs the package {error.name!r}, which is not installed; install it.") from None
    except (ImportError, AttributeError) as error:
        raise ValueError(f"rsdp plan: torchtitan's {family} has no model registry ({error}).") from None
    try:
        config = registry(flavor).model
    except KeyError:
        raise ValueError(f"rsdp plan: torchtitan's {family} has no flavor {flavor!r}.") from None
    with torch.device("meta"):
        return torchtitan_moe_for_counting(flash_attention_for_counting(config.build()))


def torchtitan_moe_for_counting(model: nn.Module) -> nn.Module:
    """``model`` with torchtitan's experts' grouped GEMMs counted (:func:`grouped_mm`) and its routers'
    autocast run on the meta device (:class:`_MetaAutocast`); a model without MoE layers is unchanged."""
    from torchtitan.models.common.moe import GroupedExperts, TokenChoiceTopKRouter

    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module._grouped_mm = _torchtitan_grouped_mm
        if isinstance(module, TokenChoiceTopKRouter):
            module.__class__ = _with_meta_autocast(type(module))
    return model


def _hf_model(path: str) -> nn.Module:
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    file = Path(path)
    file = file / "config.json" if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"rsdp plan: --model hf:{path}: no config.json there.")
    try:
        values = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"rsdp plan: --model hf:{path}: {file} is not valid JSON ({error}); fix it or write it with "
                         "transformers' config.to_json_file.") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ValueError(f"rsdp plan: --model hf:{path}: {file} has no model_type; add the architecture's, "
                         'e.g. "model_type": "llama", as transformers writes it.')
    if values["model_type"] not in transformers.CONFIG_MAPPING:
        raise ValueError(f"rsdp plan: --model hf:{path}: transformers {transformers.__version__} knows no model_type "
                         f"{values['model_type']!r} ({file}); fix it or install a transformers that has it.")
    config = transformers.AutoConfig.for_model(**values)
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"rsdp plan: --model hf:{path}: transformers has no causal language model for model_type "
                         f"{values['model_type']!r}; rsdp plan counts next-token training of one.")
    AttentionInterface.register("rsdp_counted_attention", _hf_flash_count)
    ExpertsInterface.register("rsdp_counted_experts", _hf_counted_experts)
    config._attn_implementation = "rsdp_counted_attention"
    config._experts_implementation = "rsdp_counted_experts"
    config.use_cache = False
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _benchmark_model(vocab_size: int, ninp: int, nhid: int, nhead: int, num_decoder_layers: int, seq_len: int) -> tuple[nn.Module, Callable]:
    models = Path(__file__).resolve().parents[2] / "benchmarks" / "rtp"
    if not (models / "transformer_lm.py").exists():
        raise ValueError(f"rsdp plan: the benchmark model is not at {models}; run it from a source checkout of rsdp.")
    sys.path.insert(0, str(models))
    from transformer_lm import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(vocab_size, ninp, nhead, nhid, num_decoder_layers, max_len=seq_len), sequence_first_loss


def sequence_first_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The benchmark model reads ``[seq, batch]``; the planner resizes dim 0 of a batch."""
    sequence_first = tokens.t()
    logits = model(sequence_first[:-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), sequence_first[1:].flatten())


def build(spec: str, benchmark_shape: dict, loss_chunks: int = 1) -> tuple[nn.Module, Callable, int]:
    """The model ``--model spec`` names, its loss function (torchtitan's chunked loss in ``loss_chunks``
    chunks, a torchtitan model's only), and its vocabulary size."""
    if loss_chunks < 1:
        raise ValueError(f"rsdp plan: --loss-chunks must be at least 1, got {loss_chunks}.")
    if loss_chunks > 1 and not spec.startswith("torchtitan:"):
        raise ValueError(
            f"rsdp plan: --loss-chunks {loss_chunks} is torchtitan's chunked loss, for --model torchtitan:...; "
            f"{spec} trains with the whole logits: pass --loss-chunks 1."
        )
    if spec == "benchmark":
        model, loss = _benchmark_model(**benchmark_shape)
        return model, loss, benchmark_shape["vocab_size"]
    kind, _, rest = spec.partition(":")
    if kind == "torchtitan" and rest.count(":") == 1:
        model = _torchtitan_model(*rest.split(":"))
    elif kind == "hf" and rest:
        model = _hf_model(rest)
    else:
        raise ValueError(
            f"rsdp plan: --model {spec!r}: expected torchtitan:<family>:<flavor> (torchtitan:llama3:8B), "
            "hf:<path to config.json>, or benchmark."
        )
    vocab = next((m.weight.shape[0] for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if vocab is None:
        raise ValueError(f"rsdp plan: {spec} has no token embedding; rsdp plan counts the next-token training of a "
                         f"language model (token ids to logits), which {type(model).__name__} is not.")
    return model, chunked_next_token_loss(loss_chunks) if loss_chunks > 1 else next_token_loss, vocab
