"""Live tensor bytes by category over a region of code, exact, from the lifetimes of storages.

PyTorch keeps allocator statistics on CUDA only, and those say how much, not what. The tracker
follows every storage the region allocates from birth to death and keeps the bytes alive by
category after each event (a storage born, dead, resized or re-categorised; a phase change):

    tr = Tracker(known={"params": params, "optimizer": states})
    with tr:
        with tr.phase("forward"): loss = model(x, y)
        with tr.phase("backward"): loss.backward()
        tr.declare("grads", *grads)      # from now on these storages count as "grads"
    tr.peak, tr.peak_total, tr.timeline

  births  a TorchDispatchMode, under autograd, sees every op's outputs; one whose storage is neither
          tracked nor an input's was allocated by the op and is registered with its nbytes()
          (torch.tensor(data) is built outside and handed to aten.lift_fresh: new too).
  deaths  a weak reference to the storage. PyTorch (2.13; the tests check it) keeps one Python
          UntypedStorage per storage for its whole life and `t.untyped_storage()` returns it every
          time, so the callback fires when the last tensor or view on it goes. It only queues the
          death (it may run on any thread, amid anything); the queue is applied before the next
          event, so frees and allocations keep their order.
  sizes   `UntypedStorage.resize_` is no op (ZeRO-3 frees a gathered buffer with resize_(0), refills
          it with resize_(n)): while a tracker is active it is wrapped, on every thread, and a
          tracked storage's new size counts at once; an op's tracked output has its size re-read.
  saving  a `saved_tensors_hooks` pack hook sees what autograd keeps; as memory.ActivationMeter it
          hands autograd a detached alias (no reference cycle) and watches the alias.

Categories. A storage is in one at a time: the one `known` or `declare` gives it, which wins (a
parameter or a view of one stays "params" when saved; declare re-categorises a storage born a
temporary); else "activations" while an alias autograd saved lives; else "temporaries" (autograd's
intermediate gradients, outputs nobody saves, optimizer scratch). Views count once (one storage);
a zero-size storage counts 0 until it is resized.

What the peak means. `peak` is the bytes by category at the moment when all categories but
"temporaries" together were largest: the state a step must hold, what memory.predict estimates.
`peak_total` is the moment when all of them were: the most tensor memory the region held at once.
Not counted: storages made before the region and not `known` (the input batch, unless named; ops in
place on them, views of them, autograd saving them); what an op allocates and frees inside its
kernel (a matmul's packing, fused attention's workspace); gloo's and NCCL's own buffers, which are
not tensors; storages made outside any op (torch.UntypedStorage(n), torch.from_numpy) until
declared; what an inner saved_tensors_hooks hides (ActivationMeter's; torch.utils.checkpoint's,
whose recomputed tensors count as temporaries). Devices are summed. On a GPU `cuda_max_allocated`
reads more than `peak_total`: blocks rounded up to 512 bytes, cuBLAS's workspace, kernel scratch.

Threads. Dispatch modes and saved-tensor hooks are thread-local: the thread that enters is watched
(and autograd's CUDA backward threads, which inherit its state), no other; so minipar's
communication threads allocate nothing (outputs and receive space are made first, on the main
thread). Deaths and resizes are seen on every thread.
Costs. A Python call per op, a look-up per output, a registration per new storage: a step of a
tiny GPT (2 layers, h = 32, s = 16, batch 8) ~5x as long on CPU (25 ms against 5, one thread; an
empty dispatch mode alone 14 ms), of 4 layers, h = 256, s = 128 ~1.1x; ~200 bytes a live storage:
for one step of a run (minipar.train watches its second). DTensors are seen by their local shards.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OWN = ("activations", "temporaries")  # the categories the tracker decides itself
SAMPLES = 1000  # the timeline keeps at most this many stretches of events (and pinned samples)
LIFT_FRESH = torch.ops.aten.lift_fresh.default  # torch.tensor(data)'s: its input is new


class _Storage(weakref.ref):
    """A tracked storage: a weak reference whose callback queues its death; its bytes, the category
    declared for it (None: the tracker decides) and how many saved aliases hold it."""
    __slots__ = ("key", "nbytes", "declared", "saves")


class _Saved(weakref.ref):
    """A weak reference to an alias autograd saved for backward, and the storage it holds."""
    __slots__ = ("storage",)


def _storage(t) -> torch.UntypedStorage | None:
    """t's storage, or None where it holds no memory of its own (meta, sparse, a wrapper)."""
    try:
        return t.untyped_storage() if isinstance(t, torch.Tensor) and not t.is_meta else None
    except (RuntimeError, NotImplementedError):
        return None


def _leaves(out):
    """The tensors in an op's result (a tensor, or tuples and lists of them)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for x in out:
            yield from _leaves(x)


def _input_storages(args, kwargs) -> set[int]:
    """ids of the storages of an op's tensor (or storage) arguments, and of those in lists."""
    flat = [y for x in (*args, *(kwargs or {}).values())
            for y in (x if isinstance(x, (tuple, list)) else (x,))]
    return {id(y if isinstance(y, torch.UntypedStorage) else _storage(y)) for y in flat}


class _Watch(TorchDispatchMode):
    """Hands every op's outputs to the tracker (a DTensor's op is left to DTensor, which runs it
    on its local shards, seen then: the DTensor's own storage holds no data, yet reads global)."""

    def __init__(self, tracker: "Tracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        self.tracker._outputs(func, (args, kwargs), out)
        return out


class _Timeline:
    """Samples (event, phase, {category: bytes}). The events are cut into stretches of `stride`
    and each stretch keeps its fullest moment (largest total), so that a plot shows every spike
    however long the region; when SAMPLES stretches are full, neighbours merge and the stride
    doubles. Pinned samples (phase changes, entry, exit) are kept besides."""

    def __init__(self):
        self.stride, self.closed, self.open, self.pinned = 1, [], None, []

    def add(self, event: int, phase, total: int, live: dict) -> None:
        if self.open is not None and self.open[0] != event // self.stride:
            self.closed.append(self.open)
            self.open = None
            if len(self.closed) >= SAMPLES:  # merge neighbours, keeping the fuller
                self.stride *= 2
                merged: dict[int, list] = {}
                for index, most, sample in self.closed:
                    if index // 2 not in merged or most > merged[index // 2][1]:
                        merged[index // 2] = [index // 2, most, sample]
                self.closed = list(merged.values())
                if self.closed[-1][0] == event // self.stride:
                    self.open = self.closed.pop()
        if self.open is None:
            self.open = [event // self.stride, -1, None]
        if total > self.open[1]:
            self.open[1:] = [total, (event, phase, dict(live))]

    def samples(self, categories: list, extra=()) -> list:
        stretches = self.closed + ([self.open] if self.open else [])
        every = {s[0]: s for s in [*(b[2] for b in stretches), *self.pinned, *extra] if s}
        return [(e, p, {c: live.get(c, 0) for c in categories})
                for e, p, live in sorted(every.values(), key=lambda s: s[0])]


class Tracker:
    """Live tensor bytes by category over `with tracker:` (see the module docstring).

    known: {category: tensors} counted from the start (None entries skipped), in dict order (a
    storage named twice takes the later category). After the region: `peak`, `peak_phase`,
    `peak_total`, `peak_total_phase`, `timeline`, `cuda_max_allocated` (torch.cuda's
    max_memory_allocated over the region where CUDA is in use, else None); `current` any time."""

    def __init__(self, known: dict | None = None):
        self.known = {c: [t for t in ts if t is not None] for c, ts in (known or {}).items()}
        for category in self.known:
            _check(category)
        self.cuda_max_allocated = None
        self._active, self._lock = False, threading.RLock()
        self._reset()

    def _reset(self, events_only: bool = False) -> None:
        """Forget everything, or only the events so far (the next is event 0)."""
        if not events_only:
            self._live: dict[int, _Storage] = {}   # id(storage) -> its entry
            self._saved: dict[int, _Saved] = {}    # id(ref) -> the ref of a saved alias
            self._dead = collections.deque()       # refs whose referent died, not yet applied
            self._bytes, self._phase = dict.fromkeys([*self.known, *OWN], 0), None
        self._event, self._timeline = -1, _Timeline()
        self._peaks = {"held": (-1, None), "total": (-1, None)}  # (bytes, sample)
        self.most = {}  # {category: its own largest bytes over the region}

    def __enter__(self) -> "Tracker":
        if self._active:
            raise RuntimeError("this Tracker is already active")
        self._reset()
        for category, tensors in self.known.items():
            self._declare(category, tensors)
        self._reset(events_only=True)
        self._change(None, None, 0, 0, pin=True)  # event 0: the state at entry
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
        self._resize_was = torch.UntypedStorage.__dict__.get("resize_")  # (None: inherited)
        torch.UntypedStorage.resize_ = self._wrap_resize(torch.UntypedStorage.resize_)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        self._mode = _Watch(self)
        self._mode.__enter__()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            self._hooks.__exit__(*exc)
            if self._resize_was is None:  # as it was: inherited from torch._C.StorageBase
                del torch.UntypedStorage.resize_
            else:
                torch.UntypedStorage.resize_ = self._resize_was
            with self._lock:
                self._settle()
                self._change(None, None, 0, 0, pin=True)  # the state at exit, which `current` keeps
                self._active = False
                self._live.clear()  # no more callbacks: the weak references die with the entries
                self._saved.clear()
                self._dead.clear()
            self.cuda_max_allocated = torch.cuda.max_memory_allocated() if self._cuda else None

    @contextlib.contextmanager
    def phase(self, name: str):
        """Samples and peaks inside are labelled `name` (None outside any); the previous resumes."""
        previous = self._phase
        self._set_phase(name)
        try:
            yield self
        finally:
            self._set_phase(previous)

    def declare(self, category: str, *tensors) -> None:
        """From now on these tensors' storages count under `category` (None entries skipped).
        Safe from autograd hooks, e.g. `p.register_post_accumulate_grad_hook(lambda p:
        tracker.declare("grads", p.grad))` makes each gradient a "grads" as soon as it is whole."""
        _check(category)
        if not self._active:
            raise RuntimeError("declare inside `with tracker:` (or name the tensors in `known`)")
        self._declare(category, [t for t in tensors if t is not None])

    categories = property(lambda self: list(self._bytes), doc="every category, in order")

    @property
    def current(self) -> dict[str, int]:
        """{category: bytes} alive now (inside the region), or at exit (after it)."""
        with self._lock:
            if self._active:
                self._settle()
            return dict(self._bytes)

    # the moment when all but temporaries were largest; when all of them were; their phases
    peak = property(lambda self: self._at("held")[2])
    peak_phase = property(lambda self: self._at("held")[1])
    peak_total = property(lambda self: self._at("total")[2])
    peak_total_phase = property(lambda self: self._at("total")[1])

    @property
    def timeline(self) -> list[tuple[int, object, dict[str, int]]]:
        """(event index, phase, {category: bytes}) in event order: the states at entry, exit and
        each phase change, both peaks, and the fullest moment of each stretch of events."""
        with self._lock:
            return self._timeline.samples(self.categories, [s for _, s in self._peaks.values()])

    def _at(self, which: str):
        if self._peaks[which][1] is None:
            raise RuntimeError("the tracker has not run: use `with tracker:` first")
        event, phase, live = self._peaks[which][1]
        return event, phase, {c: live.get(c, 0) for c in self.categories}

    def _category(self, entry: _Storage) -> str:
        return entry.declared or ("activations" if entry.saves else "temporaries")

    def _change(self, old, new, before: int, after: int, pin: bool = False) -> None:
        """One event: `before` bytes leave category `old`, `after` join `new` (None: nowhere)."""
        live = self._bytes
        if old is not None:
            live[old] -= before
        if new is not None:
            live[new] = live.get(new, 0) + after
            self.most[new] = max(self.most.get(new, 0), live[new])
        self._event += 1
        total = sum(live.values())
        held, peaks = total - live["temporaries"], self._peaks
        if pin or held > peaks["held"][0] or total > peaks["total"][0]:
            sample = (self._event, self._phase, dict(live))
            for which, size in (("held", held), ("total", total)):
                if size > peaks[which][0]:  # strictly: a tie keeps the first moment
                    peaks[which] = (size, sample)
            if pin:
                self._timeline.pinned.append(sample)
        self._timeline.add(self._event, self._phase, total, live)

    def _settle(self) -> None:
        """Apply the deaths the weakref callbacks queued, in the order they happened."""
        while self._dead:
            ref = self._dead.popleft()
            if isinstance(ref, _Saved):
                if self._saved.pop(id(ref), None) is ref:
                    self._saves(ref.storage, -1)
            elif self._live.get(ref.key) is ref:
                del self._live[ref.key]
                self._change(self._category(ref), None, ref.nbytes, 0)

    def _lookup(self, storage: torch.UntypedStorage) -> _Storage | None:
        """The entry of a live storage. Deaths are applied first, as a dead storage's address (its
        id) may be taken by a new one; the check covers one that died on another thread since."""
        if self._dead:
            self._settle()
        entry = self._live.get(id(storage))
        if entry is not None and entry() is not storage:
            self._settle()
            entry = self._live.get(id(storage))
        return entry

    def _register(self, storage: torch.UntypedStorage, declared) -> None:
        entry = _Storage(storage, self._dead.append)
        entry.key, entry.nbytes, entry.declared, entry.saves = id(storage), storage.nbytes(), \
            declared, 0
        self._live[entry.key] = entry
        self._change(None, self._category(entry), 0, entry.nbytes)

    def _resized(self, entry: _Storage, nbytes: int) -> None:
        if nbytes != entry.nbytes:
            category, before, entry.nbytes = self._category(entry), entry.nbytes, nbytes
            self._change(category, category, before, nbytes)

    def _saves(self, entry: _Storage, delta: int) -> None:
        before = self._category(entry)
        entry.saves += delta
        if self._live.get(entry.key) is entry and self._category(entry) != before:
            self._change(before, self._category(entry), entry.nbytes, entry.nbytes)

    def _declare(self, category: str, tensors) -> None:
        with self._lock:
            for storage in (s for s in map(_storage, tensors) if s is not None):  # (0 bytes: falsy)
                entry = self._lookup(storage)
                if entry is None:
                    self._register(storage, category)
                    continue
                before, entry.declared = self._category(entry), category
                if before != category:
                    self._change(before, category, entry.nbytes, entry.nbytes)

    def _set_phase(self, name) -> None:
        if not self._active:
            raise RuntimeError("tracker.phase(...) goes inside `with tracker:`")
        with self._lock:
            self._settle()
            self._phase = name
            self._change(None, None, 0, 0, pin=True)

    def _outputs(self, func, inputs, out) -> None:
        """An op ran: register the storages it allocated, re-read the size of tracked ones."""
        ours = None  # ids of the inputs' storages, computed when first needed
        with self._lock:
            for t in (out,) if isinstance(out, torch.Tensor) else _leaves(out):
                storage = _storage(t)
                if storage is None:
                    continue
                entry = self._lookup(storage)
                if entry is not None:
                    self._resized(entry, storage.nbytes())
                    continue
                if func is not LIFT_FRESH:
                    ours = _input_storages(*inputs) if ours is None else ours
                    if id(storage) in ours:
                        continue  # a view of, or an op in place on, a storage from before
                self._register(storage, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """autograd saves t: a storage the tracker decides is an activation while the alias lives.
        The alias is detached, as ActivationMeter's: `t` itself, saved as its own node's output,
        would make a cycle that a retained graph (a pipeline's split backward) never frees."""
        storage = _storage(t)
        with self._lock:
            entry = None if storage is None else self._lookup(storage)
        watch = entry is not None and entry.declared is None
        saved = t.detach() if watch or t.grad_fn is not None else t  # an op: outside the lock
        if watch:
            with self._lock:
                ref = _Saved(saved, self._dead.append)
                ref.storage = entry
                self._saved[id(ref)] = ref
                self._saves(entry, +1)
        return saved

    def _wrap_resize(self, original):
        @functools.wraps(original)
        def resize_(storage, size):
            result = original(storage, size)
            with self._lock:
                entry = self._lookup(storage)
                if entry is not None:
                    self._resized(entry, storage.nbytes())
            return result
        return resize_


def _check(category: str) -> None:
    if category in OWN:
        raise ValueError(f"{category!r} is decided by the tracker; declare another category")
