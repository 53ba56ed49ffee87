"""Native CPU kernels (`pd/csrc`): C sources compiled on first use with the system C compiler and
loaded with ctypes (no torch headers, so a build takes about a second).

A shared object is cached under `$PD_KERNEL_CACHE` (default `~/.cache/pd-kernels`),
keyed by its source, the flags, the compiler and this CPU (it is built for the CPU it
runs on). Without a compiler, or with `PD_NATIVE_KERNELS=0`, nothing is built and the
callers keep their torch paths: the kernels make things faster, never possible.

Callers cache what `load` returns (one build per process); the kernels run on torch's
OpenMP runtime (same soname), on as many threads as they are told.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno", "-fassociative-math",
         "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast")
I64, PTR, F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SOURCES = Path(__file__).parent / "csrc"  # the kernels' C sources and shared header


def enabled() -> bool:
    return os.environ.get("PD_NATIVE_KERNELS", "1") != "0"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc"))


def can_build() -> bool:
    """Whether kernels may be built here: on, on Linux, with a C compiler."""
    return enabled() and platform.system() == "Linux" and _compiler() is not None


def cpu_has(flag: str) -> bool:
    """Whether this CPU lists `flag` (as /proc/cpuinfo spells it, e.g. avx512_vnni)."""
    return flag in _cpu_identity().split()


def load(source: Path, signatures: dict[str, list], defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Build `source` (or find it built) and declare `signatures` (symbol -> argtypes;
    every kernel returns an int status). None when native kernels are off or cannot be
    built here; the reason is logged. `defines` are preprocessor macros (the tests build
    a kernel's plain C path with them)."""
    if not enabled() or platform.system() != "Linux":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler: %s stays on its torch path", source.stem)
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
        flags = (*FLAGS, *(f"-D{d}" for d in defines))
        key = hashlib.sha256("\0".join([source.read_text(), *headers, *flags, version, _cpu_identity()]).encode())
        key = key.hexdigest()
        cache = Path(os.environ.get("PD_KERNEL_CACHE", Path.home() / ".cache" / "pd-kernels"))
        built = cache / f"{source.stem}-{key[:16]}.so"
        if not built.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, renamed in: racing builds are safe
                out = Path(tmp) / built.name
                subprocess.run([compiler, *flags, f"-I{source.parent}", str(source), "-o", str(out), "-lm"], check=True,
                               capture_output=True, text=True, timeout=300)
                os.replace(out, built)
        library = ctypes.CDLL(str(built))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("building the native kernels of %s failed (%s); using the torch path", source.name, detail)
        return None
    for symbol, argtypes in signatures.items():
        getattr(library, symbol).argtypes = argtypes
        getattr(library, symbol).restype = ctypes.c_int
    return library

