"""Strip an unpacked nixl-cu13 wheel to what its UCX and POSIX backends load (the device tool
carries 64 MiB; the wheel is 59 MB, those parts 8 MB as .tar.xz): drop every shared library
that neither the Python bindings, the UCX plugin (KV transfer), the POSIX plugin (the disk
tier) nor UCX's shared-memory and CUDA transports need, the nixl_ep extension and the
examples. Usage: slim_nixl.py UNPACKED_WHEEL_DIR"""

import subprocess
import sys
from pathlib import Path

root = Path(sys.argv[1])
libs = [p for p in root.rglob("*.so*") if not p.name.endswith(".la")]


def needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].split("]")[0] for line in out.splitlines() if "(NEEDED)" in line]


roots = [p for p in libs if p.name.startswith(("_bindings", "_utils", "libplugin_UCX.so", "libplugin_POSIX.so",
                                               "libuct_cma", "libuct_cuda", "libucm_cuda"))]
keep: set[Path] = set()
todo = list(roots)
while todo:
    path = todo.pop()
    if path in keep:
        continue
    keep.add(path)
    for name in needed(path):
        todo += [p for p in libs if p.name.startswith(name)]
for path in libs:
    if path not in keep:
        path.unlink()
for extra in [*root.glob("nixl_ep_*"), *root.glob("*.data"), *root.glob("*.scripts")]:
    subprocess.run(["rm", "-rf", str(extra)], check=True)
print(f"kept {len(keep)} of {len(libs)} libraries")
