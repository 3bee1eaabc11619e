"""sglang-jax's ``ModelRunner`` as each supported version runs its model step.

The hooks (:mod:`~kvcanary_jax.integrations.sglang_jax.hooks`) run the runner's own step body
inside the guarded jit, so what the body does (0.1.0rc0: the recurrent copy-on-write, the LoRA
batch context, whatever a model returns) stays sglang-jax's. :func:`runner_api` reads, from the
runner object itself (never from package metadata), which version it is and where its pieces are:

* **sglang-jax 0.0.2.** ``jitted_run_model(forward_batch, logits_metadata)`` is a wrapper
  calling the jitted ``jitted_run_model(model_def, model_state_def, model_state_leaves,
  forward_batch, token_to_kv_pool, logits_metadata)`` (the KV pool donated); the model returns
  ``(output, layers, aux)`` and ``_forward`` stores ``layers`` with
  ``_set_kv_cache_after_forward``.
* **sglang-jax 0.1.0rc0.** The jitted body takes and donates a ``MemoryPools`` pytree
  (``memory_pools``: ``token_to_kv_pool``, plus ``recurrent_state_pool`` for hybrid models),
  runs ``_maybe_apply_recurrent_cow`` and the model under ``LoraBatchContext.set_batch``; the
  model returns ``(output, {"token_to_kv_pool": layers, ...}, flag, topk_ids)`` and ``_forward``
  stores the dict with ``memory_pools.replace_all``. The weights are read from
  ``model_state_leaves`` at every call (LoRA loading rebinds them). A second, fused decode step,
  ``jitted_run_and_sample(forward_batch, logits_metadata, sampling_metadata, future_map)``
  (``forward_and_sample``: the model, the sampler and the future token map in one jit, used when
  ``pd_disaggregation == "pathways"`` and ``SGLANG_PD_FUSE_SAMPLE=1``), has a body of its own.

The bodies are the jitted functions the wrappers close over (``__wrapped__``: the Python function
``jax.jit`` was given). A runner whose objects fit neither version is refused when the hook is
installed, with what was found and what is supported. (0.1.0rc0's opt-in AOT dispatch,
``SGLANG_JAX_AOT_DISPATCH``, keeps the jitted body on its dispatcher; the guarded step is a jit of
its own, dispatched the ordinary way.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

__all__ = [
    "SUPPORTED_VERSIONS",
    "RunnerApi",
    "runner_api",
]

SUPPORTED_VERSIONS = ("0.0.2", "0.1.0rc0")

_SUPPORTED = ("sglang-jax 0.0.2 (jitted_run_model over token_to_kv_pool, its KV stored by "
              "_set_kv_cache_after_forward) and 0.1.0rc0 (jitted_run_model over a MemoryPools "
              "memory_pools, stored by memory_pools.replace_all)")


def _closure(fn) -> dict[str, Any]:
    """The variables a Python function closes over, by name."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
    return out


def _body(jitted) -> Callable | None:
    """The Python function a ``jax.jit`` object wraps."""
    body = getattr(jitted, "__wrapped__", None)
    return body if callable(body) and hasattr(jitted, "lower") else None


@dataclasses.dataclass(frozen=True, eq=False)
class RunnerApi:
    """How one ``ModelRunner`` runs its model step (:func:`runner_api`).

    ``run_model``: the body of its jitted ``jitted_run_model`` (args ``model_def,
    model_state_def, model_state_leaves, forward_batch, pools, logits_metadata``);
    ``run_and_sample``: 0.1.0rc0's fused body (None on 0.0.2); ``model_def`` /
    ``model_state_def`` / ``sampler``: what the runner's wrappers pass them."""

    version: str
    runner: Any
    run_model: Callable
    model_def: Any
    model_state_def: Any
    leaves_0_0_2: Any = None
    run_and_sample: Callable | None = None
    sampler: tuple | None = None  # (sampler_def, sampler_state_def, sampler_state_leaves)

    @property
    def pooled(self) -> bool:
        """0.1.0rc0: the step takes a ``MemoryPools`` and returns its updates as a dict."""
        return self.version == "0.1.0rc0"

    def leaves(self):
        """The weights as the runner passes them now."""
        return self.runner.model_state_leaves if self.pooled else self.leaves_0_0_2

    def pools(self):
        """The step's pool argument: ``memory_pools`` (0.1.0rc0) or ``token_to_kv_pool``."""
        return self.runner.memory_pools if self.pooled else self.runner.token_to_kv_pool

    def kv_layers(self, updates) -> list:
        """The KV pool's new layer buffers in a step's pool updates."""
        if isinstance(updates, dict):
            return updates["token_to_kv_pool"]
        return updates

    def canary_layer(self, updates, pools, layer: int) -> jax.Array:
        """The new fused buffer of ``layer`` in a step's pool updates."""
        kv_pool = pools.token_to_kv_pool if self.pooled else pools
        return self.kv_layers(updates)[layer - getattr(kv_pool, "start_layer", 0)]


def runner_api(model_runner) -> RunnerApi:
    """Which supported sglang-jax version ``model_runner`` is, read from its objects. Raises
    TypeError naming what was found and what is supported for any other runner."""
    wrapper = getattr(model_runner, "jitted_run_model", None)
    env = _closure(wrapper)
    found = {
        "type": f"{type(model_runner).__module__}.{type(model_runner).__qualname__}",
        "memory_pools": type(getattr(model_runner, "memory_pools", None)).__name__,
        "_set_kv_cache_after_forward": hasattr(model_runner, "_set_kv_cache_after_forward"),
        "jitted_run_model closes over": sorted(env),
    }
    if getattr(wrapper, "__self__", None) is not None and hasattr(wrapper.__self__, "canary"):
        raise ValueError("kv-canary sglang-jax: this ModelRunner already has a canary hook "
                         "installed (uninstall() it first)")
    jitted = env.get("jitted_run_model")
    dispatcher = getattr(model_runner, "_run_model_dispatcher", None)
    if jitted is None and dispatcher is not None:  # 0.1.0rc0's AOT dispatch
        jitted = getattr(dispatcher, "_jit_fn", None)
    body = _body(jitted)
    pools = getattr(model_runner, "memory_pools", None)
    if (body is not None and hasattr(pools, "replace_all") and "model_def" in env
            and "model_state_def" in env and hasattr(model_runner, "model_state_leaves")):
        fused = getattr(model_runner, "jitted_run_and_sample", None)
        fenv = _closure(fused)
        sampler = None
        if all(k in fenv for k in ("sampler_def", "sampler_state_def", "sampler_state_leaves")):
            sampler = (fenv["sampler_def"], fenv["sampler_state_def"],
                       fenv["sampler_state_leaves"])
        return RunnerApi(version="0.1.0rc0", runner=model_runner, run_model=body,
                         model_def=env["model_def"], model_state_def=env["model_state_def"],
                         run_and_sample=_body(fenv.get("jitted_run_and_sample")),
                         sampler=sampler)
    if (body is not None and pools is None
            and hasattr(model_runner, "_set_kv_cache_after_forward")
            and all(k in env for k in ("model_def", "model_state_def", "model_state_leaves"))):
        return RunnerApi(version="0.0.2", runner=model_runner, run_model=body,
                         model_def=env["model_def"], model_state_def=env["model_state_def"],
                         leaves_0_0_2=env["model_state_leaves"])
    raise TypeError(f"kv-canary sglang-jax: unsupported sglang-jax ModelRunner: found {found}; "
                    f"supported: {_SUPPORTED}")
