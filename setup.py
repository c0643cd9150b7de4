"""What pyproject.toml cannot say: install `specwire-legacy-imports.pth` into site-packages.

The .pth keeps the import names before 0.2 (`client`, `*_service`) working for one release without a
top-level module of those names (see `specwire/legacy_imports.py`). It travels as a data file, placed
at site-packages' path relative to the installation prefix as the building interpreter (the one pip
installs with) computes it. Editable installs leave data files out: scripts/install.sh copies it.
The .pth line does nothing once specwire is uninstalled.
"""

import os
import sysconfig

from setuptools import setup

SITE_PACKAGES = os.path.relpath(sysconfig.get_path("purelib"), sysconfig.get_path("data"))

setup(data_files=[(SITE_PACKAGES, ["specwire/specwire-legacy-imports.pth"])])
