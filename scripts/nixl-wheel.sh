#!/usr/bin/env bash
# Download NIXL's wheel for the GPU machine (PyPI nixl-cu13, CPython 3.12) and repack it
# without what gpu-arena's checks do not use (the nixl_ep torch extensions, headers, scripts,
# perftest and the storage/other-fabric plugins), so it fits the 64 MiB a device call carries.
# Usage: bash scripts/nixl-wheel.sh [OUTDIR]   (default .gpu/wheels; prints the wheel's path)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.gpu/wheels}; mkdir -p "$out"
pkg=${NIXL_PACKAGE:-nixl-cu13}; ver=${NIXL_VERSION:-1.5.1}; py=${NIXL_PYTHON:-3.12}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
  --platform manylinux_2_28_x86_64 -d "$tmp" "$pkg==$ver" >&2
whl=$(ls "$tmp"/*.whl); name=$(basename "$whl"); mod=${pkg//-/_}
mkdir "$tmp/x"; (cd "$tmp/x" && python3 -m zipfile -e "$whl" .)
drop='^(nixl_ep_[a-z0-9]+/|[^/]+\.data/|[^/]+\.scripts/)|libucx_perftest|libplugin_(AZURE_BLOB|GDS|GDS_MT|GPUNETIO|GUSLI|INFINIA|LIBFABRIC|OBJ)\.so'
(cd "$tmp/x" && find . -type f | sed 's|^\./||' | grep -E "$drop" | xargs -r rm -f
 find . -type d -empty -delete
 rec=$(ls -d *.dist-info)/RECORD; grep -vE "$drop" "$rec" > "$rec.new"; mv "$rec.new" "$rec"
 rm -f "../$name"; python3 -m zipfile -c "../$name" $(ls -A))
mv "$tmp/$name" "$out/$name"
echo "$out/$name"
