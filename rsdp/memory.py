"""Peak-memory measurement that works the same on CPU and CUDA, for tests and benchmarks.

On CUDA it reads the caching allocator's peak. On CPU there is no allocator statistic, so
``MemoryTracker`` counts storages itself: every storage returned by an op whose schema says the result
is fresh (not a view, not in-place, not ``out=``), plus ``UntypedStorage.resize_``, which FSDP2 uses to
allocate and free its unsharded buffers outside the dispatcher. Buffers that the communication backend
allocates internally (gloo's own) are not seen, for any strategy.

Figures are relative to the moment tracking starts: ``peak_bytes`` is the most memory allocated on top
of whatever already existed (typically the sharded parameters and optimizer state).
"""

import weakref

import torch
from torch.utils._pytree import tree_leaves

from ._compat import TorchDispatchMode, is_traceable_wrapper_subclass


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        return [st for attr in attrs for st in _storages(getattr(tensor, attr))]
    if tensor.device.type == "meta":
        return []
    return [tensor.untyped_storage()]


class _LiveStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._bytes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = [ret.alias_info is None for ret in func._schema.returns]
        if all(fresh):
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    for storage in _storages(leaf):
                        self.resized(storage, storage.nbytes())
        return out

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        key = id(storage)
        if key not in self._bytes:
            weakref.finalize(storage, self._freed, key)
            self._bytes[key] = 0
        self._add(nbytes - self._bytes[key])
        self._bytes[key] = nbytes

    def _freed(self, key: int) -> None:
        self._add(-self._bytes.pop(key, 0))

    def _add(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)


class MemoryTracker:
    """Context manager measuring peak allocated bytes above the level at entry.

    Example::

        with MemoryTracker(device) as tracker:
            loss = model(batch).sum()
            loss.backward()
        print(tracker.peak_bytes)
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._live: _LiveStorages | None = None
        self._original_resize = None
        self._cuda_base = 0
        self._cuda_peak = 0

    def __enter__(self) -> "MemoryTracker":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_base = torch.cuda.memory_allocated(self.device)
            return self
        self._live = _LiveStorages()
        live = self._live
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            before = storage.nbytes()
            result = original(storage, size)
            if id(storage) in live._bytes or storage.nbytes() != before:
                live.resized(storage, storage.nbytes())
            return result

        torch.UntypedStorage.resize_ = resize_
        live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._cuda_peak = torch.cuda.max_memory_allocated(self.device) - self._cuda_base
            return
        self._live.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize

    @property
    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            if self._cuda_peak:
                return self._cuda_peak
            return torch.cuda.max_memory_allocated(self.device) - self._cuda_base
        return self._live.peak

    @property
    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._cuda_base
        return self._live.current
