"""The lowest-versions environment holds exactly what .ci/lowest.txt pins, and every pin of a library pyproject.toml
names is that library's lower bound there (so the bound is a version CI runs). Run with the environment's Python."""

import re
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


pins = {}
for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, pin = line.split("==")
        pins[canon(name)] = pin.strip()
bounds = {}
for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", dep)
    lower = re.search(r">=\s*([^,\s]+)", m.group(2))
    bounds[canon(m.group(1))] = lower.group(1) if lower else None

errors = []
for name, pin in pins.items():
    if (have := version(name)) != pin:
        errors.append(f"{name}: installed {have}, .ci/lowest.txt pins {pin}")
    if name in bounds and bounds[name] is None:
        errors.append(f"{name}: pinned in .ci/lowest.txt but pyproject.toml gives no lower bound")
    elif name in bounds and Version(pin) != Version(bounds[name]):
        errors.append(f"{name}: pyproject.toml's lower bound is {bounds[name]}, .ci/lowest.txt pins {pin}")
print("\n".join(errors) or "lowest versions: " + ", ".join(f"{n}=={p}" for n, p in pins.items()))
sys.exit(1 if errors else 0)
