"""A tiny random-weight Qwen2 through sglang-jax's own ``ModelRunner`` on CPU (0.0.2 or
0.1.0rc0, whichever is installed; native attention, tensor parallel over 2 CPU devices), with the canary installed in the runner
(:class:`kvcanary_jax.integrations.sglang_jax.ModelRunnerHook`): prefill and decode steps with
the model's own sampling, then one cached K byte flipped in the runner's pool (with
``--coverage-window N``: the canary digests every layer, and the flipped byte is the last
layer's V of head 1). Run as a script
(own process: XLA_FLAGS); prints one JSON document that tests/test_sglang_jax.py checks.

Environment it needs, and why:
* ``FLAX_PYTREE_MODULE=false`` (0.0.2 only): flax >= 0.12.10 (the only flax releases that import with jax
  0.12) registers every ``nnx.Module`` as a pytree, and sglang-jax 0.0.2 registers its attention
  backends again (``@register_pytree_node_class``): importing
  ``sgl_jax.srt.layers.attention.native_backend`` then fails with ``ValueError: Duplicate custom
  PyTreeDef type registration for <class '...NativeAttention'>``. flax's own switch restores the
  registration sglang-jax 0.0.2 was written against. flax <= 0.12.9 fails to import with jax 0.12
  (``jax.core.Effect`` / ``jax.experimental.hijax.HiPrimitive`` are gone).
* ``jax.set_mesh(mesh)`` around the runner: flax 0.12.12 creates sharded parameters eagerly and
  needs the mesh in context (sglang-jax 0.0.2's loader enters ``with mesh:``, which jax 0.12 no
  longer treats as one).
* Next tokens are the argmax of the model's logits: sglang-jax 0.0.2's ``Sampler`` cannot be
  traced off TPU with any jax (``_apply_min_p_filter`` unpacks two operands from the three-tuple
  ``top_k_top_p_min_p_sampling_from_probs_jax_not_tpu_runtime`` passes: ``ValueError: too many
  values to unpack (expected 2)``; ``lax.cond`` traces that branch even for greedy batches).
* The weights are sglang-jax's dummy loader's (``load_format="dummy"``); the model config is a
  local ``config.json`` (no download), head_dim 128: 0.1.0rc0 aligns the KV pool's head_dim to
  128 and its native attention pads the queries to it without cutting the output back (a
  smaller head_dim fails in the model's ``o_proj``, canary or not).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if importlib.metadata.version("sglang-jax").startswith("0.0."):
    # 0.0.2 registers its attention backends as pytrees itself (below); 0.1.0rc0 relies on
    # flax's registration. The switch must be set before flax is imported.
    os.environ["FLAX_PYTREE_MODULE"] = "false"

import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import _sglang_jax_compat as compat  # noqa: E402
from sgl_jax.srt.configs.model_config import ModelConfig  # noqa: E402
from sgl_jax.srt.layers.logits_processor import LogitsMetadata  # noqa: E402
from sgl_jax.srt.managers.schedule_batch import Req  # noqa: E402
from sgl_jax.srt.model_executor.forward_batch_info import ForwardBatch  # noqa: E402
from sgl_jax.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sgl_jax.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sgl_jax.srt.server_args import ServerArgs  # noqa: E402

from kvcanary_jax.integrations import sglang_jax as ksj  # noqa: E402

warnings.filterwarnings("ignore", message=".*donated buffers.*")

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}
MAX_BS, TOKENS, CACHE_LOC = 4, 32, 64


class GreedySampler(nnx.Module):
    """A stand-in for 0.1.0rc0's ``Sampler`` in its fused step: the argmax of the model's
    logits, with the real one's call and result shape."""

    def __call__(self, logits_output, sampling_metadata, use_sort_for_toppk_minp=False,
                 rng_override=None):
        ids = jnp.argmax(logits_output.next_token_logits, axis=-1).astype(jnp.int32)
        return ids, None, logits_output


def make_runner(model_dir, mesh, greedy_sampler: bool = False):
    args = ServerArgs(model_path=model_dir, device="cpu", load_format="dummy",
                      attention_backend="native", page_size=1, max_running_requests=MAX_BS,
                      max_total_tokens=64, tp_size=2, skip_server_warmup=True)
    ranks = {"dp_size": 1} if compat.V01 else {}
    with jax.set_mesh(mesh):
        runner = ModelRunner(model_config=ModelConfig(model_path=model_dir, dtype="bfloat16"),
                             mem_fraction_static=0.5, tp_size=2, server_args=args, mesh=mesh,
                             rngs=nnx.Rngs(0), **ranks)
    compat.prepare_req_pool(runner.req_to_token_pool, CACHE_LOC)
    if greedy_sampler:  # the runner's steps built again around it
        runner.sampler = GreedySampler()
        runner.initialize_jit()
    if compat.V01:
        # 0.1.0rc0's dummy loader writes zeros (zero KV, zero logits); the step reads the
        # weights from model_state_leaves at every call, so random ones (the same for every
        # runner of the process) make the tokens and KV worth comparing.
        rng = np.random.default_rng(0)
        runner.model_state_leaves = [
            jax.device_put((rng.standard_normal(x.shape) * 0.5).astype(x.dtype), x.sharding)
            if jnp.issubdtype(x.dtype, jnp.floating) else x for x in runner.model_state_leaves]
    return runner


def make_mesh(auto_data: bool = False):
    return compat.runner_mesh(jax.devices()[:2], auto_data=auto_data)


class Life:
    """Two requests, prefill then decode, through one runner (hooked or not)."""

    def __init__(self, runner, mesh, hook=None):
        self.runner, self.mesh, self.hook = runner, mesh, hook
        self.steps = []
        reqs = []
        for rid, prompt in enumerate([[5, 17, 29, 41, 53, 65, 77], [9, 18, 27, 36, 45]]):
            params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
            params.normalize(None)
            req = Req(rid=str(rid), origin_input_text="", origin_input_ids=prompt,
                      sampling_params=params)
            req.fill_ids = list(prompt)
            req.extend_input_len = len(prompt)
            reqs.append(req)
        self.reqs = reqs
        self.batch = compat.schedule_batch(
            [reqs], req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator,
            tree_cache=compat.no_prefix_cache(runner.req_to_token_pool,
                                              runner.token_to_kv_pool_allocator, 1),
            model_config=runner.model_config, enable_overlap=False, mesh=mesh)
        self.batch.prepare_for_extend()

    def forward(self, fused: bool = False, placeholders: bool = False):
        """One step through ``model_runner.forward`` or, with ``fused``, 0.1.0rc0's fused decode
        step ``forward_and_sample`` (the model, the sampler and the future token map in one jit),
        whose input ids are, with ``placeholders``, the overlap scheduler's future placeholders
        (``-(req_pool_idx + 1)``) resolved from the future token map on the device."""
        runner, batch, hook = self.runner, self.batch, self.hook
        mwb = batch.get_model_worker_batch([TOKENS], [MAX_BS], [CACHE_LOC], 1)
        runner.attn_backend.forward_metadata = runner.attn_backend.get_forward_metadata(mwb)
        fb = ForwardBatch.init_new(mwb, runner)
        before = None
        if hook is not None:
            hook.expect(hook.feed.delta(batch.reqs, mwb))  # the ids the device lacks
            before = ksj.violation_counts(hook.state)
        metadata = LogitsMetadata.from_model_worker_batch(mwb, self.mesh)
        if fused:
            next_ids = self._fused(mwb, fb, metadata, placeholders)
        else:
            with jax.set_mesh(self.mesh):
                logits, *_ = runner.forward(fb, logits_metadata=metadata)
            # Greedy choice from the model's logits (sglang-jax 0.0.2's sampler does not trace
            # off TPU, see the module docstring).
            next_ids = np.asarray(jnp.argmax(logits.next_token_logits, axis=-1))
        next_ids = next_ids[: mwb.real_bs].astype(np.int32)
        for req, tok in zip(batch.reqs, next_ids.tolist()):
            req.output_ids.append(int(tok))
        batch.output_ids = next_ids
        found = []
        if hook is not None:
            found = [{"shard": v.shard, "tag": v.violation.tag, "slot": v.violation.slot,
                      "position": v.violation.position, "reasons": list(v.violation.reasons)}
                     for v in ksj.read_violations(hook.state, start=before)]
        self.steps.append({"mode": mwb.forward_mode.name, "seq_lens": mwb.seq_lens.tolist(),
                           "next_ids": next_ids.tolist(), "violations": found})

    def _fused(self, mwb, fb, metadata, placeholders):
        from sgl_jax.srt.sampling.sampling_batch_info import SamplingMetadata

        sampling = SamplingMetadata.from_model_worker_batch(mwb, 0, self.mesh,
                                                            CONFIG["vocab_size"])
        future = np.zeros((MAX_BS * 5,), np.int32)
        ids = np.asarray(mwb.input_ids).copy()
        if placeholders:
            for i in range(mwb.real_bs):
                future[mwb.req_pool_indices[i] + 1] = ids[i]
                ids[i] = -(mwb.req_pool_indices[i] + 1)
        fb.input_ids = jax.device_put(ids, fb.input_ids.sharding)
        future = jax.device_put(future, jax.sharding.NamedSharding(
            self.mesh, jax.sharding.PartitionSpec(None)))
        with jax.set_mesh(self.mesh):
            next_ids, *_ = self.runner.forward_and_sample(fb, metadata, sampling, future)
        return np.asarray(next_ids)

    def decode(self, fused: bool = False, placeholders: bool = False):
        self.batch.prepare_for_decode()
        self.forward(fused, placeholders)

    def kv_digest(self):
        return [hashlib.sha256(np.asarray(jax.device_get(b)).view(np.uint16).tobytes())
                .hexdigest() for b in self.runner.token_to_kv_pool.kv_buffer]


def flip_k_byte(buf, slot, word: int = 3):
    """``buf`` with one bit of element ``word`` of ``slot``'s fused row flipped (3: head 0's K;
    the row is ``K0 V0 K1 V1``, head_dim elements each), made on the host and put back with the
    buffer's sharding (0.1.0rc0's Explicit mesh refuses eager updates of a sharded buffer)."""
    words = np.asarray(jax.device_get(buf)).view(np.uint16).copy()
    rows = words.reshape(words.shape[0] * (words.shape[1] if words.ndim == 5 else 1), -1)
    rows[slot, word] ^= np.uint16(0x0100)
    return jax.device_put(words.view(buf.dtype), buf.sharding)


def _flip_place(pool, window: int) -> tuple[int, int]:
    """(layer, row element) of the flipped byte: head 0's K of the canary layer, or with a
    coverage window the last layer's V of head 1."""
    if not window:
        return 0, 3
    return len(pool.kv_buffer) - 1, 3 * CONFIG["hidden_size"] // CONFIG["num_attention_heads"] + 3


def _reshard_on_explicit_meshes() -> None:
    """``jax.lax.with_sharding_constraint`` as ``jax.sharding.reshard`` for a NamedSharding over
    Explicit axes (this process only: the fused-step script)."""
    constrain = jax.lax.with_sharding_constraint

    def constrain_or_reshard(x, shardings):
        mesh_ = getattr(shardings, "mesh", None)
        types_ = getattr(mesh_, "axis_types", ())
        if types_ and all(t == jax.sharding.AxisType.Explicit for t in types_):
            return jax.sharding.reshard(x, shardings)
        return constrain(x, shardings)

    jax.lax.with_sharding_constraint = constrain_or_reshard


def fused_main(window: int = 0):
    """0.1.0rc0's fused decode step (``forward_and_sample``) with the hook installed: the same
    tokens and KV as sglang-jax alone, future placeholders resolved, and a flipped K byte found
    in a fused step.

    sglang-jax 0.1.0rc0's fused step does not trace on its own Explicit mesh, canary or not:
    ``jitted_run_and_sample`` places the ids with ``jax.lax.with_sharding_constraint``, which
    Explicit axes refuse ("can only refer to Auto axes. You probably meant to use `reshard`"; jax
    0.10.2 and 0.12 alike; its models need Explicit axes). This process routes
    ``with_sharding_constraint`` on Explicit shardings to ``jax.sharding.reshard``, what the step
    means (:func:`_reshard_on_explicit_meshes`). Its sampler does not trace in the mesh its model
    needs (``binary_search``'s select over ``P(None)`` and ``P("data")``): the runner's steps are
    built around :class:`GreedySampler` instead; the model, the pools and the future token map
    are sglang-jax's. ``window``: as :func:`main`'s."""
    _reshard_on_explicit_meshes()
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    mesh = make_mesh()

    def life(hook_it):
        runner = make_runner(model_dir, mesh, greedy_sampler=True)
        hook = None
        if hook_it:
            canary = ksj.SglangJaxCanary.from_pools(runner.req_to_token_pool,
                                                    runner.token_to_kv_pool, max_bs=MAX_BS,
                                                    incremental_tokens=True,
                                                    coverage_window=window)
            hook = ksj.ModelRunnerHook(canary, runner)
        one = Life(runner, mesh, hook)
        one.forward()
        one.decode()
        one.decode(fused=True)
        one.decode(fused=True, placeholders=True)
        return one, hook

    plain, _ = life(False)
    guarded, hook = life(True)
    report = {"plain_steps": plain.steps, "plain_kv": plain.kv_digest(),
              "guarded_kv": guarded.kv_digest(), "version": hook.version,
              "fused_guarded": hook.feed is not None and "jitted_run_and_sample" in hook._unguarded}
    pool = guarded.runner.token_to_kv_pool
    slot = int(guarded.runner.req_to_token_pool.req_to_token[guarded.reqs[1].req_pool_idx, 3])
    layer, word = _flip_place(pool, window)
    pool.kv_buffer[layer] = flip_k_byte(pool.kv_buffer[layer], slot, word)
    report["flip"] = {"slot": slot, "position": 3, "layer": layer}
    guarded.decode(fused=True, placeholders=True)
    report["guarded_steps"] = guarded.steps
    hook.uninstall()
    report["uninstalled"] = guarded.runner.jitted_run_and_sample is hook._unguarded[
        "jitted_run_and_sample"]
    json.dump(report, sys.stdout)


def main(window: int = 0):
    """``window``: the canary's coverage window (every layer digested); the flip then goes to the
    last layer's V strip of head 1 (bytes SGLang's fingerprint of layer 0's K never reads)."""
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    mesh = make_mesh()

    # sglang-jax alone: the reference tokens and KV bytes.
    plain = Life(make_runner(model_dir, mesh), mesh)
    plain.forward()
    for _ in range(3):
        plain.decode()

    runner = make_runner(model_dir, mesh)
    pool = runner.token_to_kv_pool
    canary = ksj.SglangJaxCanary.from_pools(runner.req_to_token_pool, pool, max_bs=MAX_BS,
                                            incremental_tokens=True, coverage_window=window)
    hook = ksj.ModelRunnerHook(canary, runner)
    guarded = Life(runner, mesh, hook)
    guarded.forward()
    for _ in range(3):
        guarded.decode()
    report = {"version": hook.version, "kv_shape": list(pool.kv_buffer[0].shape),
              "kv_spec": str(pool.kv_buffer[0].sharding.spec), "num_shards": canary.num_shards,
              "plain_steps": plain.steps, "plain_kv": plain.kv_digest(),
              "guarded_kv": guarded.kv_digest()}

    # Flip one K byte of the canary layer at request 0's position 2; the next step's TAIL verify
    # of its prefix finds it, on the shard that holds head 0. With a window: a byte of the last
    # layer's V of head 1, found by the digest check of the shard holding head 1.
    slot = int(runner.req_to_token_pool.req_to_token[guarded.reqs[0].req_pool_idx, 2])
    layer, word = _flip_place(pool, window)
    pool.kv_buffer[layer] = flip_k_byte(pool.kv_buffer[layer], slot, word)
    report["flip"] = {"slot": slot, "position": 2, "layer": layer}
    report["num_layers"] = canary.num_layers
    guarded.decode()
    report["guarded_steps"] = guarded.steps
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    args = sys.argv[1:]
    window = int(args[args.index("--coverage-window") + 1]) if "--coverage-window" in args else 0
    fused_main(window) if "--fused" in args else main(window)
