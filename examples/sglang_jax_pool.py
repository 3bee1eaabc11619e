"""The canary wired to a JAX serving structure shaped like sglang-jax's memory pools.

sglang-jax keeps ``ReqToTokenPool.req_to_token`` as an int32 ``[size, max_context_len]`` array and
its MHA KV pool as per-layer bf16 ``k_buffer`` / ``v_buffer`` arrays. The two classes below are
minimal stand-ins with the same attribute names (sglang-jax itself is not needed); the canary
takes ``req_to_token`` as the plan's slot table and one layer's K/V buffers, viewed as bytes, as
the TAIL/SWEEP real-KV sources.

Run: ``python examples/sglang_jax_pool.py`` (on a CPU every op runs the host's default
implementation, see ``kvcanary_jax.implementations_available()``).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from kvcanary_jax import runtime as rt

warnings.filterwarnings("ignore", message=".*donated buffers.*")


class ReqToTokenPool:
    """sglang-jax's request -> KV-slot table (row 0 is kept free as the padding row)."""

    def __init__(self, size: int, max_context_len: int):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = np.zeros((size, max_context_len), dtype=np.int32)
        self.free_slots = list(range(1, size))

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return out

    def free(self, free_index: int) -> None:
        self.free_slots.append(free_index)

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values


class MHATokenToKVPool:
    """Per-layer K/V buffers ``[size, head_num * head_dim]`` in bf16 (slot 0 = dummy writes)."""

    def __init__(self, size: int, head_num: int, head_dim: int, layer_num: int):
        self.size = size
        shape = (size, head_num * head_dim)
        self.k_buffer = [jnp.zeros(shape, jnp.bfloat16) for _ in range(layer_num)]
        self.v_buffer = [jnp.zeros(shape, jnp.bfloat16) for _ in range(layer_num)]
        self.free_slots = list(range(1, size))

    def alloc(self, n: int) -> list[int]:
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def set_kv_buffer(self, layer_id: int, loc, k, v) -> None:
        loc = jnp.asarray(loc)
        dst = jnp.where(loc < 0, self.size, loc)  # padding tokens are dropped
        self.k_buffer[layer_id] = self.k_buffer[layer_id].at[dst].set(k, mode="drop")
        self.v_buffer[layer_id] = self.v_buffer[layer_id].at[dst].set(v, mode="drop")


def main():
    req_pool = ReqToTokenPool(size=8, max_context_len=32)
    kv_pool = MHATokenToKVPool(size=128, head_num=2, head_dim=16, layer_num=2)
    cfg = rt.CanaryConfig(max_reqs=req_pool.size, context_len=req_pool.max_context_len,
                          num_slots=kv_pool.size, max_bs=4, max_tokens=16, enable_v_half=True)
    state = rt.init_state(cfg)
    canary_layer = 0  # SGLang fingerprints one layer's KV per buffer group

    def kv_for_canary():
        return {"FULL": {"K": [kv_pool.k_buffer[canary_layer]], "V": [kv_pool.v_buffer[canary_layer]]}}

    def forward(batch):
        """A stand-in model: every layer writes KV derived from (token, position)."""
        n = cfg.max_tokens
        ids = np.asarray(batch.input_ids, np.float32)[:, None]
        pos = np.asarray(batch.positions, np.float32)[:, None]
        width = kv_pool.k_buffer[0].shape[1]
        lane = np.arange(width, dtype=np.float32)[None, :]
        for layer in range(len(kv_pool.k_buffer)):
            k = jnp.asarray((ids * 0.5 + pos + lane + layer) % 97, jnp.bfloat16)
            v = jnp.asarray((ids - pos * 3 + lane * 2 + layer) % 89, jnp.bfloat16)
            kv_pool.set_kv_buffer(layer, np.asarray(batch.out_cache_loc)[:n], k, v)

    def run(batch):
        nonlocal state
        state = rt.canary_step_head(cfg, state, batch, req_to_token=jnp.asarray(req_pool.req_to_token))
        forward(batch)
        state = rt.canary_step_tail(cfg, state, batch, kv=kv_for_canary())

    # Prefill one request of 6 tokens, then decode 3 tokens.
    prompt = [101, 102, 103, 104, 105, 106]
    row = req_pool.alloc(1)[0]
    slots = kv_pool.alloc(len(prompt))
    req_pool.write((row, slice(0, len(prompt))), slots)
    run(rt.make_batch(cfg, req_pool_indices=[row], prefix_lens=[0], extend_seq_lens=[len(prompt)],
                      all_ids=[prompt], input_ids=prompt, positions=list(range(len(prompt))),
                      out_cache_loc=slots))
    tokens = list(prompt)
    for _ in range(3):
        tok, pos = 200 + len(tokens), len(tokens)
        tokens.append(tok)
        (slot,) = kv_pool.alloc(1)
        req_pool.write((row, pos), slot)
        run(rt.make_batch(cfg, req_pool_indices=[row], prefix_lens=[pos], extend_seq_lens=[1],
                          all_ids=[tokens], input_ids=[tok], positions=[pos], out_cache_loc=[slot]))
    print("clean steps:", rt.violation_count(state), "violations;", rt.read_counters(state))

    # Corrupt one cached V byte of the canary layer, then sweep the live request's prefix.
    bad = int(req_pool.req_to_token[row, 2])
    v = jax.lax.bitcast_convert_type(kv_pool.v_buffer[canary_layer], jnp.uint16)
    kv_pool.v_buffer[canary_layer] = jax.lax.bitcast_convert_type(
        v.at[bad, 0].set(v[bad, 0] ^ jnp.uint16(1)), jnp.bfloat16)
    rows = np.zeros((cfg.max_reqs,), np.int64)
    lens = np.zeros((cfg.max_reqs,), np.int64)
    rows[0], lens[0] = row, len(tokens)
    state = rt.canary_sweep(cfg, state, rows_table=jnp.asarray(req_pool.req_to_token),
                            row_indices=rows, lengths=lens, kv=kv_for_canary())
    for v in rt.read_violations(state):
        print("violation:", v)


if __name__ == "__main__":
    main()
