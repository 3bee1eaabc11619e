#!/usr/bin/env bash
# One H200 session: environment, GPU tests, memory checker, benchmark. Run from the repo root on
# the GPU machine (which has no network): wheels that its image lacks travel in .whl/
# (apache-tvm-ffi and msgspec for SGLang's CUDA JIT kernels, the sglang wheel itself, and a
# setuptools >= 77 wheel, used only if the image's setuptools is older, to install this checkout).
#   usage: bash bench/gpu_session.sh [gate] [tests] [sanitize] [bench-quick|bench-full] [bench-ops=a,b]
#
# gate: the GPU gate, run with every change to a GPU path (pallas_triton kernels, the direct
# bridge), under 5 minutes: each op's suite at the fast tier's counts on pallas_triton (hostile
# fuzz and race tests included), the golden files, the ring-guard and zero-size suites, every
# test marked gpu (the bridge's direct path, the four-op step captured in a CUDA graph), and the
# memory checker over the hostile launches, side by side; then a dated summary
# (bench/gate_summary.py) into $OUT/gpu-gate/, to commit under bench/results/gpu-gate/, and the
# logs in $OUT/gate-logs.tar.gz. GATE_COMMIT names the commit in the summary (the
# device copy of the checkout may carry a stale .git: pass it explicitly).
#                                    [bench-impls] [bench-quick-impls]
#                                    [checks]   (the GPU-only suites that matter most, < 9 min)
#                                    [bridge]   (the bridge's GPU tests, sanitizer run and bench)
#                                    [sglang-jax]   (the canary next to sglang-jax's step; its
#   wheels travel in .whl/sglang_jax/: on a machine with the registry and Python 3.12,
#   pip download --no-deps -r requirements-sglang-jax.txt -d .whl/sglang_jax)
#                                    [tpu-inference]   (the canary in vLLM's TPU backend's
#   runner step: .whl/tpu_inference/ from python -m kvcanary_jax.bench.device_wheels
#   tpu-inference; TPUINF_ARGS for the bench). SGLang's wheel pruned by
#   python -m kvcanary_jax.bench.device_wheels sglang (16 MB) travels with sglang-jax's.
# bench-impls: the full case list with every op's pallas_triton and xla implementations side by
# side (SGLang and the peers timed once, with pallas_triton), into $OUT/bench-impls.
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SITE=/tmp/site; mkdir -p $SITE
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE \
    .whl/apache_tvm_ffi-*.whl .whl/msgspec-*.whl 2>&1 | tail -2
  # sglang's wheel is tagged cp311 but is pure Python for what we use: unpack it.
  [ -f $SITE/sglang/srt/environ.py ] || python3 -c "import zipfile,glob; zipfile.ZipFile(glob.glob('.whl/sglang-*.whl')[0]).extractall('$SITE')"
fi
export PYTHONPATH=$PWD:$SITE
# The torch bridge and the benchmark keep their folders (bridge/, bench/) and are the package's
# kvcanary_jax.bridge and kvcanary_jax.bench through pyproject's package-dir, which only an
# install resolves: install this checkout, editable, offline, with the image's own setuptools and
# none of the dependencies (the image has them). Stop here if that fails or resolves elsewhere:
# every step below would fail on its first import.
# pyproject's build needs setuptools >= 77 (its SPDX license string): an older image setuptools
# is replaced, for this install only, by a carried wheel (.whl/setuptools-*.whl) when there is one.
BUILD_PATH=$PYTHONPATH
if ! python3 -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
    && ls .whl/setuptools-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/buildtools \
    .whl/setuptools-*.whl > "$OUT/install.log" 2>&1
  BUILD_PATH=/tmp/buildtools:$PYTHONPATH
fi
if ! PYTHONPATH=$BUILD_PATH python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    -e . >> "$OUT/install.log" 2>&1; then
  setuptools=$(python3 -c 'import setuptools; print(setuptools.__version__)' 2>&1 | tail -1)
  echo "gpu_session: installing the checkout failed (pip install --no-index --no-deps" \
       "--no-build-isolation -e .; setuptools $setuptools); the end of $OUT/install.log:" >&2
  tail -25 "$OUT/install.log" >&2
  exit 1
fi
if ! python3 -c "
import os, sys, importlib.util as u
want = {'kvcanary_jax.bridge': 'bridge', 'kvcanary_jax.bench': 'bench'}
for name, folder in want.items():
    spec = u.find_spec(name)
    got = os.path.dirname(spec.origin) if spec and spec.origin else None
    if got is None or not os.path.samefile(got, folder):
        sys.exit(f'{name} resolves to {got}, not this checkout\'s {folder}/')
"; then
  echo "gpu_session: the installed checkout does not resolve kvcanary_jax.bridge and" \
       "kvcanary_jax.bench to this checkout's folders; stopping" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import jax, torch, triton; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'triton', triton.__version__)"
OPS=scatter,plan,write,verify,bridge
for a in "$@"; do case $a in bench-ops=*) OPS=${a#bench-ops=};; esac; done
for step in "$@"; do
  case $step in
    gate)
      G=/tmp/gate; rm -rf $G; mkdir -p $G; t0=$SECONDS
      python3 -c "import jax, torch, triton, platform; print(f'python {platform.python_version()}, jax {jax.__version__}, torch {torch.__version__}, triton {triton.__version__}'); print('device:', jax.devices()[0].device_kind)" > $G/env.txt 2>&1
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | sed 's/^/gpu: /' >> $G/env.txt
      P="timeout 290 python3 -m pytest -q -p no:cacheprovider --durations=5"
      I="env KVCANARY_TEST_IMPLEMENTATIONS=pallas_triton"
      parts=(
        "scatter_plan|$I $P tests/test_scatter.py tests/test_plan.py"
        # The write's and the verify's suites, two processes each: whole, they ran past their
        # 290 s on a slow host on 2026-12-06 (214 s on 2026-12-06 10:20).
        "write_0|$I KVCANARY_TEST_SHARD=0/2 $P tests/test_write.py"
        "write_1|$I KVCANARY_TEST_SHARD=1/2 $P tests/test_write.py"
        "verify_0|$I KVCANARY_TEST_SHARD=0/2 $P tests/test_verify.py"
        "verify_1|$I KVCANARY_TEST_SHARD=1/2 $P tests/test_verify.py"
        "golden_guard_zero|$I $P tests/test_golden.py tests/test_ring_guard.py tests/test_zero_sizes.py"
        # The digest's suite and the coverage's, each a part of its own: with the others beside
        # them they ran out of their 290 s on 2026-12-05 (278 s the run before; about 200 s with
        # one other part beside them).
        # (its TPU interpret-mode tests, 55 s of its 280 s on a0ec8fd, are CPU work CI runs:
        # left out here)
        "digest|$I $P -m 'not tpu_interpret' tests/test_digest.py"
        "halves_races|$I $P tests/test_plan_halves.py tests/test_races.py"
        # test_coverage.py took 264 of its 290 s on 2026-12-05 (14:13): its demo and SGLang-form
        # tests go beside the campaign (88 s).
        "coverage|$I $P tests/test_coverage.py -k 'not demo and not sglangs'"
        "coverage_campaign|$I $P tests/test_coverage_campaign.py tests/test_coverage.py -k 'first_check or clean_run or demo or sglangs'"
        # The bridge's coverage suites on CUDA tensors, and their CPU-tensor runs on this CUDA
        # host (SGLang's phase checker and pinned staging take other paths here than on CI's
        # CPU machine: both failed on 2026-12-04 before their fixes).
        # Its two flip campaigns take about 100 s each: a part of their own (the whole took 285
        # of its 290 s on 2026-12-04), and the digest's own tests another (the rest took 263 s
        # beside the other parts on 60ffd07, and ran past 290 on e1e4808: 31.7 s alone).
        "bridge_digest|$P -m gpu tests/test_bridge_digest.py"
        # The clean runs and the captured decode step: two parts (together they ran past 290 s
        # beside the other parts on 2026-12-05, 246 s on 2026-12-04).
        "bridge_coverage_clean|$P -m gpu tests/test_bridge_coverage.py -k clean_run"
        "bridge_coverage|$P -m gpu tests/test_bridge_coverage.py -k 'not first_check and not clean_run'"
        # The two flip campaigns, a part each: together they took 186-286 s of their 290 on
        # 2026-12-05/06 and ran past it on bc72492 (132 s and 89 s alone on faf441f).
        "bridge_coverage_flips_mha|$P -m gpu tests/test_bridge_coverage.py -k 'first_check and mha'"
        "bridge_coverage_flips_swa|$P -m gpu tests/test_bridge_coverage.py -k 'first_check and swa'"
        # The CPU-tensor runs took 286 s of their 290 s on a0ec8fd: the serving suite (its
        # growing-history decode loop, 56 s) is a part of its own.
        "bridge_coverage_cpu|$P -m 'not gpu' tests/test_bridge_digest.py tests/test_bridge_coverage.py"
        "bridge_serving_cpu|$P -m 'not gpu' tests/test_bridge_serving.py"
        # The bridge's differential test alone takes about 100 s: it gets a part of its own, so
        # no part runs near its 290 s limit.
        "gpu_bridge_differential|$P -m gpu tests/test_bridge.py -k differential_helpers"
        "gpu_bridge|$P -m gpu tests/test_bridge.py -k 'not differential_helpers'"
        "gpu_bridge_direct|$P -m gpu tests/test_bridge_gpu.py"
        # Every other test marked gpu (the bridge's run in the parts above).
        "gpu_ops|$P -m gpu tests --ignore=tests/test_bridge.py --ignore=tests/test_bridge_gpu.py --ignore=tests/test_bridge_digest.py --ignore=tests/test_bridge_coverage.py"
        "memcheck|timeout 290 compute-sanitizer --tool memcheck --print-limit 5 python3 -m kvcanary_jax.bench.sanitize_cases"
      )
      pids=()
      for part in "${parts[@]}"; do
        ( s=$SECONDS; bash -c "${part#*|}" > "$G/${part%%|*}.log" 2>&1; echo $((SECONDS - s)) > "$G/${part%%|*}.wall" ) &
        pids+=($!)
      done
      wait "${pids[@]}"
      python3 - "$G" "${parts[@]}" <<'PY'
import json, sys
g, parts = sys.argv[1], sys.argv[2:]
out = []
for p in parts:
    name, cmd = p.split("|", 1)
    out.append({"name": name, "command": cmd, "wall": open(f"{g}/{name}.wall").read().strip()})
json.dump(out, open(f"{g}/parts.json", "w"))
PY
      python3 -m kvcanary_jax.bench.gate_summary --logs $G --out $OUT/gpu-gate --commit "${GATE_COMMIT:-unknown}" \
        --wall $((SECONDS - t0)) | tail -30
      tar czf $OUT/gate-logs.tar.gz -C /tmp gate ;;
    tests)
      python3 -m pytest -q -x -p no:cacheprovider tests 2>&1 | tee $OUT/tests.log | tail -25 ;;
    sanitize)
      compute-sanitizer --tool memcheck --print-limit 5 python3 -m kvcanary_jax.bench.sanitize_cases 2>&1 | tee $OUT/sanitize.log | tail -15 ;;
    checks)
      python3 -c "import kvcanary_jax as kc; from kvcanary_jax.ops import _registry as r; print('available', kc.implementations_available(), 'default', {o: r.op(o).default() for o in ('scatter', 'plan', 'write', 'verify')})"
      timeout 260 python3 -m pytest -v -p no:cacheprovider --durations=8 tests/test_bridge_gpu.py \
        tests/test_bridge.py::test_gpu_stream_order_side_stream_producer_no_stale_reads 2>&1 |
        tee $OUT/bridge_gpu.log | grep -E "PASS|FAIL|ERROR|passed|failed|s call" | tail -25
      KVCANARY_TEST_IMPLEMENTATIONS=pallas_triton,xla timeout 200 python3 -m pytest -q \
        -p no:cacheprovider --durations=5 tests/test_golden.py tests/test_ring_guard.py \
        tests/test_zero_sizes.py 2>&1 | tee $OUT/impl_tests.log | tail -15
      timeout 170 compute-sanitizer --tool memcheck --print-limit 5 \
        python3 -m kvcanary_jax.bench.sanitize_cases --bridge-only --launches 4 2>&1 |
        tee $OUT/bridge_sanitize.log | tail -8 ;;
    bench-quick-impls)
      timeout 260 python3 -m kvcanary_jax.bench --quick --ops "${OPS/,bridge/}" \
        --implementations pallas_triton,xla --out $OUT/bench-quick-impls 2>&1 | tail -70 ;;
    bridge-bench)
      timeout 150 python3 -m kvcanary_jax.bench.bridge_overhead --device cuda --bs 64,256 --sglang \
        --iters 270 --rounds 9 --out $OUT/bridge_overhead.json 2>&1 | tail -20
      timeout 40 python3 -m kvcanary_jax.bench.bridge_direct --bs 64,256 --out $OUT/bridge_direct.json \
        2>&1 | tail -25 ;;
    bench-quick)
      python3 -m kvcanary_jax.bench --quick --ops $OPS --out $OUT/bench 2>&1 | tail -60 ;;
    bridge)
      # Everything the torch bridge needs checked on the GPU, in one go (< 8 min on the H200).
      timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_bridge.py \
        tests/test_bridge_gpu.py 2>&1 | tee $OUT/bridge_tests.log | tail -25
      timeout 75 compute-sanitizer --tool memcheck --print-limit 5 \
        python3 -m kvcanary_jax.bench.sanitize_cases --bridge-only 2>&1 | tee $OUT/bridge_sanitize.log | tail -8
      timeout 150 python3 -m kvcanary_jax.bench.bridge_overhead --device cuda --bs 64,256 --sglang \
        --iters 270 --rounds 9 --out $OUT/bridge_overhead.json 2>&1 | tail -20
      timeout 40 python3 -m kvcanary_jax.bench.bridge_direct --bs 64,256 --out $OUT/bridge_direct.json \
        2>&1 | tail -25
      timeout 15 python3 -m kvcanary_jax.bench.bridge_profile --out $OUT/bridge_profile.json >/dev/null 2>&1
      python3 -c "import json; print(json.load(open('$OUT/bridge_profile.json')))" ;;
    bench-full)
      python3 -m kvcanary_jax.bench --ops $OPS --out $OUT/bench 2>&1 | tail -80 ;;
    sglang-jax)
      # sglang-jax 0.0.2 and what it imports, behind the image's packages (jax, torch, numpy):
      # a .pth in the image's site-packages appends the target after them.
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgljax \
        .whl/sglang_jax/*.whl 2>&1 | grep -v "^WARNING" | tail -2
      echo /tmp/sgljax > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz-sgljax.pth"
      JAX_PLATFORMS=cuda timeout ${SGLJAX_TIMEOUT:-540} python3 -m kvcanary_jax.bench.sglang_jax_step \
        ${SGLJAX_ARGS:-} --out $OUT/sglang_jax 2>&1 | grep -v "^WARNING" | tail -20 ;;
    tpu-inference)
      # tpu-inference 0.32, vllm-tpu 0.32 and what they import that the image lacks, from
      # .whl/tpu_inference/ (python -m kvcanary_jax.bench.device_wheels tpu-inference, 49 MB),
      # ahead of the image's packages and without SGLang's folder (another apache-tvm-ffi).
      # tpu-inference refuses JAX_PLATFORMS=cuda (it allows '', tpu, cpu, proxy): left empty, jax
      # takes the GPU.
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tpuinf \
        .whl/tpu_inference/*.whl 2>&1 | grep -v "^WARNING" | tail -2
      PYTHONPATH=/tmp/tpuinf:$PWD JAX_PLATFORMS= timeout ${TPUINF_TIMEOUT:-540} \
        python3 -m kvcanary_jax.bench.tpu_inference_step ${TPUINF_ARGS:-} \
        --out $OUT/tpu_inference 2>&1 | grep -v "^WARNING" | tail -20 ;;
    bench-impls)
      python3 -m kvcanary_jax.bench --iters 40 --ops "${OPS/,bridge/}" --implementations pallas_triton,xla \
        --out $OUT/bench-impls 2>&1 | tail -80 ;;
  esac
done
