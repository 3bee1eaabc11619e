"""Every op and the whole canary step lower for the platforms an implementation targets, on any
machine (``jax.jit(f).trace(*args).lower(lowering_platforms=...)``): every primitive has a
lowering rule there, so no construct of another backend reaches that platform's program. (A run
on the platform is still needed to compile and execute it.)"""

from __future__ import annotations

import pytest

import jax
import jax.extend.core  # noqa: F401 - Literal, in the literal-select check
import jax.numpy as jnp

import kvcanary_jax as kc
from kvcanary_jax import runtime as rt
from kvcanary_jax.ops import _registry
from kvcanary_jax.sim import make_forward

from _impls import lower

# (platform, implementation): the Triton kernels for CUDA and the Mosaic kernels for TPU; the plain
# XLA implementation for TPU and for CUDA (the fallback when a kernel backend is unavailable).
LOWERINGS = [("cuda", "pallas_triton"), ("tpu", "pallas_mosaic_tpu"), ("tpu", "xla"),
             ("cuda", "xla")]
# The Mosaic TPU lowering asks the TPU generation it targets; off a TPU it is given one.
TPU_KINDS = ("TPU v5 lite", "TPU v6 lite")
# The Mosaic kernels of each op (pallas_mosaic_tpu); fingerprints run with real-KV sources.
TPU_KERNELS = {"scatter": ("kvcanary_scatter_tpu",),
               "plan": ("kvcanary_plan_offsets_tpu", "kvcanary_plan_entries_tpu"),
               "write": ("kvcanary_fingerprints_tpu", "kvcanary_write_tpu"),
               "verify": ("kvcanary_fingerprints_tpu", "kvcanary_verify_tpu")}


def _check_program(text, impl, name):
    if impl == "pallas_triton":
        assert "__gpu$xla.gpu.triton" in text, name
    if impl == "pallas_mosaic_tpu":
        assert "tpu_custom_call" in text, name
        kernels = sorted(set(sum(TPU_KERNELS.values(), ()))) if name == "step" else TPU_KERNELS[name]
        assert all(k in text for k in kernels), name
    if impl == "xla":  # plain HLO: no kernel of any backend, no custom call at all
        assert "custom_call" not in text, name


def _context(num_slots=64, sources=0):
    ctx = kc.VerifyOrWriteContext.allocate(num_slots=num_slots, ring_capacity=16)
    if not sources:
        return ctx
    kv = jnp.zeros((num_slots, 64), jnp.uint8)
    return ctx.replace(
        real_kv_sources=(kc.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=64,
                                         read_bytes=64),),
        real_kv_hash_mode=kc.RealKvHashMode.ALL)


def _i64(*shape):
    return jnp.zeros(shape, jnp.int64)


def _ops(impl):
    """(name, jitted function, its arguments, the Pallas kernels its program holds)."""
    scatter = jax.jit(lambda f, o, r, p: kc.scatter_req_token_ids(
        flat_in=f, offsets=o, req_pool_indices=r, pool_out=p, implementation=impl),
        donate_argnums=3)

    def plan_fn(vp, wp, rpi, prefix, extend, rtt, lut, pool, vl):
        return kc.canary_plan(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=rpi, prefix_lens=prefix,
            extend_seq_lens=extend, req_to_token=rtt, swa_window_size=4,
            full_to_swa_index_mapping=lut, verify_capacity=32, req_to_verify_expected_tokens=pool,
            req_to_verify_expected_tokens_valid_lens=vl, kv_token_id_vs_position_offset=1,
            implementation=impl)

    def write_fn(ctx, wp, ids, pos, loc, etok, epos):
        return kc.canary_write(context=ctx, plan=wp, input_ids=ids, positions=pos,
                               out_cache_loc=loc, enable_write_input_assert=True,
                               expected_input_tokens=etok, expected_input_positions=epos,
                               implementation=impl)

    def verify_fn(ctx, vp):
        return kc.canary_verify(context=ctx, plan=vp, check_verify_expected_token=True,
                                implementation=impl)

    vp = kc.VerifyPlan.allocate(verify_capacity=32)
    wp = kc.WritePlan.allocate(write_req_capacity=4)
    return [
        ("scatter", scatter, (_i64(40), _i64(4), _i64(3), jnp.zeros((5, 16), jnp.int32)),
         ("kvcanary_scatter_req_token_ids",)),
        ("plan", jax.jit(plan_fn, donate_argnums=(0, 1)),
         (vp, wp, _i64(3), _i64(3), _i64(3), jnp.zeros((5, 16), jnp.int32), _i64(64),
          jnp.zeros((5, 16), jnp.int32), _i64(3)), ("kvcanary_plan_offsets",
                                                     "kvcanary_plan_entries")),
        ("write", jax.jit(write_fn, donate_argnums=0),
         (_context(sources=1), wp, _i64(20), _i64(20), _i64(20), _i64(20), _i64(20)),
         ("kvcanary_write",)),
        ("verify", jax.jit(verify_fn, donate_argnums=0), (_context(sources=1), vp),
         ("kvcanary_verify",)),
    ]


@pytest.mark.parametrize("platform,impl", LOWERINGS)
def test_every_op_lowers(platform, impl):
    with jax.enable_x64(True):
        for name, fn, args, kernels in _ops(impl):
            assert _registry.op(name).unusable(impl, platform=platform) is None, (name, impl)
            text = lower(fn, args, platform).as_text()
            _check_program(text, impl, name)
            if impl == "pallas_triton":
                assert all(k in text for k in kernels), name


def _step_program(impl, platform, device_kind=TPU_KINDS[-1], enable_v_half=True):
    """The lowered text of the whole step for ``platform``."""
    cfg = rt.CanaryConfig(max_reqs=4, context_len=16, num_slots=32, max_bs=2, max_tokens=8,
                          swa_window_size=4, swa_num_slots=32, enable_v_half=enable_v_half,
                          implementation=impl)
    step = rt.make_canary_step(cfg, make_forward(cfg, 16))
    state = rt.init_state(cfg)
    batch = rt.make_batch(cfg, req_pool_indices=[1], prefix_lens=[0], extend_seq_lens=[2],
                          all_ids=[[5, 6]], input_ids=[5, 6], positions=[0, 1],
                          out_cache_loc=[1, 2])
    with jax.enable_x64(True):
        kv = {g: {h: (jnp.zeros((cfg.group_slots(g), 16), jnp.bfloat16),) for h in cfg.halves}
              for g in cfg.groups}
        rtt, lut = jnp.zeros((4, 16), jnp.int32), jnp.arange(32, dtype=jnp.int64)
        return lower(step.jitted, (state, kv, batch, rtt, lut), platform, device_kind).as_text()


@pytest.mark.parametrize("platform,impl", LOWERINGS)
def test_canary_step_lowers(platform, impl):
    """The whole step (scatter, plan, HEAD and TAIL verify + write, FULL and SWA groups, both
    halves) around a forward that writes the KV."""
    assert all(_registry.op(o).unusable(impl, platform=platform) is None
               for o in ("scatter", "plan", "write", "verify"))
    text = _step_program(impl, platform)
    _check_program(text, impl, "step")
    if impl == "pallas_triton":
        for kernel in ("kvcanary_scatter_req_token_ids", "kvcanary_plan_offsets",
                       "kvcanary_plan_entries", "kvcanary_verify", "kvcanary_write"):
            assert kernel in text, kernel


@pytest.mark.parametrize("device_kind", TPU_KINDS)
def test_canary_step_lowers_for_each_tpu_generation(device_kind):
    """The TPU kernels lower for v5e and v6e alike (the Mosaic lowering reads the generation)."""
    text = _step_program("pallas_mosaic_tpu", "tpu", device_kind, enable_v_half=False)
    _check_program(text, "pallas_mosaic_tpu", "step")


# The KV digest (ours): its kernels by implementation.
DIGEST_KERNELS = {"pallas_triton": ("kvcanary_digest_write", "kvcanary_digest_verify"),
                  "pallas_mosaic_tpu": ("kvcanary_digest_tpu",)}


def _digest_sources():
    """A fused bf16 layer's K and V strips of two heads (strided views of one buffer), a paged
    uint8 source read in part and a float32 one: every addressing the kernels take."""
    from kvcanary_jax.contracts import TensorMeta

    fused = jnp.zeros((64, 4, 64), jnp.bfloat16)
    view = TensorMeta(shape=(64, 64), dtype="bfloat16", strides=(256, 1), device=None,
                      framework="jax")
    heads = tuple(kc.RealKvSource(tensor=fused, page_size=1, num_bytes_per_token=128,
                                  read_bytes=128, view=view, offset_bytes=128 * k)
                  for k in range(4))
    return heads + (
        kc.RealKvSource(tensor=jnp.zeros((16, 4 * 96), jnp.uint8), page_size=4,
                        num_bytes_per_token=96, read_bytes=64),
        kc.RealKvSource(tensor=jnp.zeros((64, 32), jnp.float32), page_size=1,
                        num_bytes_per_token=128, read_bytes=128))


def _digest_ops(impl, config=None):
    """(name, jitted function, its arguments) of digest_write and digest_verify (window 4)."""
    sources = _digest_sources()
    write = jax.jit(lambda b, s, src: kc.digest_write(b, s, src, implementation=impl,
                                                      config=config), donate_argnums=0)

    def verify_fn(ctx, s, pos, nv, phase, src):
        return kc.digest_verify(ctx, s, pos, nv, phase, window=4, sources=src,
                                implementation=impl, config=config)

    ctx = kc.DigestContext.allocate(num_slots=64, ring_capacity=16)
    i32 = jnp.zeros((1,), jnp.int32)
    return [("digest_write", write, (_i64(64), _i64(20), sources)),
            ("digest_verify", jax.jit(verify_fn, donate_argnums=0),
             (ctx, _i64(48), _i64(48), i32, i32, sources))]


@pytest.mark.parametrize("platform,impl", LOWERINGS)
def test_digest_lowers(platform, impl):
    """digest_write and digest_verify lower for each implementation's platform: the Triton
    kernels for CUDA (in place: the digests and the ring aliased), the Mosaic kernel for TPU,
    plain HLO for xla."""
    assert _registry.op("digest").unusable(impl, platform=platform) is None
    with jax.enable_x64(True):
        for name, fn, args in _digest_ops(impl):
            text = lower(fn, args, platform).as_text()
            if impl == "pallas_triton":
                assert "__gpu$xla.gpu.triton" in text and "output_operand_alias" in text, name
                assert DIGEST_KERNELS[impl][name == "digest_verify"] in text, name
            elif impl == "pallas_mosaic_tpu":
                assert "tpu_custom_call" in text and DIGEST_KERNELS[impl][0] in text, name
            else:
                assert "custom_call" not in text, name


# The digest's Triton kernels by launch shape: groups spread over programs (partials, then a
# finishing kernel), and one program looping over a slot's groups.
DIGEST_SHAPES = {
    "spread": (dict(group_words=8, spread=True),
               {"digest_write": ("kvcanary_digest_write_partials", "kvcanary_digest_write_finish"),
                "digest_verify": ("kvcanary_digest_verify_partials",
                                  "kvcanary_digest_verify_finish")}),
    "looped": (dict(group_words=8, spread=False, entries=8, block=2),
               {"digest_write": ("kvcanary_digest_write",),
                "digest_verify": ("kvcanary_digest_verify",)}),
}


@pytest.mark.parametrize("shape", sorted(DIGEST_SHAPES))
def test_digest_launch_shapes_lower_for_cuda(shape):
    """Each launch shape of the digest's Triton kernels lowers for CUDA, the digests, ring and
    counters in place (aliased), with the kernels the shape launches."""
    from kvcanary_jax.ops.digest.pallas_triton import Config

    fields, kernels = DIGEST_SHAPES[shape]
    with jax.enable_x64(True):
        for name, fn, args in _digest_ops("pallas_triton", Config(**fields)):
            text = lower(fn, args, "cuda").as_text()
            assert "output_operand_alias" in text, name
            assert text.count("__gpu$xla.gpu.triton") == len(kernels[name]), name
            for kernel in kernels[name]:
                assert kernel in text, (name, kernel)


# --- a miscompile of Pallas's Triton lowering: a scalar select between two literals ----------
#
# In jax 0.10-0.11 Pallas's Triton lowering gives a ``select_n`` case that reaches it as a
# weak-typed literal the predicate's type: ``jnp.where(pid > 0, 16, 0)`` becomes an i1 select
# (0 or 1), silently, while interpret mode evaluates it right (bench/NOTES.md, "the plan's
# offsets program spills"). ``jnp.where`` hands its cases over as they are only where all are
# scalars of one weak type: a vector predicate broadcasts them first, and a traced case gives
# the literal its type. Literals 0 and 1 alone survive the i1 round trip.


def _literal_selects(jaxpr, env=None, in_kernel=False):
    """``(literal values, where)`` of every ``select_n`` inside a ``pallas_call``'s kernel in
    ``jaxpr`` with a case that is a weak-typed literal (directly, or as the argument a ``jit``
    such as ``jnp.where``'s was called with). Outside the kernels XLA lowers them."""
    env = env or {}
    found = []

    def literal(v):
        if isinstance(v, jax.extend.core.Literal):
            return True, v.val
        return (v in env), env.get(v)

    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "select_n" and in_kernel:
            weak = [int(val) for c in eqn.invars[1:] for ok, val in [literal(c)]
                    if ok and getattr(c.aval, "weak_type", False)]
            if weak:
                found.append((weak, str(eqn)))
        for name, sub in eqn.params.items():
            subs = sub if isinstance(sub, (tuple, list)) else (sub,)
            for s in subs:
                inner = getattr(s, "jaxpr", s)
                if not hasattr(inner, "eqns"):
                    continue
                inner_env = {}
                if name == "jaxpr" and eqn.primitive.name in ("pjit", "jit", "closed_call"):
                    for iv, ov in zip(inner.invars, eqn.invars):
                        ok, val = literal(ov)
                        if ok:
                            inner_env[iv] = val
                found += _literal_selects(inner, inner_env,
                                          in_kernel or eqn.primitive.name == "pallas_call")
    return found


def _triton_kernel_calls():
    """(name, jitted function, arguments) of every op through its Triton kernels, with the
    plan's multi-block offsets and the verify's large-plan and fold shapes besides the
    heuristics' choices for these sizes."""
    from kvcanary_jax.ops.plan.pallas_triton import Config as PlanConfig
    from kvcanary_jax.ops.verify.pallas_triton import FOLD_PLANS, Config as VerifyConfig

    calls = [(name, fn, args) for name, fn, args, _ in _ops("pallas_triton")]
    plan_args = dict((name, args) for name, _, args in calls)["plan"]
    calls += [(name, fn, args) for name, fn, args in _digest_ops("pallas_triton")]
    # Blocks of 1 request: a count of blocks (the batch size) that need not be a power of two,
    # which jax 0.12 refused while the block sums were shorter than the offsets kernel's load.
    multi = PlanConfig(single_block_max=1, multi_block=1, block_entries=2, max_programs=1)
    calls.append(("plan (multi-block)", jax.jit(lambda *a: kc.canary_plan(
        verify_plan_out=a[0], write_plan_out=a[1], req_pool_indices=a[2], prefix_lens=a[3],
        extend_seq_lens=a[4], req_to_token=a[5], swa_window_size=4,
        full_to_swa_index_mapping=a[6], verify_capacity=32, req_to_verify_expected_tokens=a[7],
        req_to_verify_expected_tokens_valid_lens=a[8], kv_token_id_vs_position_offset=1,
        implementation="pallas_triton", config=multi)), plan_args))
    vp = kc.VerifyPlan.allocate(verify_capacity=32)
    for label, config in (("large", VerifyConfig(block=8, max_programs=2)),
                          ("fold", VerifyConfig(**FOLD_PLANS[0][1]))):
        calls.append((f"verify ({label})", jax.jit(
            lambda ctx, p, c=config: kc.canary_verify(
                context=ctx, plan=p, check_verify_expected_token=True,
                implementation="pallas_triton", config=c)), (_context(sources=1), vp)))
    return calls


def test_no_triton_kernel_selects_a_weak_typed_literal():
    """No Triton kernel selects a weak-typed literal other than 0 or 1, which Pallas's Triton
    lowering would compile as a boolean (see above)."""
    with jax.enable_x64(True), _registry.lowering_for("cuda"):
        for name, fn, args in _triton_kernel_calls():
            jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
            assert "pallas_call" in str(jaxpr), name
            bad = [(vals, where) for vals, where in _literal_selects(jaxpr)
                   if not set(vals) <= {0, 1}]
            assert not bad, (name, bad)


def test_the_literal_select_check_finds_the_miscompiled_form():
    """The check above sees ``jnp.where(pid > 0, 16, 0)`` (and ``(pid > 1, 0, 1)``) in a
    kernel, and none of the forms that lower right."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        pid = pl.program_id(0)
        o_ref[0] = jnp.where(pid > 0, 16, 0).astype(jnp.int64)  # the miscompiled form
        o_ref[1] = jnp.where(pid > 3, 7, x_ref[0])  # one case traced: lowers right
        o_ref[2] = jnp.where(jnp.arange(2) > pid, 5, 9)[0].astype(jnp.int64)  # a vector
        o_ref[3] = jnp.where(pid > 1, 0, 1).astype(jnp.int64)  # 0 and 1 survive

    def f(x):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((4,), jnp.int64),
                              grid=(2,), interpret=True)(x)

    with jax.enable_x64(True):
        found = _literal_selects(jax.make_jaxpr(f)(jnp.zeros((1,), jnp.int64)).jaxpr)
    assert sorted(vals for vals, _ in found) == [[0, 16], [1, 0]]
