"""The README's code blocks run as written, so they cannot drift from the code.

Every ```bash and ```python block of README.md runs, in order, in one scratch folder that looks like a
checkout (`.venv`, `scripts`, `bench`... are links to the real ones), against the real services that
the blocks themselves start, on the embedded SmolLM2. A block that cannot run here says why in an
HTML comment right above it, `<!-- readme-test: skip: REASON -->` (installs, a GPU, a cluster); the
test fails on a block with neither. Background processes a block starts are stopped at the end.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specwire import paths

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"(?:<!-- readme-test: skip: (?P<skip>[^>]*?) -->\n)?```(?P<lang>[a-z]*)\n(?P<code>.*?)```", re.S)


def readme_blocks() -> list[tuple[str, str, str | None, int]]:
    """(language, code, skip reason or None, line) of every fenced block."""
    text = (ROOT / "README.md").read_text()
    return [(m["lang"], m["code"], m["skip"], text.count("\n", 0, m.start("code"))) for m in BLOCK.finditer(text)]


RUNNABLE = ("bash", "python")


def test_every_block_runs_or_says_why_not():
    blocks = readme_blocks()
    assert any(lang in RUNNABLE and skip is None for lang, _, skip, _ in blocks), "no README block would run"
    unrunnable = [(lang, line) for lang, _, skip, line in blocks if lang not in RUNNABLE and skip is None]
    assert not unrunnable, f"give these blocks a language this test runs, or a skip reason: {unrunnable}"


def _scratch_checkout(tmp: Path) -> Path:
    """A folder with the checkout's entries as links, so `.venv/bin/...` and `python -m bench` resolve."""
    tmp.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (tmp / entry.name).symlink_to(entry)
    venv = ROOT / ".venv" if (ROOT / ".venv").exists() else Path(sys.prefix)
    (tmp / ".venv").symlink_to(venv)
    return tmp


@pytest.mark.smollm
def test_readme_blocks_run_as_written(tmp_path):
    checkout = _scratch_checkout(tmp_path / "checkout")
    env = {
        **os.environ,
        "PATH": f"{checkout / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),  # this checkout's code, whatever the virtual environment points at
        "SPECWIRE_HOME": str(tmp_path / "home"),  # a fresh registry and logs...
        "SPECWIRE_CACHE_DIR": str(paths.cache_dir()),  # ...but the converted model the suite already has
        "PYTHONUNBUFFERED": "1",
    }
    groups = []
    try:
        for lang, code, skip, line in readme_blocks():
            if skip is not None:
                continue
            command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
            # Output to a file, not a pipe: a server the block leaves running keeps a pipe open.
            log = tmp_path / f"block-{line}.log"
            with open(log, "w") as out:
                process = subprocess.Popen(
                    command,
                    cwd=checkout,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: what it leaves running is stopped below
                )
                groups.append(process.pid)
                process.wait(timeout=600)
            output = log.read_text()
            assert process.returncode == 0, f"README.md block at line {line} failed:\n{code}\n--- output:\n{output}"
            assert "Traceback" not in output, f"README.md block at line {line} printed a traceback:\n{output}"
    finally:
        for group in reversed(groups):
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
