#!/usr/bin/env bash
# The pi0 benchmark's peer as a folder of packages (benchmarks/step/pi0_lerobot.py runs on it):
# LeRobot's pi0 / pi0.5 PyTorch policies from the registry, on the transformers they are written
# for, for the GPU machine's Python 3.12 (no network there: the folder travels with `carry`).
#
#   bash benchmarks/tools/make_lerobot_peer.sh OPENPI_DIR [TARGET]    # TARGET: .peers/lerobot
#
# lerobot 0.4.4 is the newest release the registry here serves. Its `pi` extra is
# `transformers @ git+https://github.com/huggingface/transformers.git@fix/lerobot_openpi`, a
# branch no registry holds (the wheel drops the git requirement): openpi's
# `transformers_replace` files (adaptive RMSNorm and gated residuals in Gemma, `_gated_residual`,
# the PaliGemma and SigLIP edits, `siglip/check.py`) over transformers 4.53.2. No released
# transformers has them (the policies import `transformers.models.siglip.check` and refuse to
# build without it), so the folder is that: transformers 4.53.2 with the five files of an openpi
# checkout (OPENPI_DIR: its root, holding src/openpi/models_pytorch/transformers_replace) copied
# over it, as openpi's README installs them. The check accepts 4.53.2 only.
# Everything is --no-deps: torch, numpy, safetensors, pandas, pyarrow, einops, accelerate,
# torchvision, ... come from the GPU machine's image; what lerobot's import chain needs beyond
# it is listed here, at the versions lerobot 0.4.4 and transformers 4.53.2 accept
# (huggingface_hub < 1, tokenizers 0.21, peft 0.17 for that transformers). transformers/models
# is pruned to what the policies and peft import, and diffusers (imported by lerobot's GR00T config)
# to its models (a device call carries 64 MiB with the tree): about 40 MiB.
set -euo pipefail
openpi=${1:?usage: make_lerobot_peer.sh OPENPI_DIR [TARGET]}
target=${2:-.peers/lerobot}
replace=$openpi/src/openpi/models_pytorch/transformers_replace
[[ -f $replace/models/siglip/check.py ]] || { echo "no transformers_replace under $openpi" >&2; exit 1; }
rm -rf "$target"
python3 -m pip install -q --target "$target" --python-version 3.12 --implementation cp \
  --only-binary=:all: --platform manylinux2014_x86_64 --no-deps --no-compile \
  lerobot==0.4.4 transformers==4.53.2 huggingface_hub==0.35.3 tokenizers==0.21.4 peft==0.17.1 \
  draccus==0.10.0 mergedeep==1.3.4 pyyaml-include==1.4.1 toml==0.10.2 \
  datasets==4.4.1 dill==0.4.0 multiprocess==0.70.18 diffusers==0.35.2 pyserial==3.5 \
  termcolor==3.2.0 deepdiff==8.6.1 orderly-set==5.5.0 jsonlines==4.0.0
cp -r "$replace"/* "$target/transformers/"
keep=" auto gemma paligemma siglip encoder_decoder bloom "  # bloom: peft imports it
for d in "$target"/transformers/models/*/; do
  name=$(basename "$d")
  # others keep their configuration (the auto classes' key lists import every one)
  [[ $keep == *" $name "* ]] || find "$d" -type f ! -name '__init__.py' ! -name 'configuration_*.py' -delete
done
rm -rf "$target/tests" "$target/bin" "$target/diffusers/pipelines"  # groot's config imports diffusers' models
du -sh "$target"
