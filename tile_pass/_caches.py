"""The package's caches, of one kind, and the thread that traces for them.

Every cache tile_pass keeps (programs, plans, traced tiles and kernels, derived token weights,
rewritten textbook graphs) is a :class:`BoundedCache`: a least-recently-used map with a limit,
safe to share between threads, registered here so that :func:`clear_caches` empties them all.
A long run that meets many shapes (or a notebook that recompiles) keeps only what it still uses.

Tracing happens on one helper thread (:func:`on_tracing_thread`). A custom op's implementation
runs below the autograd dispatch keys, so autograd records nothing there; a fresh thread has the
default dispatch state, and tracing only touches fake tensors. Tracing also holds Dynamo's
compile lock (:func:`tracing_lock`): FX tracing keeps process-global state (the "is tracing"
flag and the active patcher); a trace at run time in one thread while another thread compiles
would interleave that state and leave the flag set, after which every later compile in the
process fails with "symbolically trace a dynamo-optimized function".

This module imports nothing from the package: every phase may use it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

_Value = TypeVar("_Value")

_registered: weakref.WeakSet[BoundedCache] = weakref.WeakSet()


_NO_ANSWER = object()  # :meth:`BoundedCache.decided`'s kept ``None``


class BoundedCache:
    """A least-recently-used map of at most ``limit`` entries, emptied by :func:`clear_caches`.

    ``None`` is never a value (:meth:`get` returns it for a missing key). With
    ``find_while_referenced``, an entry evicted (or cleared) stays found while something else
    still holds its value: a registry whose values a compiled graph refers to by key (the
    program registry) then never loses one a live graph holds, and still forgets the rest.
    """

    def __init__(self, name: str, limit: int, *, find_while_referenced: bool = False):
        self.name = name
        self.limit = limit
        self._entries: OrderedDict = OrderedDict()
        self._held: weakref.WeakValueDictionary | None = (
            weakref.WeakValueDictionary() if find_while_referenced else None
        )
        self._lock = threading.Lock()
        _registered.add(self)

    def get(self, key: Hashable) -> Any:
        """The value of ``key`` (now the most recently used), or ``None``. A hit takes no lock
        (a step asks its caches several times): each dictionary operation is atomic."""
        value = self._entries.get(key)
        if value is not None:
            try:
                self._entries.move_to_end(key)
            except KeyError:  # evicted by another thread in between: the value stands
                pass
            return value
        if self._held is None:
            return None
        with self._lock:
            value = self._held.get(key)
            if value is not None:
                self._keep(key, value)  # still held by a graph: recently used again
            return value

    def __getitem__(self, key: Hashable) -> Any:
        """The value of ``key`` without marking it used (a plain dictionary read, which Dynamo
        traces where a compiled function reads a cache); ``KeyError`` where missing."""
        return self._entries[key]

    def put(self, key: Hashable, value: _Value) -> _Value:
        """Keep ``value`` for ``key`` (the most recently used); returns ``value``."""
        with self._lock:
            self._keep(key, value)
        return value

    def decided(self, key: Hashable, decide: Callable[[], _Value | None]) -> _Value | None:
        """``decide()`` once per ``key``, its ``None`` (no answer) kept too: an analysis asked again
        with the same program and sizes."""
        known = self.get(key)
        if known is None:
            known = self.put(key, _NO_ANSWER if (answer := decide()) is None else answer)
        return None if known is _NO_ANSWER else known

    def setdefault(self, key: Hashable, value: _Value) -> _Value:
        """The value kept for ``key``, or ``value`` kept for it where there is none."""
        with self._lock:
            found = self._entries.get(key)
            if found is None and self._held is not None:
                found = self._held.get(key)
            if found is None:
                found = value
            self._keep(key, found)
            return found

    def _keep(self, key, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if self._held is not None:
            self._held[key] = value
        while len(self._entries) > self.limit:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (one still held elsewhere stays found, see the class docstring)."""
        with self._lock:
            self._entries.clear()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator:
        with self._lock:
            return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"BoundedCache({self.name!r}, {len(self)}/{self.limit})"


def registered() -> list[BoundedCache]:
    """Every cache alive in the process, by name."""
    return sorted(_registered, key=lambda cache: cache.name)


def clear_caches() -> None:
    """Empty every tile_pass cache: programs no compiled graph holds, tile plans, traced tile
    functions, compiled accumulation kernels, derived token-weight graphs, rewritten textbook
    graphs (each is rebuilt on next use); ``torch._dynamo.reset()`` does not reach them."""
    for cache in registered():
        cache.clear()


#: Set on the tracing thread, whose caller already holds the compile lock for it.
_tracer_state = threading.local()
#: the tracing thread (started by the first trace: an executor starts its threads on submit)
_tracer = concurrent.futures.ThreadPoolExecutor(1, "tile_pass_tracer")


def tracing_lock():
    """Dynamo's compile lock (an ``RLock``): no FX tracing of ours overlaps a compile or
    another trace in any thread (see the module docstring)."""
    if getattr(_tracer_state, "caller_holds_lock", False):
        return contextlib.nullcontext()
    from torch._dynamo.convert_frame import compile_lock

    return compile_lock


def _as_tracer(trace: Callable[[], _Value]) -> _Value:
    _tracer_state.caller_holds_lock = True
    return trace()


def on_tracing_thread(trace: Callable[[], _Value]) -> _Value:
    """``trace()`` on the tracing thread, under the compile lock (see the module docstring);
    called there already (a trace that needs another), it runs at once."""
    if getattr(_tracer_state, "caller_holds_lock", False):
        return trace()
    with tracing_lock():
        return _tracer.submit(_as_tracer, trace).result()


def shapes_of(tensors) -> tuple:
    """The shapes and dtypes of ``tensors``: with a program's key, what an analysis of it depends on."""
    return tuple((tuple(t.shape), t.dtype) for t in tensors)
