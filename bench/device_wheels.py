"""The wheels a GPU machine without a network needs, small enough to travel in one call.

    python -m bench.device_wheels sglang          # .whl/sglang-0.5.23-*.whl, pruned
    python -m bench.device_wheels tpu-inference   # .whl/tpu_inference/*.whl

Run on a machine with the registry (Python 3.12's pip for the cp312 wheels). The H200 machine
takes at most 64 MiB of ignored files a call, and its image already holds most of what the
benchmarks import (``IMAGE_HOLDS``, its package list as read on 2026-11-17):

* ``sglang``: SGLang 0.5.23's wheel (39 MB) without ``sglang/multimodal_gen/`` and the compiled
  ``sglang/srt/rust_extensions/*.so`` (cp311 builds, never loaded by the canary's modules or the
  tests): 16 MB, which leaves room for sglang-jax's 30 MB in the same call.
* ``tpu-inference``: what ``requirements-tpu-inference.txt`` pins that the image lacks (torch,
  jax, jaxlib, libtpu and the ``nvidia-*`` libraries are the image's), with xprof cut to the
  modules a runner step imports (tokamax's benchmarking imports ``xprof.cli.tools``, which loads
  the profiler plugin's C library; the events database, the web front end and the tests are
  never loaded): 33 wheels, 49 MB.

``bash bench/gpu_session.sh tpu-inference`` installs the second folder and runs
``bench.tpu_inference_step`` (carry ``.whl/tpu_inference``).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHL = os.path.join(ROOT, ".whl")

IMAGE_HOLDS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs build
certifi charset-normalizer chex click cloudpickle cmake contourpy cycler cython einops etils
filelock flatbuffers flax fonttools frozenlist fsspec grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub idna jax jaxlib jaxtyping jinja2 joblib kiwisolver llvmlite markdown markdown-it-py
markupsafe matplotlib mdurl ml-dtypes mpmath msgpack multidict networkx ninja numba numpy
optax opt-einsum orbax-checkpoint packaging pandas pillow pip pluggy prometheus-client propcache
protobuf psutil py-cpuinfo pyarrow pygments pyparsing python-dateutil pyyaml regex requests rich
safetensors scipy sentencepiece setuptools six sympy tabulate tensorstore tiktoken tokenizers
toolz torch torchvision tqdm transformers treescope triton typing-extensions urllib3 uvloop wheel
wrapt xxhash yarl zipp libtpu
""".split())

PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def _download(specs: list[str], dest: str, python_version: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + specs, check=True)


def prune(src: str, dst: str, drop) -> tuple[int, int]:
    """Copy wheel ``src`` to ``dst`` without the members ``drop(name)`` is true for; returns the
    members kept and dropped."""
    kept = dropped = 0
    tmp = dst + ".tmp"
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zo:
        for info in zi.infolist():
            if drop(info.filename):
                dropped += 1
                continue
            zo.writestr(info, zi.read(info.filename))
            kept += 1
    os.replace(tmp, dst)
    return kept, dropped


def _sglang_drop(name: str) -> bool:
    return name.startswith("sglang/multimodal_gen/") or (
        name.startswith("sglang/srt/rust_extensions/") and name.endswith(".so"))


# xprof as a runner step imports it: tokamax's benchmarking imports ``xprof.cli.tools``, whose
# xplane tools import ``xprof.profile_data`` and ``xprof.convert``, which load the profiler
# plugin's C library. Its events database (another 40 MB library), the web front end and the
# tests are never loaded.
_XPROF_DROPS = ("xprof/convert/events_db/", "xprof/static/", "xprof/integration_tests/",
                "xprof/skills/")


def _xprof_drop(name: str) -> bool:
    return name.startswith(_XPROF_DROPS)


def sglang() -> str:
    os.makedirs(WHL, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        _download(["sglang==0.5.23"], tmp, "3.11")
        [src] = glob.glob(os.path.join(tmp, "sglang-*.whl"))
        dst = os.path.join(WHL, os.path.basename(src))
        prune(src, dst, _sglang_drop)
    return dst


def _pins() -> list[str]:
    out = []
    with open(os.path.join(ROOT, "requirements-tpu-inference.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name = re.split(r"[=<>!~;\[ ]", line, maxsplit=1)[0].lower().replace("_", "-")
            if name in IMAGE_HOLDS or name.startswith("nvidia-"):
                continue
            out.append(line)
    return out


def tpu_inference() -> str:
    dest = os.path.join(WHL, "tpu_inference")
    os.makedirs(dest, exist_ok=True)
    _download(_pins(), dest, "3.12")
    for src in glob.glob(os.path.join(dest, "xprof-*.whl")):
        prune(src, src, _xprof_drop)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("sglang", "tpu-inference"))
    a = ap.parse_args(argv)
    path = sglang() if a.what == "sglang" else tpu_inference()
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(path, "*.whl"))) \
        if os.path.isdir(path) else os.path.getsize(path)
    print(f"{path}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
