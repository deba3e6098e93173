#!/usr/bin/env bash
# FlashAttention-4 (`--attention-kernel fa4`) on a lent GPU machine, which has no internet: its
# wheels are downloaded here and carried there.
#
# The CuTe DSL's compiler library (nvidia-cutlass-dsl-libs-cu13, 92 MB) is over one call's
# 64 MiB, so it travels in two parts, one per call, into a folder that stays on the warm machine.
# Here, once:   bash bench/fa4_prep.sh download
# Then `run` with carry [".fa4/part.aa"] and a command that begins `bash bench/fa4_prep.sh;`
# (it exits 2 while a part is still missing; make test-gpu fits beside it), and at once (the
# machine goes back after 30 s idle) carry [".fa4/part.ab", ".fa4/whl"] with
#     bash bench/fa4_prep.sh && bash bench/fa4_ab.sh
# or, for other work, `bash bench/fa4_prep.sh && export
# PYTHONPATH=.:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages && ...` (the last path stands
# in for the .pth file the DSL installs, which PYTHONPATH does not read).
# The image's own torch, triton, cuda-bindings, einops and protobuf serve the rest.
set -euo pipefail
WHEELS="flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5"
LIBS=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl

if [ "${1:-}" = download ]; then  # here: the GPU image's Python is 3.12
    rm -rf .fa4 && mkdir -p .fa4/whl
    for w in $WHEELS; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --pre -d .fa4/whl "$w"
    done
    (cd .fa4/whl && sha256sum "$LIBS" > libs.sha256 && split -b 48000000 "$LIBS" ../part. && rm "$LIBS")
    du -sh .fa4/whl .fa4/part.*
    exit 0
fi

# there
mkdir -p /root/fa4/parts /root/fa4/whl
for f in .fa4/part.*; do [ -f "$f" ] && cp "$f" /root/fa4/parts/; done
if ls .fa4/whl/* >/dev/null 2>&1; then cp .fa4/whl/* /root/fa4/whl/; fi
if [ "$(ls /root/fa4/parts | wc -l)" -ge 2 ] && [ -f /root/fa4/whl/libs.sha256 ] && [ ! -d /tmp/site/flash_attn ]; then
    cat /root/fa4/parts/part.* > "/root/fa4/whl/$LIBS"
    (cd /root/fa4/whl && sha256sum -c libs.sha256) || { echo "[fa4_prep] the assembled $LIBS is not the one downloaded"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /root/fa4/whl/*.whl
fi
echo "[fa4_prep] parts: $(ls /root/fa4/parts | tr '\n' ' ') installed: $([ -d /tmp/site/flash_attn ] && echo yes || echo waiting)"
[ -d /tmp/site/flash_attn ] || exit 2
