"""The installed names are ours: everything imports as `specwire.*`, the wheel has no other top-level
package, and the pre-0.2 names (`client`, `*_service`) still work for one release, with a warning."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specwire.legacy_imports import LEGACY_PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    # -W default: show each warning once, as an interpreter does by default for code it runs itself.
    return subprocess.run(
        [sys.executable, "-W", "default", *args, "-c", code] if code else [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # not the checkout: the installed package, as a user gets it
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (built,) = out.glob("specwire-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_only_specwire_and_the_legacy_pth(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist()}
    packages = {top for top in tops if not top.endswith((".dist-info", ".data"))}
    assert packages == {"specwire"}
    data = [name for name in wheel.namelist() if ".data/" in name]
    assert [Path(name).name for name in data] == ["specwire-legacy-imports.pth"]
    assert "/site-packages/" in data[0] or "/dist-packages/" in data[0]
    for legacy in LEGACY_PACKAGES:
        assert f"specwire/{legacy}/__init__.py" in wheel.namelist()


def test_the_console_scripts_point_at_specwire(wheel):
    (entry_points,) = [name for name in wheel.namelist() if name.endswith("entry_points.txt")]
    targets = [line.split("=")[1].strip() for line in wheel.read(entry_points).decode().splitlines() if "=" in line]
    assert targets and all(target.startswith("specwire.") for target in targets), targets


def test_old_import_names_are_aliases_with_a_warning():
    code = (
        "import client, client.cli, target_service.engine\n"
        "from client import TargetClient\n"
        "import specwire.client, specwire.client.cli, specwire.target_service.engine\n"
        "assert client is specwire.client and client.cli is specwire.client.cli\n"
        "assert target_service.engine is specwire.target_service.engine\n"
        "assert TargetClient is specwire.client.TargetClient\n"
        "print('same modules')\n"
    )
    result = _python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "same modules" in result.stdout
    for old in ("client", "target_service"):
        # One warning per old package, naming the new import.
        assert result.stderr.count(f"`{old}` is now `specwire.{old}`") == 1, result.stderr


def test_python_dash_m_with_an_old_name_still_runs_the_service():
    result = _python("", "-m", "config_service", "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "--db" in result.stdout


def test_another_distributions_top_level_package_wins_over_the_alias(tmp_path):
    (tmp_path / "client").mkdir()
    (tmp_path / "client" / "__init__.py").write_text("OWNER = 'someone else'\n")
    code = "import client; print(client.OWNER)"
    result = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "someone else"
