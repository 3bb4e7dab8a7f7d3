#!/usr/bin/env bash
# Run HERE (with registry access) before a device run: saves into .whl/ the wheels the GPU host's image may
# lack or hold in too old a version for the generated stubs (grpcio >= the stubs' version, protobuf 7), built
# for its Python (3.12, x86-64), at the versions this checkout is tested with. The device run then carries
# .whl (ignored by git, about 9 MB) and run_gpu_checks.sh installs it with --no-index:
#   device run: command "bash tests/gpu/run_gpu_checks.sh", carry [".whl"]
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=${GPU_PYTHON_VERSION:-3.12}
ver() { python3 -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || echo "$2"; }
rm -rf .whl && mkdir -p .whl
for spec in "grpcio==$(ver grpcio 1.85.3)" "grpcio-health-checking==$(ver grpcio-health-checking 1.85.1)" \
            "grpcio-reflection==$(ver grpcio-reflection 1.85.1)" "protobuf==$(ver protobuf 7.36.2)" \
            "msgspec==$(ver msgspec 0.23.0)" "pyzmq==$(ver pyzmq 27.3.0)"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls .whl && du -sh .whl
