#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, triton, transformers, accelerate, pyarrow, ...
# but not hydra/omegaconf/datasets/deepspeed), for its Python 3.12 / manylinux x86-64, into
# .whl/.
# Usage: bash scripts/build_wheelhouse.sh [.whl]     (then carry the folder to the machine)
set -euo pipefail
out=${1:-.whl}
mkdir -p "$out"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# Pure-python or binary wheels, no dependency resolution (the machine has the rest).
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d "$out" \
  hydra-core==1.3.2 omegaconf==2.3.0 datasets==4.0.0 dill==0.3.8 multiprocess==0.70.16 \
  hjson==3.1.0 ninja==1.13.0 msgpack==1.1.1 py-cpuinfo==9.0.0 einops==0.8.1 \
  pydantic==2.11.7 pydantic-core==2.33.2 annotated-types==0.7.0 typing-inspection==0.4.1
# The training-step peer, vllm-project/speculators 0.9.0 (draftbench/peer_speculators.py): the
# wheel and what `import speculators` needs beyond the image and the wheels above (openai for
# its data client, hs-connectors for its hidden-state transfer; datasets is above). Its other
# declared needs (loguru, pydantic-settings, ...) are imported only by its CLI, config
# schema, converters and checkpoint loading, none of which the peer touches.
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d "$out" \
  speculators==0.9.0 hs-connectors==0.9.0 openai==2.0.0 distro==1.9.0 sniffio==1.3.1
# antlr4-python3-runtime 4.9.3 (omegaconf's parser) is published as an sdist only: build it.
# deepspeed is an sdist too (pure Python; its CUDA ops are built just in time, never here).
python -m pip wheel -q --no-deps -w "$out" antlr4-python3-runtime==4.9.3 deepspeed==0.19.8
ls -1 "$out"
