#!/usr/bin/env bash
# Fill the folders the device harness (benchmarks/gpu_session.sh) expects but git does not keep:
#   .whl/           wheels for the GPU machine's Python 3.12 that its image lacks: fla-core, and the HTTP
#                   server stack (fastapi, starlette, uvicorn, pydantic, pydantic-core, opentelemetry-api, ...);
#                   carry it with the device tool (carry [".whl"]); the harness installs it into /tmp/site.
#   .bench_assets/  the Qwen3.5 tokenizer and chat template for `nibble serve` / `nibble bench serve` stages
#                   (untracked, not ignored: the device tool copies it with the working tree).
# Run from the repository root with the project's virtual environment active (versions follow it).
set -euo pipefail
mkdir -p .whl .bench_assets
ver() { python3 -m pip show "$1" | awk '/^Version/{print $2}'; }
pkgs=(fla-core fastapi starlette uvicorn pydantic pydantic-core opentelemetry-api annotated-types
      typing-inspection annotated-doc llguidance)
specs=()
for p in "${pkgs[@]}"; do specs+=("$p==$(ver "$p")"); done
python3 -m pip download -q --no-deps -d .whl --python-version 3.12 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 \
  --only-binary=:all: "${specs[@]}"
shared=${SHARED:-../shared}/models/qwen3.5
cp "$shared/tokenizer/tokenizer.json" "$shared/chat_template.jinja" .bench_assets/
ls .whl .bench_assets
