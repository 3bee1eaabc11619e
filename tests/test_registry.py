"""Implementation choice, fallback, launch-config resolution and the tuned tables."""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest

import jax

import kvcanary_jax as kc
from kvcanary_jax import runtime as rt
from kvcanary_jax.ops import _registry

OPS = ("scatter", "plan", "write", "verify")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", OPS)
def test_every_op_registers_the_pallas_kernels(name):
    registered = _registry.op(name).registered()
    assert {"pallas_triton", "pallas_interpret"} <= set(registered)
    assert set(registered) <= set(kc.IMPLEMENTATIONS)


@pytest.mark.parametrize("name", OPS)
def test_defaults_per_platform(name):
    op = _registry.op(name)
    # The platform-independent fallback: xla where the op registers it.
    fallback = "xla" if "xla" in op.registered() else "pallas_interpret"
    assert kc.default_implementation(name, platform="cpu") == fallback
    assert op.select(None, platform="cuda") == "pallas_triton"
    want_tpu = "pallas_mosaic_tpu" if "pallas_mosaic_tpu" in op.registered() else fallback
    assert op.select(None, platform="tpu") == want_tpu
    # An explicit, usable implementation is taken as asked, whatever the platform.
    assert op.select("pallas_interpret", platform="cuda") == "pallas_interpret"
    # The Triton kernels compile for CUDA only: elsewhere the fallback runs (with a warning),
    # except when lowering for CUDA (the bridge's direct path, on any host).
    assert op.unusable("pallas_triton", platform="cpu") == (
        "its kernels compile for CUDA GPUs and the platform is 'cpu' (pallas_interpret runs the "
        "same kernels anywhere, as a test tool)")
    with _registry.lowering_for("cuda"):
        assert op.select("pallas_triton") == "pallas_triton"


def test_pallas_triton_on_a_cpu_falls_back_to_xla_with_one_warning_saying_why():
    """Asked on a CPU backend (the API, and the demo's --implementation pallas_triton), the
    Triton kernels cannot compile (JAX: "Only interpret mode is supported on CPU backend"): the
    call runs xla, equal to it, with one FallbackWarning that says why."""
    out = _run("""
        import warnings
        import jax, jax.numpy as jnp, numpy as np
        import kvcanary_jax as kc

        def scatter(impl):
            with jax.enable_x64(True):
                return np.asarray(kc.scatter_req_token_ids(
                    flat_in=jnp.arange(5, dtype=jnp.int64), offsets=jnp.array([0, 2, 5]),
                    req_pool_indices=jnp.array([1, 2]), pool_out=jnp.zeros((3, 4), jnp.int32),
                    implementation=impl))

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            first, second = scatter("pallas_triton"), scatter("pallas_triton")
        msgs = [str(x.message) for x in w if issubclass(x.category, kc.FallbackWarning)]
        assert msgs == ["kv-canary: implementation 'pallas_triton' is unavailable: its kernels "
                        "compile for CUDA GPUs and the platform is 'cpu' (pallas_interpret runs "
                        "the same kernels anywhere, as a test tool); using 'xla'"], msgs
        # It names the caller's line (here, the script's), not the package's.
        where = [(x.filename, x.lineno) for x in w if issubclass(x.category, kc.FallbackWarning)]
        assert where == [("<string>", 8)], where
        assert first.tolist() == second.tolist() == scatter("xla").tolist()
        print("OK")
    """)
    assert "OK" in out


def test_available_here():
    avail = kc.implementations_available()
    assert "pallas_interpret" in avail
    if jax.default_backend() == "cpu":
        assert "pallas_triton" not in avail and "pallas_mosaic_tpu" not in avail


def test_unknown_implementation():
    with pytest.raises(ValueError, match="unknown implementation 'cuda'"):
        _registry.op("verify").select("cuda")
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        rt.CanaryConfig(max_reqs=2, context_len=4, num_slots=4, max_bs=1, max_tokens=2,
                        implementation="nope")


def test_fallback_warns_once_and_says_why():
    """An implementation that is not usable runs the fallback, with one warning per reason."""
    out = _run("""
        import warnings
        import jax, jax.numpy as jnp, numpy as np
        import kvcanary_jax as kc

        def scatter():
            with jax.enable_x64(True):
                return np.asarray(kc.scatter_req_token_ids(
                    flat_in=jnp.arange(5, dtype=jnp.int64), offsets=jnp.array([0, 2, 5]),
                    req_pool_indices=jnp.array([1, 2]), pool_out=jnp.zeros((3, 4), jnp.int32),
                    implementation="pallas_mosaic_tpu"))

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            first, second = scatter(), scatter()
        msgs = [str(x.message) for x in w if issubclass(x.category, kc.FallbackWarning)]
        assert len(msgs) == 1, msgs
        assert ("'pallas_mosaic_tpu' is unavailable: its kernels compile for TPUs and the platform "
                "is 'cpu'") in msgs[0]
        assert first.tolist() == second.tolist() == [[0] * 4, [0, 1, 0, 0], [2, 3, 4, 0]]
        print("OK")
    """)
    assert "OK" in out


@pytest.mark.e2e  # the runtime's step and sweep, in a process of its own
def test_importing_and_running_leaves_warning_filters_alone():
    """No filter is added or left behind by importing the package and running every op, the
    runtime's step and the sweep (JAX's and the Pallas modules' own filters are in place first)."""
    out = _run("""
        import warnings
        import jax, jax.numpy as jnp
        from jax.experimental import pallas
        from jax.experimental.pallas import triton
        jax.jit(lambda x: x + 1)(1)
        before = list(warnings.filters)

        import kvcanary_jax as kc
        from kvcanary_jax import sim
        server = sim.Server(sim.SimConfig(steps=3, seed=1, sweep_interval=2))
        for _ in range(3):
            server.step()
        with jax.enable_x64(True):
            ctx = kc.VerifyOrWriteContext.allocate(num_slots=8)
            plan = kc.VerifyPlan.allocate(verify_capacity=4)
            kc.canary_verify(context=ctx, plan=plan, check_verify_expected_token=True)
        assert warnings.filters == before, [f for f in warnings.filters if f not in before]
        print("OK")
    """)
    assert "OK" in out


def test_quiet_triton_lowering_is_scoped():
    from kvcanary_jax import _config

    before = list(__import__("warnings").filters)
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with _config.quiet_triton_lowering():
            warnings.warn("The Pallas Triton backend is deprecated and will be removed",
                          DeprecationWarning)
            warnings.warn("another deprecation", DeprecationWarning)
        warnings.warn("The Pallas Triton backend is deprecated and will be removed",
                      DeprecationWarning)
    assert [str(x.message) for x in w] == [
        "another deprecation", "The Pallas Triton backend is deprecated and will be removed"]
    assert warnings.filters == before


# --- launch configs -------------------------------------------------------------------------


def _pallas_config(op):
    return _registry.op(op).module("pallas_triton").Config


def test_explicit_config_is_used_and_type_checked():
    op = _registry.op("verify")
    cfg = _pallas_config("verify")(block=64, group=2, vec=2)
    assert op.config("pallas_triton", {"capacity": 10, "num_slots": 4}, cfg) is cfg
    # pallas_interpret: the same config in interpret mode.
    assert op.config("pallas_interpret", {"capacity": 10, "num_slots": 4}, cfg) == \
        dataclasses.replace(cfg, interpret=True)
    with pytest.raises(TypeError, match="takes a kvcanary_jax.ops.verify.pallas_triton.Config"):
        op.config("pallas_interpret", {"capacity": 10, "num_slots": 4},
                  _pallas_config("write")())
    with pytest.raises(ValueError, match="bad launch parameters block=48"):
        _pallas_config("verify")(block=48)


def test_tuned_table_then_heuristics():
    op = _registry.op("verify")
    Config = _pallas_config("verify")
    h200 = "NVIDIA H200"
    # The H200 sweep's best at 64k entries (bench/results/tuning/tune_verify_small.json).
    shapes = {"capacity": 65536, "num_slots": 9, "real_kv_words": 0}
    tuned = op.config("pallas_triton", shapes, kind=h200)
    assert tuned == Config(block=256, max_programs=264, num_warps=2, num_stages=1, group=1,
                           vec=1, hoist=False)
    # The sweep folded no real KV: its entries do not apply to a verify that fingerprints.
    assert op.config("pallas_triton", {**shapes, "real_kv_words": 32}, kind=h200) == \
        op.config("pallas_triton", {**shapes, "real_kv_words": 32}, kind="cpu")
    # No entry for this capacity: the heuristics' small-plan shape, then the large-plan one.
    assert op.config("pallas_triton", {"capacity": 2048, "num_slots": 9}, kind=h200) == Config(
        block=128, num_warps=4, group=1, vec=1)
    assert op.config("pallas_triton", {"capacity": 1 << 21, "num_slots": 9}, kind=h200) == Config()
    # No table for the device kind: heuristics.
    assert op.config("pallas_triton", {"capacity": 65536, "num_slots": 9}, kind="cpu") == Config(
        block=256, num_warps=2, group=1, vec=1, max_programs=264)
    # A verify that folds real KV (8 words or more): one entry per lane in one-warp programs,
    # up to 2^18 entries; past that, and below 8 words, the shapes above.
    fold = Config(block=32, num_warps=1, max_programs=1 << 30, group=1, vec=1)
    for capacity in (1, 4240, 132864, 1 << 18):
        assert op.config("pallas_triton", {"capacity": capacity, "num_slots": 9,
                                           "real_kv_words": 32}, kind=h200) == fold
    assert op.config("pallas_triton", {"capacity": (1 << 18) + 1, "num_slots": 9,
                                       "real_kv_words": 32}, kind=h200) == Config()
    assert op.config("pallas_triton", {"capacity": 2048, "num_slots": 9, "real_kv_words": 2},
                     kind=h200) == Config(block=128, num_warps=4, group=1, vec=1)
    # The tables are per implementation: interpret mode is not tuned.
    assert op.config("pallas_interpret", {"capacity": 65536, "num_slots": 9}, kind=h200) == \
        op.config("pallas_interpret", {"capacity": 65536, "num_slots": 9}, kind="cpu")


def test_shipped_tables_build_their_configs():
    tables = [f for f in importlib.resources.files("kvcanary_jax").joinpath("tuning").iterdir()
              if f.name.endswith(".json")]
    assert {f.name for f in tables} >= {"scatter.nvidia_h200.json", "verify.nvidia_h200.json"}
    for f in tables:
        table = json.loads(f.read_text())
        op = _registry.op(table["op"])
        assert f.name == _registry.table_name(table["op"], table["device_kind"])
        for impl, entries in table["implementations"].items():
            Config = op.module(impl).Config
            for e in entries:
                Config(**e["config"])
                assert set(e["key"]) <= set(_shapes_keys(table["op"])), (f.name, e["key"])


def _shapes_keys(op):
    """The keys of an op's static shapes (what a table entry's key may name)."""
    from kvcanary_jax.ops.plan import base as plan_base
    from kvcanary_jax.ops.scatter import base as scatter_base
    from kvcanary_jax.ops.verify import base as verify_base
    from kvcanary_jax.ops.write import base as write_base

    z = lambda *shape: np.zeros(shape)  # noqa: E731
    if op == "scatter":
        return scatter_base.shapes(scatter_base.ScatterInputs(
            flat_in=z(4), offsets=z(3), req_pool_indices=z(2), pool_out=z(3, 5)), max_cols=5)
    ns = types.SimpleNamespace
    if op == "verify":
        return verify_base.shapes(ns(canary_buf=z(8, 32), real_kv_words=lambda: 0),
                                  ns(verify_slot_indices=z(6)))
    if op == "write":
        return write_base.shapes(ns(canary_buf=z(8, 32)), ns(write_seed_slot_indices=z(2)),
                                 ns(input_ids=z(7)))
    vp, wp = kc.VerifyPlan.allocate(verify_capacity=4), kc.WritePlan.allocate(write_req_capacity=2)
    return plan_base.shapes(vp, wp, plan_base.inputs_of(z(2), z(2), z(2), z(3, 4), None, None,
                                                         None))


def test_update_tuned_table_merges_by_key(tmp_path):
    Config = _pallas_config("write")
    e1 = {"key": {"write_capacity": 4, "num_tokens": 8}, "config": {"block": 32, "unroll": 4,
                                                                      "num_warps": 1}}
    e2 = {"key": {"write_capacity": 1, "num_tokens": 8}, "config": {"block": 64, "unroll": 8,
                                                                      "num_warps": 2}}
    path = _registry.update_tuned_table("write", "pallas_triton", "Test GPU 9", [e1, e2],
                                        directory=tmp_path)
    e1b = dict(e1, config={"block": 16, "unroll": 2, "num_warps": 1})
    _registry.update_tuned_table("write", "pallas_triton", "Test GPU 9", [e1b], directory=tmp_path)
    table = json.loads(open(path).read())
    assert os.path.basename(path) == "write.test_gpu_9.json"
    assert table["device_kind"] == "Test GPU 9"
    assert [e["config"] for e in table["implementations"]["pallas_triton"]] == [
        e2["config"], e1b["config"]]
    assert Config(**e1b["config"]) == Config(block=16, unroll=2)


def test_step_takes_implementation():
    cfg = rt.CanaryConfig(max_reqs=2, context_len=4, num_slots=4, max_bs=1, max_tokens=2)
    step = rt.make_canary_step(cfg, lambda kv, *a: kv, implementation="pallas_interpret")
    assert step.cfg == dataclasses.replace(cfg, implementation="pallas_interpret")
    assert rt.make_canary_step(cfg, lambda kv, *a: kv).cfg.implementation is None


@pytest.mark.gpu
def test_gpu_default_is_triton_and_its_notice_stays_inside():
    """On a CUDA GPU every op defaults to pallas_triton, and the Triton lowering's deprecation
    notice (jax >= 0.11) never reaches the caller of an op, even with that notice as an error;
    the caller's own lowering of a traced op sees it unless it asks for quiet."""
    notice_is_error = "error:The Pallas Triton backend is deprecated:DeprecationWarning"
    out = subprocess.run([sys.executable, "-W", notice_is_error, "-c", textwrap.dedent("""
        import warnings
        import jax, jax.numpy as jnp
        import kvcanary_jax as kc
        assert [kc.default_implementation(o) for o in ("scatter", "plan", "write", "verify")] \\
            == ["pallas_triton"] * 4
        assert "pallas_triton" in kc.implementations_available()
        with jax.enable_x64(True):
            args = dict(flat_in=jnp.arange(5, dtype=jnp.int64), offsets=jnp.array([0, 2, 5]),
                        req_pool_indices=jnp.array([1, 2]), pool_out=jnp.zeros((3, 4), jnp.int32))
            out = kc.scatter_req_token_ids(**args)
            assert out.tolist() == [[0] * 4, [0, 1, 0, 0], [2, 3, 4, 0]]
            f = jax.jit(lambda a: kc.scatter_req_token_ids(**dict(args, flat_in=a)))
            with kc.quiet_triton_lowering():
                f(args["flat_in"])
        print("OK", jax.devices()[0].device_kind)
    """)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK" in out.stdout


_MULTIPLE = "block must be a positive multiple of 512, got"


@pytest.mark.parametrize("op,field,bad,text", [
    ("scatter", "group", 0, "scatter_req_token_ids (pallas_mosaic_tpu): group must be in [1, 64], "
                            "got 0"),
    ("plan", "block", 100, f"canary_plan (pallas_mosaic_tpu): {_MULTIPLE} 100"),
    ("write", "block", 0, f"canary_write (pallas_mosaic_tpu): {_MULTIPLE} 0"),
    ("verify", "block", 1000, f"canary_verify (pallas_mosaic_tpu): {_MULTIPLE} 1000"),
])
def test_tpu_configs_refuse_bad_values_and_share_their_fields(op, field, bad, text):
    """The Mosaic TPU configs: a bad value is refused naming the op; every one takes the shared
    ``vmem_limit_bytes`` and ``interpret`` fields; the defaults pass their own checks."""
    import importlib

    from kvcanary_jax.ops import _tpu_lib

    mod = importlib.import_module(f"kvcanary_jax.ops.{op}.pallas_mosaic_tpu")
    with pytest.raises(ValueError) as e:
        mod.Config(**{field: bad})
    assert str(e.value) == "kv-canary: " + text
    cfg = mod.Config(vmem_limit_bytes=1 << 20)
    assert isinstance(cfg, _tpu_lib.Config) and cfg.interpret is None
    interpreted = dataclasses.replace(cfg, interpret=_tpu_lib.interpret_params())
    assert interpreted.vmem_limit_bytes == 1 << 20


# A corrupt or malformed tuned table: refused with the file named (a raw JSONDecodeError,
# KeyError, TypeError or AttributeError before), and written atomically.

_KIND = "Test GPU 7"


def _table_file(tmp_path, monkeypatch, text):
    monkeypatch.setattr(_registry, "_tuning_dir", lambda: tmp_path)
    _registry.load_table.cache_clear()
    path = tmp_path / _registry.table_name("verify", _KIND)
    path.write_text(text)
    return path


_ENTRY = {"key": {"capacity": 6}, "config": {"block": 64}}


@pytest.mark.parametrize("text,what", [
    ("", "not JSON (Expecting value: line 1 column 1 (char 0))"),
    ('{"op": "verify", "implementations": {"pallas_tri',
     "not JSON (Unterminated string starting at: line 1 column 38 (char 37))"),
    ("[1, 2]", "the top level is a list, not an object"),
    ('{"op": "verify"}', "'implementations' must be an object of implementation -> list"),
    ('{"implementations": {"pallas_triton": {"key": {}}}}',
     "implementations['pallas_triton'] must be a list of entries"),
    ('{"implementations": {"pallas_triton": [{"config": {}}]}}',
     "implementations['pallas_triton'][0] must be an object with a 'key' object and a 'config' "
     "object"),
])
def test_a_malformed_tuned_table_is_refused_naming_the_file(tmp_path, monkeypatch, text, what):
    path = _table_file(tmp_path, monkeypatch, text)
    msg = (f"kv-canary: tuned table {path} is malformed: {what} (rerun the tuning script that "
           "wrote it, or delete the file)")
    with pytest.raises(_registry.TuningTableError) as e:
        _registry.tuned_config("verify", "pallas_triton", {"capacity": 6}, kind=_KIND)
    assert str(e.value) == msg and isinstance(e.value, ValueError)
    # update_tuned_table refuses it too, and leaves it as it was (not overwritten).
    with pytest.raises(_registry.TuningTableError) as e:
        _registry.update_tuned_table("verify", "pallas_triton", _KIND, [_ENTRY], directory=tmp_path)
    assert str(e.value) == msg and path.read_text() == text


@pytest.mark.parametrize("config,cause", [
    ({"blok": 64}, "unexpected keyword argument 'blok'"),  # an unknown field
    ({"block": "64"}, "'>=' not supported between instances of 'str' and 'int'"),  # a wrong type
    ({"block": 48}, "bad launch parameters block=48"),  # a value the Config refuses
])
def test_a_tuned_entry_that_is_not_a_config_is_refused_naming_the_file(tmp_path, monkeypatch,
                                                                       config, cause):
    table = {"op": "verify", "implementations": {"pallas_triton": [
        {"key": {"capacity": 6}, "config": config}]}}
    path = _table_file(tmp_path, monkeypatch, json.dumps(table))
    with pytest.raises(_registry.TuningTableError) as e:
        _registry.op("verify").config("pallas_triton", {"capacity": 6}, kind=_KIND)
    prefix = (f"kv-canary: tuned table {path} is malformed: its 'pallas_triton' entry for "
              "{'capacity': 6} is not a kvcanary_jax.ops.verify.pallas_triton.Config (")
    msg = str(e.value)
    assert msg.startswith(prefix) and cause in msg[len(prefix):], msg
    assert msg.endswith(") (rerun the tuning script that wrote it, or delete the file)")


def test_update_tuned_table_replaces_the_file_atomically(tmp_path, monkeypatch):
    path = _registry.update_tuned_table("verify", "pallas_triton", _KIND, [_ENTRY],
                                        directory=tmp_path)
    before = open(path).read()

    def interrupted(obj, f, **kw):
        f.write('{"op": "verify", "implementa')  # half a table, then the run dies
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _registry.update_tuned_table("verify", "pallas_triton", _KIND,
                                     [{"key": {"capacity": 7}, "config": {"block": 32}}],
                                     directory=tmp_path)
    assert open(path).read() == before
    assert os.listdir(tmp_path) == [os.path.basename(path)]  # no temporary file left


def _tpu_sharded(tree):
    """``tree``'s arrays as ShapeDtypeStructs sharded over an abstract one-TPU mesh (what a jit
    sees when its arguments live on a TPU topology's devices, e.g. compiling on a CPU host)."""
    from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

    try:
        from jax.sharding import AbstractDevice
    except ImportError:  # jax < 0.11
        from jax._src.mesh import AbstractDevice
    dev = AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    mesh = AbstractMesh((1,), ("x",), (AxisType.Auto,), abstract_device=dev)
    sharding = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def test_registry_follows_tpu_sharded_arguments():
    """On a CPU host, a jit traced with arguments placed on TPU devices takes the Mosaic TPU
    kernels (the platform's default), with no FallbackWarning; the same jit traced with
    unplaced arguments takes xla."""
    import warnings

    from test_lowering import TPU_KERNELS, _ops

    if jax.default_backend() == "tpu":
        pytest.skip("on a TPU the default is pallas_mosaic_tpu anyway")
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error", kc.FallbackWarning)
        for name, fn, args, _ in _ops(None):
            text = str(fn.trace(*_tpu_sharded(args)).jaxpr)
            assert all(k in text for k in TPU_KERNELS[name]), name
            assert _registry.op(name).select(None, args=_tpu_sharded(args)) == "pallas_mosaic_tpu"
            plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            text = str(fn.trace(*plain).jaxpr)
            assert "pallas_call" not in text, name


# --- interpret mode: one field of the launch config ----------------------------------------


@pytest.mark.parametrize("name", OPS)
def test_pallas_interpret_is_pallas_triton_with_interpret_set_however_the_config_resolves(
        name, tmp_path, monkeypatch):
    """The alias: the pallas_triton module, its resolved config with interpret=True, from the
    config= argument, a tuned table's entry (keyed by the name the call asked for) and the
    heuristics alike."""
    op = _registry.op(name)
    assert op.module("pallas_interpret") is op.module("pallas_triton")
    Config = _pallas_config(name)
    shapes = _shapes_keys(name)
    assert Config().interpret is False and op.config("pallas_triton", shapes, kind=_KIND) == \
        op.module("pallas_triton").heuristics(shapes)
    assert op.config("pallas_interpret", shapes, kind=_KIND) == dataclasses.replace(
        op.module("pallas_triton").heuristics(shapes), interpret=True)
    assert op.config("pallas_interpret", shapes, Config()) == Config(interpret=True)
    assert op.config("pallas_interpret", shapes, Config(interpret=True)) == Config(interpret=True)
    # A tuned entry without the field (every table written so far) loads, interpret off, and
    # under pallas_interpret gets it on.
    field = next(f.name for f in dataclasses.fields(Config) if f.type in ("int", int))
    entry = {"key": {}, "config": {field: getattr(Config(), field)}}
    monkeypatch.setattr(_registry, "_tuning_dir", lambda: tmp_path)
    _registry.load_table.cache_clear()
    for impl in ("pallas_triton", "pallas_interpret"):
        _registry.update_tuned_table(name, impl, _KIND, [entry], directory=tmp_path)
    assert op.config("pallas_triton", shapes, kind=_KIND) == Config()
    assert op.config("pallas_interpret", shapes, kind=_KIND) == Config(interpret=True)
    _registry.load_table.cache_clear()


@pytest.mark.parametrize("name", OPS)
def test_a_pallas_triton_config_in_interpret_mode_runs_anywhere(name):
    """pallas_triton with Config(interpret=True) is usable on every platform, as
    pallas_interpret is (no fallback to xla on a CPU); without it, the CPU falls back."""
    op = _registry.op(name)
    interpret = _pallas_config(name)(interpret=True)
    for platform in ("cpu", "tpu", "cuda"):
        assert op.unusable("pallas_triton", platform=platform, config=interpret) is None
        assert op.select("pallas_triton", platform=platform, config=interpret) == "pallas_triton"
    assert op.unusable("pallas_triton", platform="cpu", config=_pallas_config(name)()) is not None


def test_run_passes_interpret_mode_in_the_config(monkeypatch):
    """Op.run hands the backend's run the config alone: pallas_interpret's with interpret=True
    (also one that did not come from Op.config), pallas_triton's as given."""
    op = _registry.op("scatter")
    mod = op.module("pallas_triton")
    seen = []
    monkeypatch.setattr(mod, "run", lambda *a, config, **kw: seen.append((config, kw)))
    op.run("pallas_interpret", None, max_cols=3, config=mod.Config())
    op.run("pallas_triton", None, max_cols=3, config=mod.Config())
    op.run("pallas_triton", None, max_cols=3, config=mod.Config(interpret=True))
    assert seen == [(mod.Config(interpret=True), {"max_cols": 3}),
                    (mod.Config(), {"max_cols": 3}),
                    (mod.Config(interpret=True), {"max_cols": 3})]


@pytest.mark.parametrize("name", OPS)
def test_interpret_is_a_static_bool_field_of_the_triton_configs(name):
    Config = _pallas_config(name)
    assert Config(interpret=True) != Config() and hash(Config(interpret=True)) != hash(Config())
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match=r"\(pallas_triton\): interpret must be a bool"):
            Config(interpret=value)


@pytest.mark.parametrize("impl", ["pallas_triton", "pallas_interpret"])
@pytest.mark.parametrize("value", [True, False])
def test_a_tuned_entry_cannot_switch_interpret_mode_on(tmp_path, monkeypatch, impl, value):
    """A table tunes compiled kernels: an entry that names interpret (on or off) is refused when
    read, naming the file, and update_tuned_table refuses to write one."""
    table = {"op": "verify", "implementations": {impl: [
        {"key": {"capacity": 6}, "config": {"block": 64, "interpret": value}}]}}
    path = _table_file(tmp_path, monkeypatch, json.dumps(table))
    with pytest.raises(_registry.TuningTableError) as e:
        _registry.op("verify").config(impl, {"capacity": 6}, kind=_KIND)
    assert str(e.value).startswith(
        f"kv-canary: tuned table {path} is malformed: its {impl!r} entry for {{'capacity': 6}} "
        "sets 'interpret'"), str(e.value)
    # Writing one is refused before anything is written.
    os.remove(path)
    with pytest.raises(ValueError, match="sets 'interpret'"):
        _registry.update_tuned_table("verify", impl, _KIND, [
            {"key": {"capacity": 6}, "config": {"block": 64, "interpret": value}}],
            directory=tmp_path)
    assert os.listdir(tmp_path) == []
    _registry.load_table.cache_clear()


@pytest.mark.parametrize("owner, kwargs, name, got", [
    ("VerifyOrWriteContext", dict(num_slots=-1), "num_slots", "-1"),
    ("VerifyOrWriteContext", dict(num_slots=4, ring_capacity=2.5), "ring_capacity", "2.5"),
    ("VerifyOrWriteContext", dict(num_slots=4, slot_stride_bytes=-32), "slot_stride_bytes",
     "-32"),
    ("DigestContext", dict(num_slots=True), "num_slots", "True"),
])
def test_contexts_refuse_sizes_that_are_not_counts(owner, kwargs, name, got):
    """A negative or fractional size is refused naming it, not left to JAX's shape error."""
    with pytest.raises(ValueError, match=rf"^kv-canary: {owner}\.allocate {name} must be an int "
                                         rf">= 0, got {got}$"):
        getattr(kc, owner).allocate(**kwargs)
    assert getattr(kc, owner).allocate(num_slots=np.int64(3)).violation_write_index.shape == (1,)
