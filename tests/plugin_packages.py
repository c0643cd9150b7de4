"""Server plugins installed for the tests without pip: real entry-point discovery.

`install_plugin_packages(folder)` writes a `*.dist-info` (METADATA + `entry_points.txt`) into `folder`
for the example package in `examples/specwire_plugin_example` (its entry points read from its
`pyproject.toml`, so the test sees what `pip install` would declare) and for the test-only plugins in
`tests/plugin_samples.py`. With `folder` and the example's source folder on `sys.path` (or
`PYTHONPATH` for a subprocess server), `importlib.metadata.entry_points()` finds them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_DIR = REPO_ROOT / "examples" / "specwire_plugin_example"

# Test-only plugins: a processor, a criterion and generate methods that raise or misbehave, one whose factory has
# a bug, one that cannot import.
TEST_ENTRY_POINTS = {
    "specwire.logits_processors": {
        "raising": "tests.plugin_samples:make_raising",
        "buggy_factory": "tests.plugin_samples:make_buggy",
        "unimportable": "tests.no_such_module_here:make",
    },
    "specwire.stopping_criteria": {"raising_stop": "tests.plugin_samples:make_raising"},
    "specwire.generate_methods": {
        "raising_method": "tests.plugin_samples:make_raising_method",
        "bad_output_method": "tests.plugin_samples:make_bad_output_method",
        "slow_method": "tests.plugin_samples:make_slow_method",
    },
}


def _write_dist_info(folder: Path, name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines.extend(f"{key} = {value}" for key, value in entries.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))


def install_plugin_packages(folder: Path) -> list[str]:
    """Writes the dist-infos into `folder`; returns the paths to put on `sys.path` / `PYTHONPATH`."""
    project = tomllib.loads((EXAMPLE_DIR / "pyproject.toml").read_text())["project"]
    _write_dist_info(folder, project["name"], project["version"], project["entry-points"])
    _write_dist_info(folder, "specwire-test-plugins", "0.0.0", TEST_ENTRY_POINTS)
    return [str(folder), str(EXAMPLE_DIR), str(REPO_ROOT)]
