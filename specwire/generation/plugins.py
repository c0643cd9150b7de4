"""Server-side plugins: logits processors, stopping criteria and generate methods installed as Python packages.

A Python callable cannot travel over gRPC, so transformers' `logits_processor=` and
`stopping_criteria=` arguments become named plugins: an operator installs a package that declares
entry points in the groups below, the server loads the ones it is told to (`load_plugins`), and a
request names them with JSON arguments. Each entry point names a factory

    make(args: dict, context: PluginContext) -> processor

returning a transformers-style `LogitsProcessor` (`(input_ids, scores) -> scores`) or
`StoppingCriteria` (`(input_ids, scores) -> torch.BoolTensor` of shape `(rows,)`). The factory is
called once per request, before any model work: raising `ValueError` or `TypeError` there means
bad arguments (the caller's fault, INVALID_ARGUMENT with the message). The instance it returns must
be a pure function of `input_ids` and `scores`, as transformers' contract for user processors is:
the same instance is called for every row, and under speculation for every candidate position of a
verified draft (rows may then be re-asked about positions they already saw). An exception raised by
the instance during generation is the plugin's bug: `PluginFailed` (INTERNAL, naming the plugin; the
traceback goes to the log with an id, never to the caller).

Whole generate methods (`specwire.generate_methods`, transformers' `custom_generate` installed by the
operator) have the same factory; what the method receives and returns is in
`specwire.generation.generate_methods`.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import torch

from specwire.errors import SpecwireError
from specwire.generation.argument_errors import InvalidGenerationArgument
from specwire.vocabulary import FinishReason

__all__ = [
    "GENERATE_METHODS_GROUP",
    "LOGITS_PROCESSORS_GROUP",
    "STOPPING_CRITERIA_GROUP",
    "Plugin",
    "PluginContext",
    "PluginFailed",
    "PluginLoadError",
    "PluginRegistry",
    "load_plugins",
    "plugin_failed",
]

log = logging.getLogger(__name__)

LOGITS_PROCESSORS_GROUP = "specwire.logits_processors"
STOPPING_CRITERIA_GROUP = "specwire.stopping_criteria"
GENERATE_METHODS_GROUP = "specwire.generate_methods"
KINDS = {
    LOGITS_PROCESSORS_GROUP: "logits_processor",
    STOPPING_CRITERIA_GROUP: "stopping_criteria",
    GENERATE_METHODS_GROUP: "generate_method",
}


class PluginLoadError(RuntimeError):
    """A plugin named at start-up is not installed, fails to import, or is not callable."""


class PluginFailed(SpecwireError):
    """A plugin raised during generation: its bug, not the caller's (INTERNAL, the plugin named)."""

    code = "INTERNAL"


@dataclass(frozen=True)
class PluginContext:
    """
    What a plugin factory may read about the server and the request, besides its own `args`.

    Args:
        tokenizer (`PreTrainedTokenizerBase` or `None`):
            The served model's tokenizer (e.g. to turn strings into token ids); `None` without one.
        vocab_size (`int`):
            Width of the scores the processor receives.
        device (`torch.device`):
            Where `input_ids` and `scores` live.
        config (`GenerationConfig`):
            The request's effective generation config (request over model defaults), read-only by
            convention.
        input_len (`int`):
            Prompt length in columns (left padding included): a row's generated tokens are
            `input_ids[:, input_len:]`.
        eos_token_ids (`list[int]` or `None`):
            The resolved end-of-sequence ids.
    """

    tokenizer: Any
    vocab_size: int
    device: torch.device
    config: Any
    input_len: int
    eos_token_ids: list[int] | None = None


@dataclass(frozen=True)
class Plugin:
    """
    One loaded plugin.

    Args:
        name (`str`): The entry point's name, as requests and `--plugins` spell it.
        kind (`str`): `"logits_processor"`, `"stopping_criteria"` or `"generate_method"`.
        factory (`Callable[[dict, PluginContext], Any]`): The entry point's object.
        description (`str`): The factory's `description` attribute, else its docstring's first line.
    """

    name: str
    kind: str
    factory: Callable[[dict[str, Any], PluginContext], Any]
    description: str = ""


def _description(factory: Any) -> str:
    text = getattr(factory, "description", None) or (factory.__doc__ or "")
    text = str(text).strip()
    return text.splitlines()[0].strip() if text else ""


@dataclass
class PluginRegistry:
    """The plugins a server loaded, by kind and name (empty: no plugin enabled)."""

    plugins: dict[str, dict[str, Plugin]] = field(default_factory=lambda: {kind: {} for kind in KINDS.values()})

    def all(self) -> list[Plugin]:
        """Every loaded plugin, processors first, each kind sorted by name."""
        return [self.plugins[kind][name] for kind in KINDS.values() for name in sorted(self.plugins[kind])]

    def enabled(self, kind: str) -> list[str]:
        return sorted(self.plugins[kind])

    def build(
        self, kind: str, field_name: str, specs: Sequence[tuple[str, dict[str, Any]]], context: PluginContext
    ) -> list[Any]:
        """
        The guarded instances for a request's `[(name, args), ...]` of one kind, in the request's order.

        Raises:
            `InvalidGenerationArgument`: a name not enabled here, or the factory refused its arguments.
        """
        built: list[Any] = []
        for i, (name, args) in enumerate(specs):
            where = field_name if kind == "generate_method" else f"{field_name}[{i}]"  # not a repeated field
            plugin = self.plugins[kind].get(name)
            if plugin is None:
                enabled = self.enabled(kind) or "none (start the target with --plugins)"
                raise InvalidGenerationArgument.for_field(
                    f"{where}.name", name, f"no {kind} plugin of that name is enabled here; enabled: {enabled}"
                )
            try:
                instance = plugin.factory(dict(args), context)
            except (ValueError, TypeError, KeyError) as exc:
                raise InvalidGenerationArgument.for_field(
                    f"{where}.args", args, f"plugin {name!r} refused its arguments: {exc}"
                ) from exc
            except Exception as exc:  # the factory's own bug
                raise plugin_failed(plugin, "building it", exc) from exc
            if not callable(instance):
                raise plugin_failed(plugin, "building it", TypeError(f"factory returned {type(instance).__name__}"))
            if kind == "generate_method":
                built.append(BuiltMethod(plugin, instance, dict(args)))
            else:
                guarded = GuardedProcessor if kind == "logits_processor" else GuardedCriterion
                built.append(guarded(plugin, instance))
        return built


@dataclass(frozen=True)
class BuiltMethod:
    """A request's generate method: the plugin, what its factory returned, and the request's arguments."""

    plugin: Plugin
    method: Any
    args: dict[str, Any]

    @property
    def supports_beams(self) -> bool:
        """Whether the method declares that it runs beam search (`supports_beams = True`)."""
        return bool(getattr(self.method, "supports_beams", False))


def plugin_failed(plugin: Plugin, during: str, exc: BaseException) -> PluginFailed:
    """`PluginFailed` naming `plugin`; the exception and its traceback go to the log under a new error id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("plugin %r (%s) raised while %s (error id %s)", plugin.name, plugin.kind, during, error_id, exc_info=exc)
    return PluginFailed(
        f"plugin {plugin.name!r} ({plugin.kind}) failed while {during} (error id {error_id}): "
        "a bug in the plugin, see the server log"
    )


class GuardedProcessor:
    """A plugin's logits processor; its exceptions become `PluginFailed`, its output is checked."""

    def __init__(self, plugin: Plugin, processor: Any):
        self.plugin, self.processor = plugin, processor

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        try:
            out = self.processor(input_ids, scores)
            if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
                shape = getattr(out, "shape", "")
                raise TypeError(f"returned {type(out).__name__} {shape}, not scores of {tuple(scores.shape)}")
        except SpecwireError:
            raise
        except Exception as exc:
            raise plugin_failed(self.plugin, "processing scores", exc) from exc
        return out


class GuardedCriterion:
    """A plugin's stopping criterion; the rows it ends finish with `FinishReason.STOPPING_CRITERION`
    ("stopping_criterion"); its exceptions become `PluginFailed`."""

    finish_reason = FinishReason.STOPPING_CRITERION

    def __init__(self, plugin: Plugin, criterion: Any):
        self.plugin, self.criterion = plugin, criterion

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        try:
            done = self.criterion(input_ids, scores)
            done = torch.as_tensor(done, device=input_ids.device).to(torch.bool)
            if done.dim() == 0:
                done = done.expand(input_ids.shape[0])
            if done.shape != (input_ids.shape[0],):
                raise TypeError(f"returned shape {tuple(done.shape)}, not ({input_ids.shape[0]},)")
        except SpecwireError:
            raise
        except Exception as exc:
            raise plugin_failed(self.plugin, "checking whether to stop", exc) from exc
        return done


def load_plugins(names: Iterable[str], *, available: Mapping[str, Iterable[Any]] | None = None) -> PluginRegistry:
    """
    Loads the named plugins from the installed packages' entry points.

    Args:
        names (`Iterable[str]`):
            The plugins to enable (`--plugins`); a name may be in both groups (both are loaded).
        available (`Mapping[str, Iterable[EntryPoint]]`, *optional*):
            Entry points per group; defaults to `importlib.metadata.entry_points()`.

    Raises:
        `PluginLoadError`: a name is in no group, or its object fails to import or is not callable.
    """
    groups = {
        group: list(available[group] if available is not None and group in available else entry_points(group=group))
        for group in KINDS
    }
    registry = PluginRegistry()
    for name in [n.strip() for n in names if n.strip()]:
        found = [(group, ep) for group, eps in groups.items() for ep in eps if ep.name == name]
        if not found:
            installed = sorted({ep.name for eps in groups.values() for ep in eps})
            raise PluginLoadError(
                f"plugin {name!r} is not installed: no entry point of that name in {sorted(groups)}; installed: "
                f"{installed or 'none'}"
            )
        for group, ep in found:
            try:
                factory = ep.load()
            except Exception as exc:
                raise PluginLoadError(
                    f"plugin {name!r} ({ep.value}) failed to import: {type(exc).__name__}: {exc}"
                ) from exc
            if not callable(factory):
                raise PluginLoadError(f"plugin {name!r} ({ep.value}) is not callable: a factory make(args, context) is")
            kind = KINDS[group]
            registry.plugins[kind][name] = Plugin(name, kind, factory, _description(factory))
    return registry
