#!/usr/bin/env bash
# flash-attn 4 for the GPU machine, which has none and cannot download: its pinned wheels
# (CuTe DSL; pure Python but for the DSL's compiler libraries) unpacked here, packed with xz and
# cut in two, because one call to the machine carries at most 64 MiB and this is ~65 MB. Writes
# .fa4a/ and .fa4b/ (ignored). On the machine, back to back (it must stay warm between them):
#   GPU_CHECK_PARTS=flash_stage  (carry .fa4a)        copies the first piece to /tmp, and stops
#   GPU_CHECK_PARTS=flash        (carry .fa4b, .whl)  unpacks both, runs the flash-attn tests
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$work/wheels" flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 \
  nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5 einops==0.8.1
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -rf .fa4a .fa4b && mkdir .fa4a .fa4b
tar -C "$work/site" -cf - . | xz -9e -T0 | split -b 40M - "$work/site.tar.xz.part-"
mv "$work/site.tar.xz.part-aa" .fa4a/ && mv "$work"/site.tar.xz.part-a[b-z] .fa4b/
du -sh .fa4a .fa4b
