"""GGUF files converted once to a safetensors folder, then loaded from there.

Why. transformers dequantizes a GGUF file into a full float32 state dict and then copies it into the
model, so loading holds the weights twice: the embedded SmolLM2-135M peaks at ~1170 MB resident and
takes ~18 s. A folder of float32 safetensors loads in ~2 s at ~520 MB peak (the weights are mapped
from the file, not copied). So the first load of a GGUF file converts it, in a child process (its
memory peak stays out of the serving process), into a cache folder; every later load reads that
folder. The folder holds bitwise the weights, tokenizer and generation config the GGUF load gives.

Cache. `specwire.paths.cache_dir()` (`SPECWIRE_CACHE_DIR`, else `$SPECWIRE_HOME/cache`, else the
platform's user cache folder, `~/.cache/specwire` on Linux); one folder per GGUF content, keyed by the
file's SHA-256, the transformers version and our folder format, so a changed file or library converts
again while every clone or virtual environment with the same file shares one folder. The hash is
computed once per (path, size, modification time) and remembered in `index.json`. Folders not used
for `SPECWIRE_CACHE_MAX_AGE_DAYS` days (default 30) are removed when another model is converted.
Concurrent first loads (the demo starts two services at once) take a file lock: one converts, the
others wait and read its result. A folder is renamed into place only when complete.
`SPECWIRE_GGUF_CACHE=off` loads GGUF files directly, as does any failure to convert or to write the
cache (logged, never fatal). About 4 bytes per parameter of disk per model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from specwire.paths import cache_dir

logger = logging.getLogger(__name__)

SWITCH_ENV = "SPECWIRE_GGUF_CACHE"
MAX_AGE_ENV = "SPECWIRE_CACHE_MAX_AGE_DAYS"
FORMAT = 1  # bump when the folder layout changes
_COMPLETE = "specwire-conversion.json"


def cache_root() -> Path:
    return cache_dir()


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


def _content_hash(gguf: Path, root: Path) -> str:
    """SHA-256 of the file, remembered per (path, size, mtime) in `root/index.json` (hashing reads it all)."""
    stat = gguf.stat()
    seen = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    index_path = root / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if seen in index:
        return index[seen]
    digest = hashlib.sha256()
    with open(gguf, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    index[seen] = digest.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache still works, it only hashes again
        staging = index_path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(index, indent=1))
        staging.replace(index_path)
    return index[seen]


def _key(gguf: Path, root: Path) -> str:
    import transformers

    identity = f"{_content_hash(gguf, root)}|{transformers.__version__}|{FORMAT}"
    return f"{gguf.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def _max_age_s() -> float:
    try:
        return float(os.environ.get(MAX_AGE_ENV, "30")) * 86400
    except ValueError:
        return 30 * 86400


def prune(root: Path, keep: Path) -> list[Path]:
    """Remove converted folders (other than `keep`) whose last use is older than the age limit."""
    removed = []
    now = time.time()
    for marker in root.glob(f"*/{_COMPLETE}"):
        folder = marker.parent
        try:
            unused = now - marker.stat().st_mtime
        except OSError:
            continue
        if folder != keep and unused > _max_age_s():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _touch(marker: Path) -> None:
    """Mark a folder used now (pruning goes by it); a read-only cache stays as it is."""
    with contextlib.suppress(OSError):
        os.utime(marker)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def converted_folder(gguf: Path, report: Callable[[str], None], progress: bool = True) -> Path | None:
    """
    The cache folder of `gguf` (converting it first when needed), or `None` to load the GGUF directly.

    Args:
        gguf (`Path`): the GGUF file.
        report (`Callable[[str], None]`): progress lines.
        progress (`bool`, *optional*, defaults to `True`): show transformers' progress bars while converting.
    """
    if not enabled():
        return None
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        folder = root / _key(gguf, root)
        if (folder / _COMPLETE).is_file():
            _touch(folder / _COMPLETE)
            return folder
        with _locked(root / f"{folder.name}.lock"):
            if (folder / _COMPLETE).is_file():  # converted by another process while we waited
                return folder
            report(f"converting {gguf.name} once to safetensors in {folder} (later loads read it)")
            staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=root))
            try:
                # `-c`, not `-m`: this module is already imported by its package when `-m` would run it.
                child = f"import sys; from {__name__} import main; main(sys.argv[1:])"
                quiet = [] if progress else ["--quiet"]
                subprocess.run([sys.executable, "-c", child, str(gguf), str(staging), *quiet], check=True)
                for path in (staging, *staging.iterdir()):  # readable by other users (an init container)
                    path.chmod(0o755 if path.is_dir() else 0o644)
                if folder.exists():
                    shutil.rmtree(folder)
                staging.rename(folder)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            for old in prune(root, keep=folder):
                report(f"removed {old}, unused for more than {_max_age_s() / 86400:g} days")
        return folder
    except (OSError, subprocess.SubprocessError) as error:
        logger.warning("GGUF conversion cache not used (%s); loading %s directly", error, gguf)
        return None


def convert(gguf: Path, out: Path) -> None:
    """Write `gguf` as a float32 safetensors model folder (config, weights, tokenizer, generation config)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"))  # tied weights are stored once
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the folder holds plain float32 weights
    model.config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    model.generation_config.save_pretrained(str(out))
    stat = gguf.stat()
    marker = {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": FORMAT}
    (out / _COMPLETE).write_text(json.dumps(marker, indent=2))  # written last: the folder is complete


def main(argv: list[str]) -> None:
    """The conversion child process: `GGUF OUT [--quiet]`."""
    if "--quiet" in argv[2:]:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    convert(Path(argv[0]), Path(argv[1]))
