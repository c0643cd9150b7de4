"""Compiled decoding steps: transformers' rule for when `generate()` runs the model through `torch.compile`.

transformers 5.23 (`GenerationMixin._valid_auto_compile_criteria` and `PreTrainedModel.get_compiled_call`)
compiles the decoding forward, and the prefill chunks of a chunked prefill, never the plain prefill,
when all of these hold:

- `disable_compile` is not set;
- the cache is compileable and not a `DynamicCache`: for the decoder-only models specwire serves, a
  `StaticCache` (`cache_implementation="static"`, or a deprecated alias of it, with `use_cache`);
- the model runs on an accelerator (`cuda`, `xpu`, `neuron`, `tpu`), or the request's `compile_config`
  asks for every device (`_compile_all_devices`, transformers' flag for compiling on the CPU);
- the model is not quantized with a method that cannot compile, nor offloaded to the CPU or disk;
- the model is not a Llama 4 (`get_compiled_call` returns the eager call for it).

The compiled call is `torch.compile(model.__call__, **compile_config)`, transformers' `CompileConfig`
(`fullgraph`, `dynamic`, `backend`, `mode`, `options`; its defaults when the request gives none), with
`fullgraph` turned off under flash attention, as transformers does. Compiled calls are kept per model and
options (`compiled_call`, at most `MAX_COMPILED` of them) so that the next request with the same options
reuses the graphs; they run wherever the model's forwards run (the model thread).

A compilation that fails (a bad backend, mode or option, a graph break under `fullgraph=True`) is an
`InvalidGenerationArgument` naming `compile_config`, not a silent eager fallback: the request asked for
compiled decoding, and `disable_compile=True` is the way to decode eagerly.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.generation.config import uses_static_cache
from specwire.generation.rows import model_device

__all__ = [
    "ALL_DEVICES",
    "MAX_COMPILED",
    "CompileDecision",
    "CompiledForward",
    "compile_warning",
    "compiled_call",
    "decide_compile",
    "decoding_call",
]

# transformers' `CompileConfig._compile_all_devices`: a request's `compile_config` dict carries it as a key.
ALL_DEVICES = "_compile_all_devices"
# Devices transformers compiles on without being asked (`_valid_auto_compile_criteria`).
COMPILING_DEVICES = ("cuda", "xpu", "neuron", "tpu")
# Compiled calls kept (per model and options): each holds its graphs (and with inductor, generated code).
MAX_COMPILED = 8
_DEFAULT_OPTIONS: Mapping[str, Any] = {
    "fullgraph": False,
    "dynamic": None,
    "backend": "inductor",
    "mode": "reduce-overhead",
    "options": None,
}


@dataclass(frozen=True)
class CompileDecision:
    """Whether a request's decoding steps run compiled.

    Args:
        options (`dict`, *optional*):
            The `torch.compile` arguments (transformers' `CompileConfig.to_dict()`), or `None` to decode eagerly.
        reason (`str`):
            Why the steps run eagerly ("" when they are compiled).
    """

    options: dict[str, Any] | None
    reason: str = ""


def _default_options(device: torch.device) -> dict[str, Any]:
    """transformers' `_default_compile_config`: TPU and Neuron compile with their own backend, static shapes."""
    if device.type in ("tpu", "neuron"):
        return {**_DEFAULT_OPTIONS, "backend": device.type, "dynamic": False, "mode": "default"}
    return dict(_DEFAULT_OPTIONS)


def _offloaded(model: Any) -> bool:
    device_map = getattr(model, "hf_device_map", None)
    if not isinstance(device_map, dict):
        return False
    devices = {str(d) for d in device_map.values()}
    return ("cpu" in devices and len(devices) > 1) or "disk" in devices


def decide_compile(model: Any, config: Any) -> CompileDecision:
    """transformers' `_valid_auto_compile_criteria` and `get_compiled_call` for one request.

    Args:
        model (`PreTrainedModel`):
            The served model (or a wrapper that forwards its attributes).
        config (`GenerationConfig`):
            The request's merged config.

    Returns:
        `CompileDecision`: the `torch.compile` arguments, or why the decoding steps run eagerly.
    """
    if config.disable_compile:
        return CompileDecision(None, "disable_compile=True")
    if not uses_static_cache(config):
        return CompileDecision(None, "only a static cache (cache_implementation='static') is compiled")
    given: dict[str, Any] = dict(config.compile_config or {})
    all_devices = bool(given.pop(ALL_DEVICES, None))
    device = model_device(model)
    if device.type not in COMPILING_DEVICES and not all_devices:
        return CompileDecision(
            None,
            f"the model runs on {device.type!r}, where transformers compiles only when compile_config asks for "
            f"every device: set compile_config={{{ALL_DEVICES!r}: True, ...}}",
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return CompileDecision(None, "the model's quantization method cannot be compiled")
    if _offloaded(model):
        return CompileDecision(None, "the model is offloaded to the CPU or disk, which cannot be compiled")
    if "llama4" in str(getattr(model.config, "model_type", "")):
        return CompileDecision(None, "transformers does not compile Llama 4 models")
    options = {**_default_options(device), **given} if given else _default_options(device)
    if "flash" in str(getattr(model.config, "_attn_implementation", "") or ""):
        options["fullgraph"] = False  # flash attention breaks the graph (transformers overrides it too)
    return CompileDecision(options)


def compile_warning(model: Any, config: Any) -> str | None:
    """The warning for a request whose `compile_config` the model cannot honour, as transformers warns
    ("unable to meet the criteria for compilation"); `None` when it is honoured, or left to the config's
    own warning (`config.treatment`: no static cache, or `disable_compile`).

    Args:
        model (`PreTrainedModel`):
            The served model.
        config (`GenerationConfig`):
            The request's merged config.
    """
    if config.compile_config is None or config.disable_compile or not uses_static_cache(config):
        return None
    decision = decide_compile(model, config)
    if decision.options is not None:
        return None
    return f"not honoured: the decoding steps run without torch.compile: {decision.reason}"


def _key(model: Any, options: Mapping[str, Any]) -> tuple[int, str]:
    return id(model), json.dumps(options, sort_keys=True, default=repr)


_compiled: OrderedDict[tuple[int, str], tuple[Any, CompiledForward]] = OrderedDict()
_compiled_lock = threading.Lock()


def _failure(options: Mapping[str, Any], exc: BaseException) -> InvalidGenerationArgument:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return cast(
        InvalidGenerationArgument,
        InvalidGenerationArgument.for_field(
            "compile_config",
            dict(options),
            f"torch.compile failed on the decoding step ({type(exc).__name__}: {text}); change compile_config "
            "(backend, mode, options, fullgraph) or set disable_compile=True to decode without compiling",
        ),
    )


class CompiledForward:
    """`torch.compile(model.__call__, **options)`, whose compilation failures are request errors.

    Args:
        model (`PreTrainedModel`):
            The model whose `__call__` is compiled.
        options (`dict`):
            The `torch.compile` arguments.

    Raises:
        `InvalidGenerationArgument`: `torch.compile` refuses the options (unknown backend, mode with options).
    """

    def __init__(self, model: Any, options: Mapping[str, Any]):
        self.options = dict(options)
        try:
            self._call: Callable[..., Any] = torch.compile(model.__call__, **self.options)
        except Exception as exc:  # torch raises RuntimeError, InvalidBackend, ... for bad arguments
            raise _failure(self.options, exc) from exc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch._dynamo.exc import TorchDynamoException

        try:
            return self._call(*args, **kwargs)
        except TorchDynamoException as exc:  # tracing or the backend failed: the options' fault
            raise _failure(self.options, exc) from exc


def compiled_call(model: Any, options: Mapping[str, Any]) -> CompiledForward:
    """The compiled `model.__call__` for `options`, shared by the requests that use the same ones.

    At most `MAX_COMPILED` are kept, the least recently used dropped first. Compilation itself happens on the
    first call (on the thread that runs the model's forwards).

    Args:
        model (`PreTrainedModel`):
            The model (not a wrapper).
        options (`dict`):
            The `torch.compile` arguments (`CompileDecision.options`).

    Returns:
        `CompiledForward`
    """
    key = _key(model, options)
    with _compiled_lock:
        found = _compiled.get(key)
        if found is not None and found[0] is model:
            _compiled.move_to_end(key)
            return found[1]
    made = CompiledForward(model, options)
    with _compiled_lock:
        # The model is kept with its call so that an id reused by another model never matches.
        _compiled[key] = (model, made)
        _compiled.move_to_end(key)
        while len(_compiled) > MAX_COMPILED:
            _compiled.popitem(last=False)
    return made


def decoding_call(model: Any, options: Mapping[str, Any]) -> Callable[..., Any]:
    """The call that runs `model`'s compiled decoding steps.

    A model wrapper that runs forwards elsewhere (the target's sequential lane posts them to its scheduler
    thread) defines `compiled_forward(options)`, which compiles the model it wraps and keeps running the calls
    where it runs them; a plain model gets `compiled_call(model, options)`.
    """
    hook = getattr(type(model), "compiled_forward", None)
    if hook is not None:
        return hook(model, options)  # type: ignore[no-any-return]
    return compiled_call(model, options)
