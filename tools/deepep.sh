#!/usr/bin/env bash
# DeepEP for the GPU device machine (no internet there; no DeepEP code in this repository), in the ignored .deepep:
#   here:        bash tools/deepep.sh source GIT_DIR [REF]   DeepEP's source at REF into .deepep/src (default v1.2.1,
#                                                            the V1 `deep_ep.Buffer` API the deepep backend uses)
#   on the GPU:  bash tools/deepep.sh build                  built into .deepep/site, then imported once
# GIT_DIR: a clone or mirror of github.com/deepseek-ai/DeepEP (the git directory the `fetch` tool returns). The build
# links the NVSHMEM that torch's CUDA wheels install (nvidia-nvshmem-*); without it DeepEP builds with its internode
# and low-latency kernels off, and the backend's low-latency decode cannot run. Carry both folders to the device:
# run(carry=[".whl", ".deepep"]) (about 2 MB of source); tools/gpu_run.sh puts .deepep/site on the path and its
# `deepep` stage builds there when .deepep/site is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
case ${1:-} in
  source)
    git_dir=${2:?usage: tools/deepep.sh source GIT_DIR [REF]} ref=${3:-v1.2.1}
    rm -rf "$root/.deepep" && mkdir -p "$root/.deepep/src"
    git --git-dir "$git_dir" archive "$ref" | tar -x -C "$root/.deepep/src" --exclude=figures
    echo "$ref $(git --git-dir "$git_dir" rev-parse "$ref^{commit}")" > "$root/.deepep/src/REF"
    du -sh "$root/.deepep/src" ;;
  build)
    cd "$root/.deepep/src"
    echo "DeepEP $(cat REF); NVSHMEM: $(python3 -c 'import nvidia.nvshmem as n; print(n.__path__[0])' 2>/dev/null || echo none)"
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} \
      python3 -m pip install --no-build-isolation --no-deps --no-index --target "$root/.deepep/site" . 2>&1 | tail -5
    cd "$root" && PYTHONPATH=$root/.deepep/site:${PYTHONPATH:-} python3 -c "import deep_ep; print('deep_ep', deep_ep.Buffer)" ;;
  *) echo "usage: tools/deepep.sh source GIT_DIR [REF] | build" >&2; exit 2 ;;
esac
