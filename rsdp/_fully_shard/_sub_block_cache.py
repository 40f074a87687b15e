"""A key/value cache passed into a ring sub-block: each shard's run sees its own heads, the cache is
written once per call.

A planned attention runs once per weight shard, each run on the heads of that shard, and Hugging
Face's attention calls ``cache.update(keys, values, layer_idx, ...)`` inside it. Handed the cache
itself, the W runs would append W times, each shard's heads as if they were all of them, and each run
would attend over the other shards' keys. So every run gets a ``ShardCacheView`` instead, whose
``update`` returns what the real cache's would return for that shard's heads — computed by the real
layer's own ``update`` on a copy of the layer as it was before the call, its keys and values cut to
those heads — and keeps the shard's new keys and values. Once every shard has run, ``commit`` updates
the real cache with them, heads concatenated in shard order, through the cache's own ``update``.

Which heads a shard holds is derived from the ring's layout: a plan's colwise Linears all divide by the
W ranks (``plan_sub_blocks``), and a layout splits rows torch.chunk-style over the ring's owners (W
ranks, or on a ring of groups W/g groups, whose shard is a block of g ranks' rows), so shard s of S
holds rows [s·n/S, (s+1)·n/S) of each, which are heads [s·h, (s+1)·h) of each head-shaped tensor with h
heads per shard (k and v have fewer heads than q under grouped-query attention, in the same proportion).

Pitfalls:
- Only layers whose ``update`` treats every head alike may be cut to heads: Hugging Face's dynamic and
  static layers, full or sliding-window (``DynamicCache``, and ``StaticCache`` of
  ``generate(cache_implementation="static")``). Other caches (quantized ones quantize across heads,
  offloading moves layers between devices, ``EncoderDecoderCache`` is read directly by cross-attention)
  and every other object passed into a sub-block that is not a plain value are refused before its
  ring starts, on every rank; the view has ``update`` only, so a sub-block reading anything else of
  the cache raises instead of reading all heads.
- A recomputation in backward (activation checkpointing, a second backward) runs a shard again after
  the commit: ``update`` then answers from the copy of the layer taken before the call (kept only when
  the call may be backpropagated) and records nothing.
- Inside the ring a shard's run reads the cache's past keys and values, but they are no input of the
  ring's autograd Function, so no gradient would reach them, where the unsharded model would
  backpropagate through them into the forward that filled them: a differentiable call refuses a layer
  whose states require grad, at its first shard's run (on every rank). The committed keys and values
  carry no graph (it would hold the ring's shard graphs alive with the cache); where the call was
  differentiable they require grad, so that a later differentiable call refuses them, and a gradient
  reaching them elsewhere raises.
"""

import contextlib
import copy
import enum
import sys
import types

import torch

# Leaves of a sub-block's arguments that its W runs cannot change.
_PLAIN_VALUES = (
    type(None), bool, int, float, complex, str, bytes, enum.Enum, torch.dtype, torch.device, torch.layout,
    torch.memory_format, types.FunctionType, types.BuiltinFunctionType,
)  # fmt: skip


def _unchanging(leaf) -> bool:
    """A tensor, a plain value, a function, or flex attention's block mask (Hugging Face's and
    torchtitan's attention mask under flex attention; one can only exist once its module is loaded)."""
    if isinstance(leaf, (torch.Tensor, *_PLAIN_VALUES)):
        return True
    flex_attention = sys.modules.get("torch.nn.attention.flex_attention")
    return flex_attention is not None and isinstance(leaf, flex_attention.BlockMask)


def _supported_cache_types():
    """Hugging Face's caches and layers that can be cut to heads, if transformers is loaded (a cache
    object of it can only exist then); ``((), ())`` otherwise."""
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return (), ()
    layers = (
        cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer, cache_utils.StaticLayer,
        cache_utils.StaticSlidingWindowLayer,
    )  # fmt: skip
    return (cache_utils.DynamicCache, cache_utils.StaticCache), layers


def shard_cache_arguments(
    block_name: str, leaves: list, shards: int, differentiable: bool, advice: str
) -> tuple[list, "SubBlockCache | None"]:
    """A sub-block call's argument leaves with its cache (if any) replaced by a ``ShardCacheView``, and
    the cache's ``SubBlockCache``; raises for any other leaf that is not a tensor or a plain value.
    ``differentiable``: whether the call's output may be backpropagated (grad mode on and some input or
    parameter requiring grad). ``shards``: how many runs split the heads (the ring's owners).
    ``advice``: which ring_plan entries to drop, ending a refusal."""
    cache_types, layer_types = _supported_cache_types()
    cache = None
    leaves = list(leaves)
    for index, leaf in enumerate(leaves):
        if _unchanging(leaf):
            continue
        where = f"rsdp ring_plan: sub-block {block_name!r} was called with a {type(leaf).__name__}"
        if type(leaf) not in cache_types:
            raise TypeError(
                f"{where}; its forward runs once per weight shard, so an object it may change (a cache, a "
                "counter) would be changed once per shard, and rsdp cannot tell which objects stay unchanged: "
                "it takes tensors, plain values, functions and flex attention's BlockMask, makes Hugging Face's "
                "DynamicCache and StaticCache exact, and refuses other objects. Pass use_cache=False (or one of "
                f"those caches), or leave the sub-block out of ring_plan.{advice}"
            )
        unsupported = [type(layer).__name__ for layer in leaf.layers if type(layer) not in layer_types]
        replicated = leaf.layer_class_to_replicate
        if replicated is not None and replicated not in layer_types:
            unsupported.append(replicated.__name__)
        if unsupported or leaf.offloading or cache is not None:
            problem = (
                f"layers of types {sorted(set(unsupported))}" if unsupported
                else "offloading" if leaf.offloading else "a second cache"
            )  # fmt: skip
            raise TypeError(
                f"{where} with {problem}; a planned sub-block's cache is updated per shard of heads, which rsdp "
                "does for dynamic and static full or sliding-window layers, not offloaded, one cache per call. Use "
                f"such a cache, use_cache=False, or leave the sub-block out of ring_plan.{advice}"
            )
        cache = SubBlockCache(block_name, leaf, shards, differentiable)
        leaves[index] = cache.view
    return leaves, cache


class ShardCacheView:
    """The cache as one shard's run of a sub-block sees it: ``update`` only."""

    def __init__(self, owner: "SubBlockCache"):
        self._owner = owner

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._owner.update(key_states, value_states, layer_idx, args, kwargs)

    def __getattr__(self, name: str):
        raise RuntimeError(
            f"rsdp ring_plan: sub-block {self._owner.block_name!r} read cache.{name}; its forward runs once per "
            "weight shard on that shard's heads, and rsdp supports only cache.update(...) there. Pass "
            "use_cache=False or leave the sub-block out of ring_plan."
        )


class SubBlockCache:
    """One sub-block call's use of a cache: the per-shard ``update``s, then one ``commit``."""

    def __init__(self, block_name: str, cache, shards: int, differentiable: bool):
        self.block_name, self.cache, self.shards = block_name, cache, shards
        self.view = ShardCacheView(self)
        self.shard: int | None = None  # whose run is on: set by the ring step before it runs
        self.layer_idx: int | None = None
        self._past = None  # the layer as it was before this call
        self._new: dict[int, tuple] = {}  # shard -> (keys, values, update's other arguments)
        self._committed = False
        # Decided by the sub-block's call: its ring steps run inside an autograd Function's forward,
        # where grad mode is off.
        self._differentiable = differentiable

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, args: tuple, kwargs: dict):
        """What the real cache's ``update`` returns for this shard's heads; records its new keys and values."""
        if self.layer_idx is None:
            self.layer_idx = layer_idx
            self._past = self._layer_before(layer_idx)
        elif layer_idx != self.layer_idx:
            raise RuntimeError(
                f"rsdp ring_plan: sub-block {self.block_name!r} updated cache layers {self.layer_idx} and {layer_idx} "
                "in one call; a planned sub-block may update one."
            )
        if not self._committed:
            if self.shard in self._new:
                raise RuntimeError(f"rsdp ring_plan: sub-block {self.block_name!r} updated its cache twice in one call.")
            self._new[self.shard] = (keys, values, args, kwargs)
        heads = keys.shape[1]
        for states in (self._past.keys, self._past.values):
            if isinstance(states, torch.Tensor) and states.dim() == 4 and states.shape[1] != heads * self.shards:
                raise RuntimeError(
                    f"rsdp ring_plan: sub-block {self.block_name!r}: the cache holds {states.shape[1]} heads, but each "
                    f"of the {self.shards} shards computes {heads}; was the cache filled by another model?"
                )
        view = _copy_of(self._past, slice(self.shard * heads, (self.shard + 1) * heads))
        return view.update(keys, values, *args, **kwargs)

    def _layer_before(self, layer_idx: int):
        """The real layer as it is before this call (a fresh one where the cache adds layers as they
        come); a copy when a recomputation may ask after the commit."""
        layers = self.cache.layers
        layer = layers[layer_idx] if layer_idx < len(layers) else self.cache.layer_class_to_replicate()
        states = [t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]
        if self._differentiable and any(t.requires_grad for t in states):
            raise RuntimeError(
                f"rsdp ring_plan: sub-block {self.block_name!r} was called with a cache whose keys or values require "
                "grad (filled by a differentiable forward); a planned sub-block reads them inside its ring, where no "
                "gradient reaches them, while the unsharded model would backpropagate through them into that "
                "forward. Fill the cache under torch.no_grad() (or detach it), or run this forward under "
                "torch.no_grad()."
            )
        if not self._differentiable:  # no backward, so nothing asks after the commit
            return layer
        return _copy_of(layer)

    def commit(self) -> None:
        """Update the real cache once, with every shard's new keys and values, heads in shard order."""
        if self.layer_idx is None or self._committed:
            return
        if sorted(self._new) != list(range(self.shards)):
            raise RuntimeError(
                f"rsdp ring_plan: sub-block {self.block_name!r} updated its cache in the runs of shards "
                f"{sorted(self._new)} of {self.shards}; every run must update it once."
            )
        runs = [self._new[shard] for shard in range(self.shards)]
        keys, values = (torch.cat([run[i] for run in runs], dim=1) for i in (0, 1))
        args, kwargs = runs[-1][2], runs[-1][3]
        self._new.clear()
        self._committed = True
        with torch.enable_grad() if self._differentiable else contextlib.nullcontext():
            if self._differentiable:
                keys, values = _NoGradientThroughCache.apply(keys), _NoGradientThroughCache.apply(values)
            self.cache.update(keys, values, self.layer_idx, *args, **kwargs)


def _copy_of(layer, heads: slice = slice(None)):
    """``layer`` with its keys and values cut to ``heads``, whose ``update`` leaves ``layer`` alone: a
    static layer's tensors are copied (it writes them in place); a dynamic layer's ``update`` only
    reassigns its attributes."""
    copied = copy.copy(layer)
    in_place = isinstance(layer, sys.modules["transformers.cache_utils"].StaticLayer)
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            if name in ("keys", "values") and value.dim() == 4:  # [batch, heads, positions, head_dim]
                value = value[:, heads]
            setattr(copied, name, value.clone() if in_place else value)
    return copied


class _NoGradientThroughCache(torch.autograd.Function):
    """Cached keys or values of a ring sub-block, which a gradient may not reach."""

    @staticmethod
    def forward(ctx, states):
        return states.view_as(states)

    @classmethod
    def apply(cls, states: torch.Tensor) -> torch.Tensor:
        """``states`` without their graph, requiring grad so that a gradient reaching them raises."""
        return super().apply(states.detach().requires_grad_())

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "rsdp ring_plan: a gradient reached keys or values that a planned sub-block wrote into a cache in an "
            "earlier forward; rsdp does not backpropagate through a cache into the forward that filled it. Detach "
            "the cache (or build it under torch.no_grad()) before the forward that reads it."
        )
