"""A real tpu-inference 0.32 ``TPUModelRunner`` on the CPU, driven by vLLM's own scheduler.

Imported by the scripts the tests run in processes of their own (tpu-inference prepends to
``XLA_FLAGS`` and sets TPU and vLLM variables at import: the pytest process must never import
it). What a TPU-less machine needs, and why:

* the TPU identity variables (``TPU_ACCELERATOR_TYPE``, ``TPU_NAME``, ``TPU_WORKER_ID``) so that
  ``import tpu_inference`` does not ask the GCE metadata server, ``HF_HUB_OFFLINE=1``,
  ``JAX_PLATFORMS=cpu`` and ``SKIP_JAX_PRECOMPILE=1`` (no warm-up of every bucket);
* vLLM picks its platform by ``import libtpu``: the TPU platform is set directly (and on a GPU
  host, where a subprocess would detect CUDA, vLLM's model registry inspects in-process);
* the TPU compiler options (``xla_tpu_*``) that the step, the sampler and the decode loop's jits
  carry are refused by XLA:CPU: the two functions that give them return none (before the
  sampler's module is imported, which reads them at import);
* ``make_optimized_mesh`` sorts devices by ``device.coords`` (TPU only): a plain mesh;
* ``hbm_usage_gb`` / ``hbm_usage_bytes`` ask TPU memory stats: constants;
* the Pallas ragged paged attention kernel (RPA v3, and its head_dim 64 twin) only compiles for
  a TPU, and in TPU interpret mode it wrote no KV: a jnp stand-in of the same KV layout
  (``merge_kv`` of the kernel's own module) and slot rule (request ``i``'s new tokens at
  positions ``[kv_len - q_len, kv_len)``, slot ``block_tables[i, pos // block_size] *
  block_size + pos % block_size``), attending causally over each request's slots;
* ``set_current_vllm_config`` around everything, as vLLM's worker does.

The model is a tiny Qwen3 (a local ``config.json``, dummy weights, no download). With
``dp_size`` 2 (two CPU devices: the caller's ``XLA_FLAGS``) the runner splits its blocks and
batch over a ``data`` mesh axis and the scheduler is tpu-inference's ``DPScheduler`` (a vLLM
scheduler per rank, each forked into a process of its own, each with half the blocks). The runner is
driven as vLLM's engine core drives it: ``scheduler.schedule()``, ``runner.execute_model``,
``runner.sample_tokens``, ``scheduler.update_from_output``, so prefix-cache hits, preemption and
finishing are vLLM's own.
"""

from __future__ import annotations

import json
import os
import tempfile

TPU_ENV = {
    "TPU_ACCELERATOR_TYPE": "v6e-1", "TPU_NAME": "ci", "TPU_WORKER_ID": "0",
    "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu", "SKIP_JAX_PRECOMPILE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
for _k, _v in TPU_ENV.items():
    os.environ.setdefault(_k, _v)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

BLOCK_SIZE = 16


def qwen3_config(head_dim: int, eos: int = 2) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 512,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": head_dim,
        "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": eos, "attention_bias": False,
    }


def _jnp_rpa(mesh, q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
             attention_sink, sm_scale, attention_chunk_size=None, q_scale=None, k_scale=None,
             v_scale=None, update_kv_cache=True, use_causal_mask=True,
             attn_logits_soft_cap=None, decode_query_size=1):
    """The stand-in for ``sharded_ragged_paged_attention`` (one device, bf16, no window)."""
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel, kernel_hd64

    n_tok, nq, hd = q.shape
    nkv = k.shape[1]
    pages, page_size = kv_cache.shape[:2]
    max_seqs = kv_lens.shape[0]
    pps = page_indices.shape[0] // max_seqs
    tok = jnp.arange(n_tok)
    req = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, max_seqs - 1)
    valid = tok < cu_q_lens[distribution[2]]
    pos = kv_lens[req] - (cu_q_lens[req + 1] - cu_q_lens[req]) + (tok - cu_q_lens[req])
    page = page_indices[req * pps + pos // page_size]
    slot = jnp.where(valid, page * page_size + pos % page_size, pages * page_size)
    hd64 = hd == 64
    merged = (kernel_hd64 if hd64 else kernel).merge_kv(k, v)
    flat = kv_cache.reshape(pages * page_size, *kv_cache.shape[2:])
    flat = flat.at[slot].set(merged.astype(flat.dtype), mode="drop")
    ctx = jnp.arange(pps * page_size)
    ctx_slot = (page_indices.reshape(max_seqs, pps)[req][:, ctx // page_size] * page_size
                + ctx % page_size)
    rows = flat[ctx_slot]
    if hd64:  # [T, C, heads, 128]: K in lanes 0..63, V in 64..127
        rows = rows.reshape(n_tok, ctx.shape[0], -1, 128)[:, :, :nkv]
        keys, vals = rows[..., :64], rows[..., 64:]
    else:  # [T, C, 2H, hdp]: K_h at 2h, V_h at 2h + 1
        rows = rows.reshape(n_tok, ctx.shape[0], -1, rows.shape[-1])
        keys, vals = rows[:, :, 0:2 * nkv:2, :hd], rows[:, :, 1:2 * nkv:2, :hd]
    keys = jnp.repeat(keys, nq // nkv, axis=2).astype(jnp.float32)
    vals = jnp.repeat(vals, nq // nkv, axis=2).astype(jnp.float32)
    s = jnp.einsum("thd,tchd->thc", q.astype(jnp.float32), keys) * sm_scale
    s = jnp.where((ctx[None, :] <= pos[:, None])[:, None, :], s, -1e30)
    out = jnp.einsum("thc,tchd->thd", jax.nn.softmax(s, -1), vals)
    return out.astype(q.dtype), flat.reshape(kv_cache.shape)


TPU_STEP_OPTIONS = {}  # the model step's TPU compiler options, kept by patch_for_cpu
_ENTERED = []  # the vLLM config contexts vllm_config entered (never exited: one per process)


def patch_for_cpu(stand_in_attention: bool = True) -> None:
    """The CPU patches of the module docstring (process-wide: this process is the test's).
    ``stand_in_attention=False`` keeps the Pallas kernel (to compile the step for a TPU
    topology: ``bench/tpu_inference_step.py``); :data:`TPU_STEP_OPTIONS` keeps the step's TPU
    compiler options."""
    from tpu_inference.models.common import compiler_options

    TPU_STEP_OPTIONS.update(compiler_options.get_step_fn_compiler_options())
    compiler_options.get_step_fn_compiler_options = lambda: {}
    compiler_options.get_sampling_compiler_options = lambda: {}
    import vllm.platforms
    from tpu_inference.platforms.tpu_platform import TpuPlatform

    vllm.platforms._current_platform = TpuPlatform()
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        # On a GPU host (the benchmark), vLLM's model registry inspects a model class in a
        # subprocess, where the platform is detected afresh: CUDA, whose extension the TPU
        # build lacks. Inspect in this process, whose platform is set above.
        from vllm.model_executor.models import registry

        registry._run_in_subprocess = lambda fn: fn()
    from tpu_inference import utils
    from tpu_inference.layers.common import attention_interface
    from tpu_inference.runner import decode_loop, tpu_runner

    for mod in (decode_loop, ):
        mod.get_step_fn_compiler_options = lambda: {}
        mod.get_sampling_compiler_options = lambda: {}
    from tpu_inference.models.common import model_loader

    model_loader.get_step_fn_compiler_options = lambda: {}

    def plain_mesh(axis_shapes, axis_names, *args, devices=None, **kwargs):
        devs = np.array(devices if devices is not None else jax.devices())
        return jax.sharding.Mesh(devs[:int(np.prod(axis_shapes))].reshape(axis_shapes),
                                 axis_names)

    tpu_runner.make_optimized_mesh = plain_mesh
    utils.hbm_usage_gb = lambda devices: [(0.0, 16.0) for _ in devices]
    utils.hbm_usage_bytes = lambda devices: [(0, 16 << 30) for _ in devices]
    if stand_in_attention:
        attention_interface.sharded_ragged_paged_attention = _jnp_rpa


def vllm_config(*, head_dim: int = 128, max_num_seqs: int = 4, max_model_len: int = 128,
                max_num_batched_tokens: int = 64, continue_decode: bool = True,
                max_decode_steps: int = 4, eos: int = 2, prefix_caching: bool = True,
                dp_size: int = 1, model: dict | None = None):
    """The tiny Qwen3's ``VllmConfig`` (a local ``config.json``; ``model``: fields of it
    changed), entered as the current one (as vLLM's worker does), with the worker's one-stage
    pipeline group set up."""
    from vllm.config import (CacheConfig, LoadConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, VllmConfig, set_current_vllm_config)

    from tpu_inference.distributed import jax_parallel_state

    model_dir = tempfile.mkdtemp(prefix="kvcanary-qwen3-")
    config = qwen3_config(head_dim, eos)
    config.update(max_position_embeddings=max(256, max_model_len), **(model or {}))
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f)
    additional = {"enable_continue_decode": continue_decode,
                  "max_decode_steps": max_decode_steps}
    cfg = VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
                                 max_model_len=max_model_len, seed=0),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                         max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=max_model_len,
                                         is_encoder_decoder=False, async_scheduling=False),
        parallel_config=ParallelConfig(data_parallel_size=dp_size),
        load_config=LoadConfig(load_format="dummy"),
        additional_config=additional,
    )
    entered = set_current_vllm_config(cfg)
    entered.__enter__()
    _ENTERED.append(entered)  # kept: a collected context would exit, unsetting the config
    # The worker's one-stage pipeline group (no transfer server without pipeline stages).
    jax_parallel_state.init_pp_distributed_environment("127.0.0.1", 0, 1, jax.devices()[0],
                                                       need_pp=False)
    return cfg


class Engine:
    """A ``TPUModelRunner`` and vLLM's ``Scheduler`` over it, stepped as vLLM's engine core
    steps them (one process, no executor)."""

    def __init__(self, *, head_dim: int = 128, num_blocks: int = 32, max_num_seqs: int = 4,
                 max_model_len: int = 128, continue_decode: bool = True,
                 max_decode_steps: int = 4, eos: int = 2, prefix_caching: bool = True,
                 dp_size: int = 1, max_num_batched_tokens: int = 64,
                 model: dict | None = None):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.attention.backends.utils import record_kv_cache_layout
        from vllm.v1.core.kv_cache_planning import get_kv_cache_configs
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        from tpu_inference.runner.tpu_runner import TPUModelRunner

        self.config = vllm_config(
            head_dim=head_dim, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens, continue_decode=continue_decode,
            max_decode_steps=max_decode_steps, eos=eos, prefix_caching=prefix_caching,
            dp_size=dp_size, model=model)
        self.runner = TPUModelRunner(self.config, devices=jax.devices()[:dp_size])
        self.runner.load_model()
        # The engine core resolves one layout for the model before sizing the cache (the
        # identity layout: tpu-inference lays its caches out itself).
        record_kv_cache_layout(self.config.cache_config, "LBHNC")
        specs = self.runner.get_kv_cache_spec()
        page = next(iter(specs.values())).page_size_bytes
        (kv_config,) = get_kv_cache_configs(self.config, [specs], [page * len(specs) * num_blocks])
        kv_config.num_blocks = num_blocks
        self.runner.initialize_kv_cache(kv_config)
        self.config.cache_config.num_gpu_blocks = num_blocks  # the engine core's record
        scheduler_cls = Scheduler
        if dp_size > 1:
            from tpu_inference.core.sched.dp_scheduler import (
                DPScheduler, update_vllm_config_for_dp_scheduler)
            update_vllm_config_for_dp_scheduler(self.config)
            scheduler_cls = DPScheduler
        self.scheduler = scheduler_cls(self.config, kv_config,
                                       StructuredOutputManager(self.config), block_size=BLOCK_SIZE)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.outputs: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], max_tokens: int, *, ignore_eos=True) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        params.update_from_generation_config({}, self.runner.eos_token_id)
        self.scheduler.add_request(Request(request_id=req_id, prompt_token_ids=list(prompt),
                                           sampling_params=params, pooling_params=None,
                                           block_hasher=self._hasher))
        self.outputs[req_id] = []

    def step(self):
        """One engine step; returns the scheduler output it ran."""
        out = self.scheduler.schedule()
        result = self.runner.execute_model(out)
        if result is None:
            result = self.runner.sample_tokens(None)
        engine_outputs = self.scheduler.update_from_output(out, result)
        for eo in engine_outputs.values():
            for o in eo.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    def run(self, max_steps: int = 50) -> list:
        outs = []
        while self.scheduler.has_requests() and len(outs) < max_steps:
            outs.append(self.step())
        return outs

    def slots_of(self, req_id: str) -> list[int]:
        """The KV slots of a running request's positions (from the runner's own state)."""
        state = self.runner.requests[req_id]
        blocks = state.block_ids[0]
        n = state.num_computed_tokens
        return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(n)]
