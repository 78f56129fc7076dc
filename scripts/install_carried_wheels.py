"""Install the wheels carried to an offline GPU machine (``scripts/fetch-gpu-wheels.sh``) into a
target directory, for ``scripts/gpu-check.sh``.

``python scripts/install_carried_wheels.py WHEELS_DIR TARGET_DIR``

Per distribution: nothing when this Python already has the carried version or a newer one (the
machine's own torch, numpy, ... stay in charge); otherwise the newest carried wheel that fits this
interpreter and glibc (``pip install --no-deps --no-index --find-links``, which picks it; without
pip, the wheel is unpacked and its console scripts written). Prints one line per distribution and
writes ``TARGET_DIR/installed.json``; exits 1 if megatron-core or nvidia-resiliency-ext is missing
afterwards. Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

REQUIRED = ("megatron-core", "nvidia-resiliency-ext")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:4])


def python_fits(python_tag: str, abi_tag: str, here: tuple[int, int] | None = None) -> bool:
    """A wheel's Python and ABI tags against this CPython: its own ``cpNN``, pure Python
    (``py3*``), or the stable ABI (``cpNN-abi3``: any CPython 3 from NN on)."""
    major, minor = here or sys.version_info[:2]
    stable_abi = "abi3" in abi_tag.split(".")
    for tag in python_tag.split("."):
        if tag.startswith("py3"):
            return True
        m = re.fullmatch(r"cp(\d)(\d+)", tag)
        if m and int(m[1]) == major and (int(m[2]) == minor or (stable_abi and int(m[2]) <= minor)):
            return True
    return False


def fits(wheel: Path) -> bool:
    """Python tag and glibc of a wheel's file name against this interpreter and machine."""
    python_tag, abi_tag, platform_tag = wheel.stem.split("-")[-3:]
    if not python_fits(python_tag, abi_tag):
        return False
    if platform_tag == "any":
        return True
    glibc = version_key((os.confstr("CS_GNU_LIBC_VERSION") or "glibc 0.0").split()[-1])
    for tag in platform_tag.split("."):
        m = re.match(r"manylinux_(\d+)_(\d+)_x86_64|manylinux(2014|2010|1)_x86_64", tag)
        if m:
            need = (int(m[1]), int(m[2])) if m[1] else {"2014": (2, 17), "2010": (2, 12), "1": (2, 5)}[m[3]]
            if need <= glibc[:2]:
                return True
    return False


def carried(wheels: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for whl in sorted(wheels.glob("*.whl")):
        out.setdefault(canonical(whl.name.split("-")[0]), []).append(whl)
    return out


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def unpack(wheel: Path, target: Path) -> None:
    """Install without pip: the wheel's files, and its console scripts in TARGET/bin."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(target)
        entry = next((n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")), None)
        text = zf.read(entry).decode() if entry else ""
    section = ""
    for line in text.splitlines():
        if line.startswith("["):
            section = line.strip("[] ")
        elif section == "console_scripts" and "=" in line:
            name, _, ref = (x.strip() for x in line.partition("="))
            module, _, func = ref.partition(":")
            script = target / "bin" / name
            script.parent.mkdir(exist_ok=True)
            script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
            script.chmod(0o755)


def install(dists: list[str], wheels: Path, target: Path, by_dist: dict[str, list[Path]]) -> dict[str, str]:
    if not dists:
        return {}
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade"]
    cmd = [*pip, "--find-links", str(wheels), "--target", str(target), *dists]
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
    if has_pip and subprocess.run(cmd).returncode == 0:
        return {d: "installed (pip)" for d in dists}
    out = {}
    for dist in dists:
        fitting = sorted((w for w in by_dist[dist] if fits(w)), key=lambda w: version_key(w.name.split("-")[1]))
        if not fitting:
            out[dist] = "no carried wheel fits this machine"
            continue
        unpack(fitting[-1], target)
        out[dist] = f"installed ({fitting[-1].name}, unpacked)"
    return out


def main(argv: list[str]) -> int:
    wheels, target = Path(argv[0]), Path(argv[1])
    target.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(target))  # what an earlier run installed counts as present
    by_dist = carried(wheels)
    report: dict[str, dict[str, str | None]] = {}
    todo = []
    for dist, files in by_dist.items():
        newest = max((f.name.split("-")[1] for f in files), key=version_key)
        have = installed_version(dist)
        report[dist] = {"carried": newest, "before": have, "action": "present"}
        if have is None or version_key(have) < version_key(newest):
            todo.append(dist)
    for dist, action in install(todo, wheels, target, by_dist).items():
        report[dist]["action"] = action
    importlib.invalidate_caches()
    for dist, row in sorted(report.items()):
        row["now"] = installed_version(dist)
        print(f"  {dist:<28} carried {row['carried']:<14} before {row['before'] or '-':<14} {row['action']}")
    (target / "installed.json").write_text(json.dumps(report, indent=1) + "\n")
    missing = [d for d in REQUIRED if not installed_version(d)]
    if missing:
        names = ", ".join(missing)
        print(f"install_carried_wheels: {names} not installed; fix: scripts/fetch-gpu-wheels.sh", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
