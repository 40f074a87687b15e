"""Peak-memory and communication measurement that works the same on CPU and CUDA.

Memory
------

On CUDA it reads the caching allocator's peak. On CPU there is no allocator statistic, so
``MemoryTracker`` counts storages itself: every storage returned by an op whose schema says the result
is fresh (not a view, not in-place, not ``out=``), plus ``UntypedStorage.resize_``, which FSDP2 uses to
allocate and free its unsharded buffers outside the dispatcher. Buffers that the communication backend
allocates internally (gloo's own) are not seen, for any strategy.

Figures are relative to the moment tracking starts: ``peak_bytes`` is the most memory allocated on top
of whatever already existed (typically the sharded parameters and optimizer state).

A storage is freed when the program lets go of it, whoever else still points at it. A collective's
tensors are also held by its work, which a gloo worker thread lets go of when it next runs after
completing it: often after the program has dropped them, and then the storage (whose Python object the
count made) is freed only once that thread gets the GIL, milliseconds into the program's next work on
a busy host. Counted so, a step's peak depended on thread scheduling: a mixed plan measured 19,491,976
or 21,325,456 bytes on a steady step, and the planner's verification and ``measure_peak`` disagreed. So
every ``c10d`` op gets the program's tensors through aliases that do not own their memory
(``_compat.unowned_alias``); the tracker holds the program's storages until the backend lets go of the
aliases (as the work would hold the tensors: a program may drop a tensor its collective still writes),
and counts a storage freed, before the next allocation, once no tensor refers to it. Pitfalls: a
program that keeps a storage through its Python ``UntypedStorage`` object alone would be counted as
having dropped it; functional collectives (``_c10d_functional``, DTensor's redistributions) allocate
their outputs and are not lent so.

Communication
-------------
``CommCounter`` counts every communication op this rank issues while it is active, whoever issues it:
rsdp's ring (``c10d::send``), FSDP2's all-gathers and reduce-scatters, DDP's C++ reducer and DTensor's
functional collectives all go through the dispatcher. Each op is charged the bytes one rank puts on the
wire under the bandwidth-optimal ring algorithm NCCL uses: a send its size, an all-gather (W-1)/W of
its output, a reduce-scatter (W-1)/W of its input, an all-reduce 2(W-1)/W of its tensor.

On a ring of groups (``rsdp_shard(..., ring_group_size=g)``) the ring's messages go between groups and
its blocks are assembled and reduced by collectives within a group: ``between_groups`` counts the
point-to-point sends (a ring of ranks is a ring of groups of one, so there every ring exchange is
between groups) and ``within_groups`` the collectives on a ring's group, apart, in messages and bytes.
"""

import collections
import dataclasses
import weakref

import torch
import torch.distributed as dist

from ._compat import TorchDispatchMode, is_traceable_wrapper_subclass, tree_flatten, tree_leaves, tree_unflatten, storage_use_count, tensor_use_count, unowned_alias

# Every collective a tracker lent unowned aliases to (see the module docstring): the aliases, and the
# storages of the program's tensors they alias, kept until the backend let go of the aliases (the
# collective's work is gone), as a work would keep the tensors: a program may drop a tensor whose
# collective still reads or writes it. Across trackers: a collective may outlive the tracker that lent it.
_LENT: list[tuple[list[torch.Tensor], list[torch.UntypedStorage]]] = []


def _lend(func, args, kwargs):
    """Run the ``c10d`` op ``func`` on unowned aliases of its CPU tensors; its results give the program's
    tensors back."""
    leaves, spec = tree_flatten((args, kwargs))
    owners = {}  # id(alias) -> the program's tensor (the aliases live in ``leaves`` meanwhile)
    for index, leaf in enumerate(leaves):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.device.type == "cpu"
            and not is_traceable_wrapper_subclass(leaf)
            and leaf.untyped_storage().nbytes()
        ):
            leaves[index] = unowned_alias(leaf)
            owners[id(leaves[index])] = leaf
    args, kwargs = tree_unflatten(leaves, spec)
    out = func(*args, **kwargs)
    if owners:
        aliases = [leaf for leaf in leaves if id(leaf) in owners]
        _LENT.append((aliases, [tensor.untyped_storage() for tensor in owners.values()]))
    results, out_spec = tree_flatten(out)
    return tree_unflatten([owners.get(id(leaf), leaf) for leaf in results], out_spec)


def _dropped_storages() -> list[torch.UntypedStorage]:
    """The lent storages the program dropped: no tensor refers to them, only ``_LENT``'s storage object
    (one reference, however often it is listed)."""
    storages = {id(storage): storage for _, lent in _LENT for storage in lent}
    return [storage for storage in storages.values() if storage_use_count(storage) == 1]


def _release_finished() -> None:
    """Let go of the collectives the backend let go of (their aliases' one reference is ours)."""
    _LENT[:] = [lent for lent in _LENT if any(tensor_use_count(alias) > 1 for alias in lent[0])]


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        inner = (getattr(tensor, attr) for attr in attrs)  # DTensor also names its DeviceMesh here
        return [st for t in inner if isinstance(t, torch.Tensor) for st in _storages(t)]
    if tensor.device.type == "meta":
        return []
    return [tensor.untyped_storage()]


class _LiveStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.peak_since_mark = 0
        self._bytes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            return _lend(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        fresh = [ret.alias_info is None for ret in func._schema.returns]
        if all(fresh):
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    for storage in _storages(leaf):
                        self.resized(storage, storage.nbytes())
        return out

    def resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.settle()  # storages the program dropped after their collective are freed before this one counts
        key = id(storage)
        if key not in self._bytes:
            weakref.finalize(storage, self._freed, key)
            self._bytes[key] = 0
        self._add(nbytes - self._bytes[key])
        self._bytes[key] = nbytes

    def _freed(self, key: int) -> None:
        self._add(-self._bytes.pop(key, 0))

    def settle(self) -> None:
        """Count as freed the lent storages the program dropped (the backend may still hold aliases of
        them), then let go of the collectives the backend let go of."""
        if _LENT:
            for storage in _dropped_storages():
                self._freed(id(storage))
            _release_finished()

    def _add(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)
        self.peak_since_mark = max(self.peak_since_mark, self.current)


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
            self._cuda_peak = self.peak_bytes
            return
        self._live.__exit__(*exc)
        torch.UntypedStorage.resize_ = self._original_resize

    @property
    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            # ``mark`` resets the allocator's peak; the largest one seen before is kept here.
            return max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device) - self._cuda_base)
        return self._live.peak

    def mark(self) -> tuple[int, int]:
        """``(current bytes, peak bytes since the previous mark)``, both relative to entry; starts a
        new interval. Splits one tracked region into phases (the planner's per-module timeline)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            current, peak = self.current_bytes, torch.cuda.max_memory_allocated(self.device) - self._cuda_base
            self._cuda_peak = max(self._cuda_peak, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
            return current, peak
        self._live.settle()
        current, peak = self._live.current, self._live.peak_since_mark
        self._live.peak_since_mark = current
        return current, peak

    @property
    def current_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) - self._cuda_base
        return self._live.current


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


def _size_of(group) -> int:
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    if isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return group.size()


def _share(fraction, tensor_arg: int, group_arg: int):
    """Bytes sent = ``fraction(world)`` times the bytes of argument ``tensor_arg``."""

    def bytes_sent(args) -> float:
        return fraction(_size_of(args[group_arg])) * _nbytes(args[tensor_arg])

    return bytes_sent


def _sent_whole(world: int) -> float:
    return 1


def _gathered(world: int) -> float:  # applied to the input: each rank's shard goes to W-1 peers
    return world - 1


def _scattered(world: int) -> float:
    return (world - 1) / world


def _all_reduced(world: int) -> float:
    return 2 * (world - 1) / world


# op name -> bytes one rank sends for it
_COMM_OPS = {
    "c10d::send": _share(_sent_whole, 0, 1),
    "c10d::barrier": lambda args: 0,
    "c10d::allgather_": _share(_gathered, 1, 2),
    "c10d::_allgather_base_": _share(_gathered, 1, 2),
    "c10d::allgather_into_tensor_coalesced_": _share(_gathered, 1, 2),
    "c10d::reduce_scatter_": _share(_scattered, 1, 2),
    "c10d::_reduce_scatter_base_": _share(_scattered, 1, 2),
    "c10d::reduce_scatter_tensor_coalesced_": _share(_scattered, 1, 2),
    "c10d::allreduce_": _share(_all_reduced, 0, 1),
    "c10d::allreduce_coalesced_": _share(_all_reduced, 0, 1),
    "c10d::broadcast_": _share(_scattered, 0, 1),
    "c10d::alltoall_base_": _share(_scattered, 1, 2),
    "_c10d_functional::all_reduce": _share(_all_reduced, 0, 2),
    "_c10d_functional::all_reduce_coalesced": _share(_all_reduced, 0, 2),
    "_c10d_functional::all_gather_into_tensor": _share(_gathered, 0, 2),
    "_c10d_functional::all_gather_into_tensor_coalesced": _share(_gathered, 0, 2),
    "_c10d_functional::reduce_scatter_tensor": _share(_scattered, 0, 3),
    "_c10d_functional::reduce_scatter_tensor_coalesced": _share(_scattered, 0, 3),
    "_c10d_functional::all_to_all_single": _share(_scattered, 0, 3),
    "_c10d_functional::broadcast": _share(_scattered, 0, 2),
}


@dataclasses.dataclass
class Traffic:
    """Messages and the bytes they carry, counted by ``CommCounter``."""

    messages: int = 0
    nbytes: int = 0

    def add(self, nbytes: int) -> None:
        self.messages += 1
        self.nbytes += nbytes


def _on_ring_group(args) -> bool:
    """Whether a collective runs on the process group of a ring's group (its group is an argument)."""
    from ._fully_shard._ring import within_group_names  # the engine, imported once measuring runs

    for arg in args:
        if isinstance(arg, str) and arg in within_group_names:
            return True
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).group_name in within_group_names
            except RuntimeError:
                continue
    return False


class CommCounter(TorchDispatchMode):
    """Context manager counting the bytes this rank sends, per op, while active.

    Example::

        with CommCounter() as comm:
            model(batch).sum().backward()
        print(comm.bytes_sent, comm.by_op)
    """

    def __init__(self):
        super().__init__()
        self.bytes_sent = 0
        self.by_op: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.between_groups = Traffic()  # point-to-point sends: a ring's exchanges
        self.within_groups = Traffic()  # collectives on a ring's group (``ring_group_size``)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _COMM_OPS:
            sent = int(_COMM_OPS[name](args))
            self.bytes_sent += sent
            self.by_op[name] += sent
            self.calls[name] += 1
            if name == "c10d::send":
                self.between_groups.add(sent)
            elif _on_ring_group(args):
                self.within_groups.add(sent)
        elif "c10d" in name and "wait" not in name and "wrap" not in name and "recv" not in name:
            raise NotImplementedError(f"CommCounter does not know how many bytes {name} sends")
        return func(*args, **(kwargs or {}))
