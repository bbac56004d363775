"""Batches on an accelerator: pinned staging buffers, a copy stream, batches copied ahead.

`device_batches` yields its source's batches with every CPU tensor moved to ``device``;
the loader counts a batch only once yielded, so batches copied ahead are never counted
(docs/design.md section 5). CUDA path, per batch pulled from the source::

    slot = n % pool.slots                  # a ring of ``depth + 1`` slots
    pool.wait(slot)                        # host waits for this slot's last H2D copy
    buffer(slot, key).copy_(cpu_tensor)    # host memcpy into a reused pinned buffer
    with copy_stream: dev = buffer.to(device, non_blocking=True)
    event(slot).record(copy_stream)
    ... later, when yielded:
    current_stream.wait_event(event); dev.record_stream(current_stream)

``device="cpu"`` runs the same staging with unpinned buffers, a ``clone`` and no-op
events (`_HostBackend`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from detdata.base.checks import check_count
from detdata.base.errors import ConfigError

MAX_DEPTH = 64
"""Largest accepted ``DeviceFeed.copies_ahead`` (each slot holds one whole batch of host memory)."""

KeyPath = tuple[Any, ...]
"""Where a tensor sits inside a batch: the dict keys / sequence indices leading to it."""


# ------------------------------------------------------------------ checks
def check_device(device: object) -> torch.device:
    """``device`` (``"cpu"``, ``"cuda"``: the current one, ``"cuda:N"``; str or `torch.device`)
    as a concrete `torch.device`; `ConfigError` for other types, CUDA unavailable or an
    index out of range."""
    if isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ConfigError(
                f"device={device!r} is not a valid torch device string ({exc}); hint: use "
                "'cuda', 'cuda:0' or 'cpu'"
            ) from None
    elif isinstance(device, torch.device):
        dev = device
    else:
        raise ConfigError(
            f"device must be a str or torch.device, got {device!r} ({type(device).__name__}); "
            "hint: device='cuda' or device=None for CPU batches"
        )
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ConfigError(
            f"device={str(dev)!r}: only 'cuda' and 'cpu' are supported for device batches; "
            "hint: pass device=None and move batches yourself"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device={str(dev)!r} was requested but CUDA is not available (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); hint: pass "
            "device='cpu' (same staging path, no GPU) or device=None (plain CPU batches)"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if not 0 <= index < count:
        raise ConfigError(
            f"device={str(dev)!r}: CUDA device index {index} is out of range, this process "
            f"sees {count} device(s); hint: use 'cuda:0'..'cuda:{count - 1}' or set "
            "CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", index)


# ---------------------------------------------------------- stream backends
#: A point on the copy stream (None: a synchronous copy, always complete).
Event = torch.cuda.Event


class _HostBackend:
    """``device="cpu"``: plain copies into fresh memory; streams and events are no-ops."""

    pin = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def copy_scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()  # fresh memory: the staging buffer may be rewritten right away

    def record(self) -> Event | None:
        return None

    def hand_over(self, event: Event | None, tensors: list[torch.Tensor]) -> None:
        return None


class _CudaBackend:
    """Copies on a dedicated CUDA stream; the consumer's current stream waits on an event."""

    pin = True

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None) -> None:
        self.device = device
        new_stream: Callable[..., torch.cuda.Stream] = torch.cuda.Stream
        self.stream = new_stream(device=device) if stream is None else stream

    def copy_scope(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device, non_blocking=True)

    def record(self) -> Event:
        new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event
        event = new_event()
        event.record(self.stream)
        return event

    def hand_over(self, event: Event | None, tensors: list[torch.Tensor]) -> None:
        consumer = torch.cuda.current_stream(self.device)
        assert event is not None  # `record` returns one
        event.wait(consumer)
        for tensor in tensors:
            # Allocated on the copy stream but used on the consumer's: without this the
            # caching allocator could hand the block to the next copy while the consumer's
            # kernels still read it.
            tensor.record_stream(consumer)


#: Where `_stage` copies to: the host (``device="cpu"``) or CUDA, with the same methods.
_Backend = _HostBackend | _CudaBackend


# -------------------------------------------------------------------- pool
@dataclass
class _Slot:
    buffers: dict[KeyPath, torch.Tensor] = field(default_factory=dict)
    event: Event | None = None


class PinnedBufferPool:
    """A ring of ``slots`` staging slots, each holding one host buffer per tensor key.

    A buffer is a flat byte tensor (pinned when ``pin``) allocated once per (slot, key path)
    and reused while it fits; a leaf needing more replaces it with ``max(needed, 1.5 x old)``
    bytes, so fixed shapes make exactly ``slots x keys`` `allocations`. A slot's buffers are
    rewritten only after `wait` on the event of its last copy. One live `device_batches`
    iterator uses a pool at a time; a later one may reuse it.
    """

    def __init__(self, slots: int, *, pin: bool) -> None:
        self.slots = check_count(slots, "slots", maximum=MAX_DEPTH)
        self.pin = bool(pin)
        self._slots = [_Slot() for _ in range(self.slots)]
        self.allocations = 0
        self._in_use = False

    def buffers(self) -> list[torch.Tensor]:
        """Every host buffer currently held (all slots, all keys)."""
        return [b for s in self._slots for b in s.buffers.values()]

    def wait(self, slot: int) -> None:
        """Block until the last copy out of ``slot``'s buffers has completed."""
        state = self._slots[slot]
        if state.event is not None:
            state.event.synchronize()
            state.event = None

    def wait_all(self) -> None:
        for slot in range(self.slots):
            self.wait(slot)

    def set_event(self, slot: int, event: Event | None) -> None:
        self._slots[slot].event = event

    def buffer(
        self, slot: int, key: KeyPath, shape: torch.Size, dtype: torch.dtype
    ) -> torch.Tensor:
        """A host tensor of ``shape`` / ``dtype`` backed by ``slot``'s buffer for ``key`` (call
        ``wait(slot)`` first)."""
        needed = shape.numel() * dtype.itemsize
        buffers = self._slots[slot].buffers
        flat = buffers.get(key)
        if flat is None or flat.numel() < needed:
            size = needed if flat is None else max(needed, flat.numel() * 3 // 2)
            flat = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            buffers[key] = flat
            self.allocations += 1
        return flat[:needed].view(dtype).view(shape)

    def acquire(self) -> None:
        if self._in_use:
            raise ConfigError(
                "this PinnedBufferPool is already used by another live device_batches "
                "iterator; hint: give each iterator its own pool (or close the old one)"
            )
        self.wait_all()
        self._in_use = True

    def release(self) -> None:
        self.wait_all()
        self._in_use = False


# --------------------------------------------------------------- staging
@dataclass
class _Staged:
    batch: Any
    event: Event | None
    tensors: list[torch.Tensor]


def _rebuild(obj: Any, items: Iterable[Any]) -> Any:
    """A container of ``obj``'s type holding ``items`` (dict/list/tuple if the type refuses)."""
    container: Callable[..., Any] = type(obj)
    if isinstance(obj, Mapping):
        mapping = dict(items)
        try:
            return container(mapping)
        except TypeError:
            return mapping
    values = list(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return container(*values)
    try:
        return container(values)
    except TypeError:
        return tuple(values) if isinstance(obj, tuple) else values


def _walk(obj: Any, key: KeyPath, leaf: Callable[[KeyPath, torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``leaf(path, t)`` applied to every tensor; other leaves unchanged."""
    if isinstance(obj, torch.Tensor):
        return leaf(key, obj)
    if isinstance(obj, Mapping):
        return _rebuild(obj, ((k, _walk(v, (*key, k), leaf)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, (_walk(v, (*key, i), leaf) for i, v in enumerate(obj)))
    return obj


def _stage(batch: Any, slot: int, backend: _Backend, pool: PinnedBufferPool) -> _Staged:
    pool.wait(slot)
    moved: list[torch.Tensor] = []

    def leaf(key: KeyPath, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.numel() == 0:
            out = tensor.to(backend.device)  # already on a device, sparse, or empty: no staging
        else:
            host = pool.buffer(slot, key, tensor.shape, tensor.dtype)
            host.copy_(tensor)
            out = backend.to_device(host)
        if out.device.type != "cpu":
            moved.append(out)
        return out

    with torch.no_grad(), backend.copy_scope():
        out = _walk(batch, (), leaf)
        event = backend.record()
    pool.set_event(slot, event)
    return _Staged(out, event, moved)


def _deliver(staged: _Staged, backend: _Backend) -> Any:
    backend.hand_over(staged.event, staged.tensors)
    return staged.batch


def _generate(
    source: Iterator[Any], backend: _Backend, pool: PinnedBufferPool, depth: int
) -> Iterator[Any]:
    pending: deque[_Staged] = deque()
    error: Exception | None = None
    exhausted = False
    pulled = 0
    pool.acquire()
    try:
        while True:
            while not exhausted and len(pending) <= depth:
                try:
                    batch = next(source)
                except StopIteration:
                    exhausted = True
                    break
                except Exception as exc:  # raised after the batches staged before it
                    error, exhausted = exc, True
                    break
                pending.append(_stage(batch, pulled % pool.slots, backend, pool))
                del batch
                pulled += 1
            if not pending:
                if error is not None:
                    raise error
                return
            # No local keeps the yielded batch: once the caller drops it, it can be freed.
            yield _deliver(pending.popleft(), backend)
    finally:
        pending.clear()
        pool.release()


def device_batches(
    batches: Iterable[Any],
    device: torch.device | str,
    depth: int = 2,
    *,
    pool: PinnedBufferPool | None = None,
    copy_stream: torch.cuda.Stream | None = None,
) -> Iterator[Any]:
    """Yield ``batches`` with every CPU tensor moved to ``device``, ``depth`` batches ahead.

    * The i-th batch yielded is the i-th of the source: same nesting (container types kept
      when they can be rebuilt), dtypes, shapes and bytes; other leaves unchanged. Yielded
      tensors are fresh memory, never a staging buffer.
    * Before yielding batch ``i`` the source was pulled up to ``i + depth``; those batches
      are not delivered (dropping the iterator discards them). A source's exception is
      raised after the batches pulled before it.
    * Staging buffers come from ``pool`` (default: a `PinnedBufferPool` of ``depth + 1``
      slots). CUDA copies run non-blocking on ``copy_stream`` (default: a new stream); the
      caller's stream waits on the batch's event and each tensor is ``record_stream``-ed.
    * ``device``, ``depth`` and ``pool`` are checked eagerly (`ConfigError`).
    """
    dev = check_device(device)
    depth = check_count(depth, "depth", maximum=MAX_DEPTH)
    backend: _Backend
    if dev.type == "cuda":
        if copy_stream is not None and copy_stream.device != dev:
            raise ConfigError(
                f"copy_stream is on {copy_stream.device} but device is {dev}; hint: create "
                f"the stream with torch.cuda.Stream(device={str(dev)!r})"
            )
        backend = _CudaBackend(dev, copy_stream)
    else:
        if copy_stream is not None:
            raise ConfigError(
                "copy_stream is only meaningful with a CUDA device; hint: drop copy_stream"
            )
        backend = _HostBackend()
    if pool is None:
        pool = PinnedBufferPool(depth + 1, pin=backend.pin)
    elif not isinstance(pool, PinnedBufferPool):
        raise ConfigError(f"pool must be a PinnedBufferPool, got {type(pool).__name__}")
    elif pool.slots < depth + 1:
        raise ConfigError(
            f"pool has {pool.slots} slots but depth={depth} needs at least {depth + 1} "
            f"(one per batch in flight plus the one delivered); hint: "
            f"PinnedBufferPool({depth + 1}, pin=...)"
        )
    elif pool.pin != backend.pin:
        raise ConfigError(
            f"pool has pin={pool.pin} but device {dev} needs pin={backend.pin}; hint: let "
            "device_batches create the pool"
        )
    return _generate(iter(batches), backend, pool, depth)
