#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the device tool's GPU machine lacks for .ci/gpu/checks.sh:
# the project's dependencies missing from its image (as cp312 wheels) and nixl-cu13 cut
# down to its UCX backend (.whl/nixl_slim.tar.xz). Run from the repository root, after
# the CPU install (.venv): the versions are .venv's.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
version() { .venv/bin/pip show "$1" | sed -n 's/^Version: //p'; }
platforms=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for name in annotated-types fastapi gguf llguidance msgspec pydantic pydantic_core pyzmq starlette typing-inspection \
            uvicorn opentelemetry-api; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$name==$(version "$name")"
done
work=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$work" "nixl-cu13==$(version nixl-cu12)"
(cd "$work" && mkdir x && cd x && unzip -q ../nixl_cu13-*.whl)
python3 .ci/gpu/slim_nixl.py "$work/x"
tar cJf .whl/nixl_slim.tar.xz -C "$work/x" .
rm -rf "$work"
du -sh .whl
