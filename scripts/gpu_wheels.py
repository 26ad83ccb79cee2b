"""Wheels for scripts/gpu_check.sh, made on a machine that reaches the package registry, for a GPU machine that
does not.

That machine brings its own Python 3.12, torch (CUDA), transformers, peft, accelerate, pandas, tensorboard and
pytest. This script fetches what it lacks: deepspeed, diffusers, datasets, omegaconf, hydra-core and math-verify
at the versions of requirements-cpu.txt, and, following their metadata for CPython 3.12 on x86-64 Linux, every
dependency that machine does not already have. Binary wheels are downloaded; a package published only as
source (deepspeed, antlr4-python3-runtime 4.9.3) is built here into a pure-Python wheel (deepspeed without its
compiled ops, which it builds on first use where needed). Packages that machine has (torch and its CUDA
libraries, numpy, transformers' own dependencies, ...) are left out, and so is pyarrow (see LEFT_OUT), so the
folder stays small (about 18 MiB).

    python scripts/gpu_wheels.py [--dest wheels]     # then scripts/gpu_check.sh there, with wheels/ beside it
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
WANTED = ["deepspeed", "diffusers", "datasets", "omegaconf", "hydra-core", "math-verify", "latex2sympy2_extended"]
# What the GPU machine has, with the dependencies its torch, transformers, peft, accelerate, pandas, tensorboard
# and pytest bring (their versions there satisfy the ranges the wanted packages ask for).
PRESENT = {"torch", "numpy", "pandas", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet",
           "packaging", "pyyaml", "regex", "requests", "urllib3", "idna", "certifi", "charset-normalizer", "tqdm",
           "filelock", "psutil", "sympy", "mpmath", "jinja2", "markupsafe", "networkx", "typing-extensions",
           "setuptools", "peft", "accelerate", "tensorboard", "protobuf", "grpcio", "pytest", "python-dateutil",
           "six", "pytz", "tzdata", "httpx", "httpcore", "anyio", "h11", "sniffio", "triton", "pillow", "absl-py",
           "markdown", "werkzeug", "tensorboard-data-server"}
# Too big to travel with the working tree (the device tool carries 64 MiB): pyarrow (55 MB), which `datasets`
# needs for the file-based tasks (gsm8k, math500) only. gpu_check.sh installs datasets without it where the
# machine lacks it, and uses none of those tasks.
LEFT_OUT = {"pyarrow"}
TARGET = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "os_name": "posix"}
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312",
            "--abi", "abi3", "--abi", "none", "--platform", "manylinux_2_28_x86_64", "--platform",
            "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "--platform", "any"]


def pinned(name: str) -> str:
    """`name==version` from requirements-cpu.txt (the CPU-tested versions), or the bare name."""
    for line in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        if canonicalize_name(line.split("==")[0]) == canonicalize_name(name) and "==" in line:
            return line.strip()
    return name


def fetch(spec: str, dest: Path) -> Path:
    """One wheel for `spec` in `dest` (downloaded for CPython 3.12, or built here from source)."""
    before = set(dest.glob("*.whl"))
    pip = [sys.executable, "-m", "pip"]
    got = subprocess.run([*pip, "download", "--quiet", "--no-deps", "--dest", str(dest), *PLATFORM, spec],
                         capture_output=True, text=True)
    if got.returncode != 0:  # published as source only: build a wheel here
        subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dest), spec],
                       check=True, env={**__import__("os").environ, "DS_BUILD_OPS": "0"})
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(Requirement(spec).name)
    found = new or {w for w in dest.glob("*.whl") if canonicalize_name(parse_wheel_filename(w.name)[0]) == name}
    wheel = sorted(found)[-1]
    tags = parse_wheel_filename(wheel.name)[3]
    if not any(t.interpreter in ("py3", "cp312") or t.abi in ("abi3", "none") and t.platform != "linux_x86_64"
               for t in tags):
        sys.exit(f"{wheel.name} is not installable on CPython 3.12 (built from source for this Python?)")
    return wheel


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    """What `wheel` needs on the GPU machine (with the `extras` it was asked for), without markers."""
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    out = []
    for line in metadata.splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or any(req.marker.evaluate({**TARGET, "extra": e}) for e in {"", *extras}):
                req.marker = None
                out.append(req)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", default=str(ROOT / "wheels"))
    args = parser.parse_args()
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    queue, seen = [Requirement(pinned(n)) for n in WANTED], set()
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in seen or name in PRESENT or name in LEFT_OUT:
            continue
        seen.add(name)
        spec = str(Requirement(f"{req.name}{req.specifier}"))
        wheel = fetch(spec, dest)
        print(f"  {wheel.name}")
        queue += requirements(wheel, set(req.extras))
    size = sum(w.stat().st_size for w in dest.glob("*.whl")) / 2**20
    print(f"{len(list(dest.glob('*.whl')))} wheels in {dest}, {size:.1f} MiB")


if __name__ == "__main__":
    main()
