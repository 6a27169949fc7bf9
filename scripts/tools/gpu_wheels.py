"""Wheels for a machine without network: prepare a folder here, install from it there.

``prepare DIR``: download (``pip download --no-deps --only-binary=:all:``, CPython 3.12,
manylinux x86-64 by default) every distribution this project needs besides torch, at the
versions installed here: the closure of the project's requirements, its ``dev`` extra
(pytest, hypothesis) and their requirements, read from this environment's package
metadata, minus torch and what torch itself requires (the target has torch). Into ``DIR/peers``
also TorchRL's wheels for ``scripts/bench/torchrl.py`` (:data:`PEERS`: TorchRL pins a
tensordict older than the project's, so they go to a site directory of their own).

``install DIR SITE``: install, with ``pip install --no-index --no-deps --target SITE``,
the wheels in DIR whose distribution this Python does not have yet (what it has, torch
and numpy above all, is left alone); prints what it installed and skipped. Put SITE on
``PYTHONPATH`` afterwards. ``--all``: every wheel in DIR, also those this Python has (the peers'
tensordict, which must shadow the project's on their ``PYTHONPATH``).

Used by ``scripts/tools/gpu_check.sh`` (``--prepare-wheels DIR`` and ``--wheels DIR``).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import subprocess
import sys
import zipfile

ROOTS = ["tensordict", "safetensors", "gymnasium", "wandb", "pyyaml", "tqdm", "psutil", "numpy", "pytest", "hypothesis"]
# TorchRL and what it needs beyond the project's wheels, at the versions docs/benchmarks.md measured.
PEERS = {"torchrl": "0.14.1", "tensordict": "0.14.3", "hoptorch": "0.1.4"}
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(dist: str) -> list[str]:
    """Names of the unconditional requirements of an installed distribution, plus those
    whose marker holds here (``python_version < ...`` backports are skipped for 3.12)."""
    out = []
    for req in md.requires(dist) or []:
        name, _, marker = req.partition(";")
        if "extra ==" in marker:
            continue
        if "python_version" in marker and not _marker_holds_on_312(marker):
            continue
        out.append(re.split(r"[ <>=!~\[(]", name.strip(), maxsplit=1)[0])
    return out


def _marker_holds_on_312(marker: str) -> bool:
    m = re.search(r'python_version\s*(<=|<|>=|>|==)\s*["\'](\d+)\.(\d+)["\']', marker)
    if not m:
        return True
    op, ver = m.group(1), (int(m.group(2)), int(m.group(3)))
    target = (3, 12)
    return {"<": target < ver, "<=": target <= ver, ">": target > ver, ">=": target >= ver, "==": target == ver}[op]


def closure(roots: list[str]) -> dict[str, str]:
    """``{name: version}`` of ``roots`` and everything they require, installed here."""
    skip, stack = set(), ["torch"]
    while stack:  # torch and its own requirements: the target has them
        name = stack.pop()
        if _norm(name) in skip:
            continue
        skip.add(_norm(name))
        try:
            stack += _requirements(name)
        except md.PackageNotFoundError:
            pass
    found: dict[str, str] = {}
    stack = list(roots)
    while stack:
        name = stack.pop()
        key = _norm(name)
        if key in found or key in skip or key.startswith(("nvidia-", "triton")):
            continue
        try:
            found[key] = md.version(name)
        except md.PackageNotFoundError:
            continue  # not installed here: not needed on this platform
        stack += _requirements(name)
    return found


def prepare(directory: str, python_version: str, platforms: list[str]) -> int:
    rc = download(directory, closure(ROOTS), python_version, platforms)
    return download(os.path.join(directory, "peers"), PEERS, python_version, platforms) or rc


def download(directory: str, pins: dict[str, str], python_version: str, platforms: list[str]) -> int:
    os.makedirs(directory, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        directory,
    ]
    for p in platforms:
        cmd += ["--platform", p]
    cmd += [f"{name}=={version}" for name, version in sorted(pins.items())]
    print(
        f"downloading {len(pins)} wheels into {directory}: " + ", ".join(f"{n}=={v}" for n, v in sorted(pins.items())),
        flush=True,
    )
    rc = subprocess.call(cmd)
    wheels = [f for f in os.listdir(directory) if f.endswith(".whl")]
    total = sum(os.path.getsize(os.path.join(directory, f)) for f in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {directory}")
    return rc


def wheel_name(path: str) -> tuple[str, str]:
    """(distribution name, version) of a wheel, from its METADATA."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode("utf-8", "replace")
    name = re.search(r"^Name:\s*(\S+)", text, re.M).group(1)
    version = re.search(r"^Version:\s*(\S+)", text, re.M).group(1)
    return name, version


def install(directory: str, site: str, everything: bool = False) -> int:
    wheels = sorted(f for f in os.listdir(directory) if f.endswith(".whl"))
    if not wheels:
        print(f"error: no .whl files in {directory}", file=sys.stderr)
        return 2
    todo, have = [], []
    for f in wheels:
        name, version = wheel_name(os.path.join(directory, f))
        try:
            if everything:
                raise md.PackageNotFoundError(name)
            have.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            todo.append((name, version, os.path.join(directory, f)))
    print("already installed (kept): " + (", ".join(have) or "none"))
    if not todo:
        print("nothing to install")
        return 0
    os.makedirs(site, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--target",
        site,
    ]
    rc = subprocess.call(cmd + [path for _, _, path in todo])
    print(f"installed into {site}: " + ", ".join(f"{n} {v}" for n, v, _ in todo))
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="download the wheel folder (needs a package index)")
    p.add_argument("dir")
    p.add_argument("--python-version", default="3.12")
    p.add_argument("--platform", action="append", help=f"default: {' '.join(PLATFORMS)}")
    i = sub.add_parser("install", help="install the missing wheels of DIR into SITE")
    i.add_argument("dir")
    i.add_argument("site")
    i.add_argument("--all", action="store_true", help="also the wheels of distributions this Python has")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return prepare(args.dir, args.python_version, args.platform or PLATFORMS)
    return install(args.dir, args.site, args.all)


if __name__ == "__main__":
    sys.exit(main())
