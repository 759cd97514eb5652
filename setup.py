"""Packaging beyond pyproject.toml: the repository's conf/ and templates/ ship inside the distribution, as the
package data ``vtengine/conf`` and ``campaigns/templates``, so an installed vtengine knows its levers, presets and
campaigns from any directory (vtengine/confdirs.py finds them; a project's own conf/ overrides them)."""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
data_dirs = {"vtengine.conf": "conf", "campaigns.templates": "templates"}
packages = find_packages(include=["vtengine*", "campaigns*"])
package_dir = {}
for pkg, src in data_dirs.items():
    subdirs = sorted(p for p in (ROOT / src).rglob("*") if p.is_dir())
    packages += [pkg] + [pkg + "." + ".".join(p.relative_to(ROOT / src).parts) for p in subdirs]
    package_dir[pkg] = src

setup(packages=packages, package_dir=package_dir,
      package_data={"vtengine.conf": ["*.yaml", "*/*.yaml"], "campaigns.templates": ["*.j2"],
                    "campaigns.gates": ["*.yaml"]})
