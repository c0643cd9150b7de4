"""Tensor-parallel targets: one model sharded over N processes by transformers (`tp_plan="auto"`).

transformers shards the model's linear layers over `torch.distributed` ranks; every sharded layer
ends in a collective (all-reduce or all-gather), so EVERY rank must run the SAME forward, with the
same inputs, in the same order, and each rank keeps its own shard (its heads) of every KV cache.
specwire serves from rank 0 only; the other ranks are followers that mirror rank 0's model work:

- `MirroredModel` wraps the model on rank 0. Each call (a forward) first broadcasts its inputs
  (tensors moved to the CPU, and a handle for each KV cache) on a control channel, then runs.
- Caches are matched by handle. A cache rank 0 hands to a forward for the first time gets a twin
  on each follower (a `DynamicCache`/`StaticCache` of the same kind); a cache a forward creates
  itself (guidance's `past_key_values=None`) is registered under a handle sent with the call. The
  cache operations the loops do outside forwards (`crop` on rejected drafts, `reorder_cache` for
  beams, `batch_select_indices`, `batch_repeat_interleave`, `reset`) are broadcast the same way:
  rank 0's cache object gets instance wrappers for them. A cache rank 0 drops is dropped on the
  followers with the next message (the garbage collector's finalizer only queues the handle: a
  broadcast from whatever thread collects it would interleave with the model thread's).
- The batched scheduler's slot cache (`specwire.runtime.slot_cache.SlotKVCache`) is a cache like the
  others: a follower builds a twin of the same size on its own shard (its KV heads; at start-up,
  `adopt_cache`, so that a rank short of memory fails the start, not a request), and the one
  method that writes its tensors outside forwards, `copy` (beam parents' slots), is broadcast. A
  packed step (`PackedStep`, in the forward's kwargs) travels as its cache's handle and its pieces
  `(slot, cursor, token count)`, from which the follower builds the same step; the keys and values are
  written inside the forward's attention on every rank. Allocating and releasing slots and moving
  cursors stay rank 0's bookkeeping (the pieces carry their outcome). The lean decoder
  (`specwire.runtime.lean_decoder`) applies the layers' weights itself, without the sharded layers'
  collectives: the target service refuses it under tensor parallelism.
- The LM head (`get_output_embeddings()`, which DoLa applies to early layers) is mirrored the same
  way; any other sub-module called on rank 0 alone would wait forever in its collective, so the
  loops call only these two.
- `follow(model)` is a follower's whole life: receive, replay on its own model and caches, repeat,
  until rank 0 says stop or the channel breaks (rank 0 died). A failure to replay exits the
  follower (its peers' next collective then fails): a follower that skipped a step would leave the
  ranks' collectives out of step, which hangs instead of failing.

Broadcasts go over a gloo group of their own (CPU tensors, an unbounded timeout: a follower waits
for work as long as the service is idle) whatever the model's backend (gloo on the CPU, nccl with
one GPU per rank). Sampling, logits processing and the token history stay on rank 0: only the
model's forwards and the cache's shape changes are mirrored, so every decoding mode and speculation
run unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import logging
import os
import threading
import weakref
from typing import Any

import torch

log = logging.getLogger("specwire.models.tensor_parallel")

__all__ = [
    "MIRRORED_CACHE_METHODS",
    "MirroredModel",
    "TensorParallelError",
    "TensorParallelWorld",
    "follow",
    "init_world",
    "tp_support",
]

# Cache methods that change a cache outside forwards, as the decoding loops call them.
MIRRORED_CACHE_METHODS = ("crop", "reorder_cache", "batch_select_indices", "batch_repeat_interleave", "reset")
# The one `SlotKVCache` method that writes its tensors outside forwards (beam parents' slot copies);
# allocating and releasing slots and moving cursors is rank 0's bookkeeping: the slots and cursors
# travel in each packed step's pieces.
MIRRORED_SLOT_METHODS = ("copy",)
# A follower waits for rank 0's next call as long as the service is idle: no timeout in practice.
_CONTROL_TIMEOUT = datetime.timedelta(days=3650)


class TensorParallelError(RuntimeError):
    """Tensor parallelism cannot run as asked; the message names the reason and the fix."""


def tp_support(config: Any, world_size: int, device_type: str) -> str:
    """Why transformers' tensor parallelism cannot shard a model with `config` over `world_size`
    ranks on `device_type` ("" when it can).

    Args:
        config (`PretrainedConfig`): the model's config (its text config is checked).
        world_size (`int`): the number of ranks (>= 2).
        device_type (`str`): `"cpu"` or `"cuda"`.
    """
    if device_type not in ("cpu", "cuda"):
        return f"device type {device_type!r}: tensor parallelism runs on the CPU (gloo) or on CUDA GPUs (nccl)"
    if device_type == "cuda" and torch.cuda.device_count() < world_size:
        return (
            f"{world_size} ranks need one GPU each, {torch.cuda.device_count()} visible: lower --tensor-parallel "
            "or give the process more GPUs"
        )
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if not getattr(text, "base_model_tp_plan", None):
        return (
            f"architecture {getattr(config, 'model_type', '?')!r} has no tensor-parallel plan in transformers "
            "(config.base_model_tp_plan is empty): serve it on one device"
        )
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(text, name, None)
        if heads is not None and heads % world_size:
            return f"{name}={heads} is not divisible by {world_size} ranks: pick a tensor-parallel size that divides it"
    return ""


@dataclasses.dataclass(frozen=True)
class TensorParallelWorld:
    """This process's place among the ranks of one tensor-parallel model.

    Args:
        rank (`int`): this process's rank; 0 serves.
        world_size (`int`): ranks in all.
        device (`torch.device`): where this rank's shard lives (`cuda:LOCAL_RANK` on GPUs).
        control (`Any`): the gloo process group of the control broadcasts.
    """

    rank: int
    world_size: int
    device: torch.device
    control: Any


def init_world(device_type: str) -> TensorParallelWorld:
    """Joins the process group described by the environment (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
    `MASTER_ADDR`, `MASTER_PORT`, as `torchrun` sets them): gloo on the CPU, nccl with GPU
    `LOCAL_RANK` on CUDA; plus the gloo group of the control broadcasts."""
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu")
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The ranks share this machine's cores: each takes its share, not all of them (oversubscribed
        # OpenMP pools park and wake their workers around every op).
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    return TensorParallelWorld(rank, world_size, device, control)


@dataclasses.dataclass(frozen=True)
class _CacheRef:
    """A cache in a message: its handle, and how a follower builds its twin when it has none."""

    handle: int
    kind: str  # "dynamic", "static" or "slots"
    max_cache_len: int | None = None
    slots: tuple[int, int] | None = None  # a slot cache's (num_slots, slot_tokens)


@dataclasses.dataclass(frozen=True)
class _StepRef:
    """A packed step (`specwire.runtime.slot_cache.PackedStep`) in a message: its slot cache and pieces,
    from which a follower builds the same step over its own shard of the slots."""

    cache: _CacheRef
    pieces: list[tuple[int, int, int]]


def _cache_shape(cache: Any) -> tuple[str, int | None, tuple[int, int] | None]:
    """(kind, max_cache_len, slots) of a cache a follower can build a twin of; refuses other kinds."""
    from transformers import DynamicCache, StaticCache

    from specwire.runtime.slot_cache import SlotKVCache

    if isinstance(cache, StaticCache):
        return "static", int(cache.get_max_length()), None
    if isinstance(cache, DynamicCache):
        return "dynamic", None, None
    if isinstance(cache, SlotKVCache):
        return "slots", None, (cache.num_slots, cache.slot_tokens)
    raise TensorParallelError(
        f"a {type(cache).__name__} cannot be mirrored to the tensor-parallel followers "
        "(DynamicCache, StaticCache and the batched scheduler's SlotKVCache can)"
    )


def _is_cache(value: Any) -> bool:
    from transformers import Cache

    from specwire.runtime.slot_cache import SlotKVCache

    return isinstance(value, Cache | SlotKVCache)


def _new_cache(model: Any, ref: _CacheRef) -> Any:
    from transformers import DynamicCache, StaticCache

    from specwire.runtime.slot_cache import SlotKVCache

    config = model.config
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if ref.kind == "static":
        return StaticCache(config=text_config, max_cache_len=ref.max_cache_len)
    if ref.kind == "slots":
        assert ref.slots is not None
        return SlotKVCache(model, *ref.slots)  # this rank's KV heads (`tp_size`), as on rank 0
    return DynamicCache(config=text_config)


class MirroredModel:
    """Rank 0's model: every call is broadcast to the followers before it runs here.

    Every other attribute (config, device, `forward` for signature checks, ...) is the model's, as
    with any wrapper the loops take. Calls from several threads are serialised (one lock): the
    followers replay them in the order rank 0 ran them.

    Args:
        model (`PreTrainedModel`): this rank's shard of the model.
        world (`TensorParallelWorld`): the ranks (`init_world`).
    """

    def __init__(self, model: Any, world: TensorParallelWorld):
        self._model = model
        self._world = world
        self._lock = threading.RLock()
        self._handles = itertools.count(1)
        self._known: dict[int, int] = {}  # id(cache) -> handle, for caches alive on rank 0
        self._dropped: list[int] = []  # handles whose cache rank 0 freed, sent with the next message
        self._dropped_lock = threading.Lock()
        self._in_forward = threading.local()
        self.broken = ""  # sticky: why the followers can no longer be reached

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    @property
    def architecture(self) -> str:
        """The wrapped model's class name (what the service reports)."""
        return type(self._model).__name__

    @property
    def world_size(self) -> int:
        """The ranks the model is sharded over."""
        return self._world.world_size

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._run(self._model, "forward", args, kwargs)

    def get_output_embeddings(self) -> Any:
        """The LM head, its calls mirrored too (DoLa applies it to early layers' hidden states): a sharded
        head gathers its output over the ranks, so a call on rank 0 alone would wait forever."""
        head = self._model.get_output_embeddings()
        return None if head is None else _MirroredModule(self, head, "output_embeddings")

    def _run(self, module: Any, target: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Broadcast the call of `target` (a name the followers resolve on their model), then run it here."""
        with self._lock:
            fresh = next(self._handles)
            self._send((target, self._encode(args), self._encode(kwargs), fresh))
            self._in_forward.active = True
            try:
                outputs = module(*args, **kwargs)
            finally:
                self._in_forward.active = False
            cache = getattr(outputs, "past_key_values", None)
            if cache is not None and id(cache) not in self._known:
                self._register(cache, fresh)
            return outputs

    def adopt_cache(self, cache: Any) -> None:
        """Builds `cache`'s twin on every follower now rather than with the first forward that uses it:
        the batched scheduler's slot cache, allocated at start-up, so that a rank without the memory for
        its share fails the start, not the first request."""
        with self._lock:
            self._send(("adopt", self._encode(cache)))

    def stop(self, wait_s: float = 5.0) -> None:
        """Tells the followers to exit (rank 0 is shutting down); never raises. Gives up after `wait_s`
        seconds when a call still holds the lock (a forward stuck in a collective: the caller then ends
        the followers, which fails that collective)."""
        if not self._lock.acquire(timeout=wait_s):
            log.warning("a model call is still running after %.0fs: the followers are not told to stop", wait_s)
            return
        try:
            self._send(("stop",))
        except Exception as error:  # noqa: BLE001 -- shutting down: a dead follower needs no stop
            log.warning("could not tell the tensor-parallel followers to stop: %s", error)
        finally:
            self._lock.release()

    def _send(self, message: tuple[Any, ...]) -> None:
        import torch.distributed as dist

        if self.broken:
            raise TensorParallelError(self.broken)
        with self._dropped_lock:
            dropped, self._dropped = self._dropped, []
        try:
            dist.broadcast_object_list([(dropped, message)], src=0, group=self._world.control)
        except Exception as error:
            self.broken = f"the tensor-parallel followers cannot be reached ({error}); restart the service"
            raise TensorParallelError(self.broken) from error

    def _encode(self, value: Any) -> Any:
        from specwire.runtime.slot_cache import PackedStep

        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if _is_cache(value):
            kind, max_len, slots = _cache_shape(value)
            handle = self._known.get(id(value))
            if handle is None:
                handle = next(self._handles)
                self._register(value, handle)
            return _CacheRef(handle, kind, max_len, slots)
        if isinstance(value, PackedStep):  # the batched scheduler's forwards carry it in their kwargs
            return _StepRef(self._encode(value.cache), value.pieces)
        if isinstance(value, tuple | list):
            return type(value)(self._encode(item) for item in value)
        if isinstance(value, dict):
            return {key: self._encode(item) for key, item in value.items()}
        return value

    def _register(self, cache: Any, handle: int) -> None:
        """Remembers `cache` under `handle` and mirrors its shape-changing methods from now on."""
        kind, _, _ = _cache_shape(cache)  # refuses kinds a follower could not build
        self._known[id(cache)] = handle
        # The wrappers hold the cache weakly: a strong reference would be a cycle (cache -> wrapper ->
        # cache), and its KV tensors would wait for the cyclic collector instead of going with the request.
        cache_ref = weakref.ref(cache)
        for name in MIRRORED_SLOT_METHODS if kind == "slots" else MIRRORED_CACHE_METHODS:
            function = getattr(type(cache), name, None)
            if function is not None:
                setattr(cache, name, self._mirrored_method(handle, name, function, cache_ref))
        weakref.finalize(cache, self._forget, id(cache), handle)

    def _mirrored_method(self, handle: int, name: str, function: Any, cache_ref: Any) -> Any:
        def mirrored(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._in_forward, "active", False):  # the model's own call: the followers' forward does it too
                return function(cache_ref(), *args, **kwargs)
            with self._lock:
                self._send(("cache", handle, name, self._encode(args), self._encode(kwargs)))
                return function(cache_ref(), *args, **kwargs)

        return mirrored

    def _forget(self, cache_id: int, handle: int) -> None:
        if self._known.get(cache_id) == handle:
            del self._known[cache_id]
        with self._dropped_lock:
            self._dropped.append(handle)


class _MirroredModule:
    """A sub-module of rank 0's model whose calls are mirrored like forwards (`MirroredModel._run`)."""

    def __init__(self, owner: MirroredModel, module: Any, target: str):
        self._owner = owner
        self._module = module
        self._target = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._run(self._module, self._target, args, kwargs)


class _Replayer:
    """A follower's side: its model, its caches by handle, and the replay of one message."""

    def __init__(self, model: Any, device: torch.device):
        self.model = model
        self.device = device
        self.caches: dict[int, Any] = {}
        self.slot_attention = False  # installed with the first packed step, as rank 0 did before its own

    def decode(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, _CacheRef):
            cache = self.caches.get(value.handle)
            if cache is None:
                cache = self.caches[value.handle] = _new_cache(self.model, value)
            return cache
        if isinstance(value, _StepRef):
            from specwire.runtime.slot_cache import PackedStep, install_slot_attention

            if not self.slot_attention:
                install_slot_attention(self.model)  # sdpa for every other forward: nothing else changes
                self.slot_attention = True
            return PackedStep(self.decode(value.cache), value.pieces)
        if isinstance(value, tuple | list):
            return type(value)(self.decode(item) for item in value)
        if isinstance(value, dict):
            return {key: self.decode(item) for key, item in value.items()}
        return value

    def replay(self, message: tuple[Any, ...]) -> bool:
        """Runs one message; False when it says stop."""
        op = message[0]
        if op == "stop":
            return False
        if op in ("forward", "output_embeddings"):
            _, args, kwargs, fresh = message
            module = self.model if op == "forward" else self.model.get_output_embeddings()
            outputs = module(*self.decode(args), **self.decode(kwargs))
            cache = getattr(outputs, "past_key_values", None)
            if cache is not None and not any(cache is known for known in self.caches.values()):
                self.caches[fresh] = cache
        elif op == "adopt":
            cache = self.decode(message[1])
            log.info("tensor-parallel follower: allocated its share of a %s", type(cache).__name__)
        elif op == "cache":
            _, handle, name, args, kwargs = message
            getattr(self.caches[handle], name)(*self.decode(args), **self.decode(kwargs))
        else:
            raise TensorParallelError(f"unknown message {op!r} from rank 0")
        return True


def follow(model: Any, world: TensorParallelWorld) -> None:
    """A follower's life: replay rank 0's calls on `model` until rank 0 says stop.

    Raises whatever a replay or the channel raises (rank 0 gone); the caller exits the process.
    """
    import torch.distributed as dist

    replayer = _Replayer(model, world.device)
    log.info("tensor-parallel rank %d/%d following rank 0", world.rank, world.world_size)
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=world.control)
            dropped, message = box[0]
            for handle in dropped:
                replayer.caches.pop(handle, None)
            if dropped:
                log.debug("rank %d: dropped caches %s, %d kept", world.rank, dropped, len(replayer.caches))
            if not replayer.replay(message):
                log.info("tensor-parallel rank %d: rank 0 stopped", world.rank)
                return
