"""A small simulated server driven through :class:`kvcanary_jax.runtime.CanaryManager` (the tests
of the manager, its agreement across processes and the README's wiring share it)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from kvcanary_jax import runtime as rt
from kvcanary_jax.sim import faults
from kvcanary_jax.sim.server import Server, SimConfig, make_forward

# Small limits: one compilation of the step takes seconds on a CPU.
SIM = SimConfig(max_reqs=6, context_len=32, num_slots=96, max_bs=3, max_tokens=16, chunk_size=8,
                swa_window_size=0, sweep_interval=0, max_cache_entries=3, kv_width=8,
                implementation="xla")

_FORWARDS: dict = {}


def forward_for(cfg: rt.CanaryConfig, width: int):
    """One forward function object per (config, width): the manager's jits are keyed by it, so
    managers built for the same server share their compilations."""
    key = (cfg.groups, cfg.halves, cfg.num_slots, cfg.swa_num_slots, width)
    if key not in _FORWARDS:
        _FORWARDS[key] = make_forward(cfg, width)
    return _FORWARDS[key]


class Harness:
    """The simulator's scheduler, its KV owned by the caller, the canary run by the manager."""

    def __init__(self, config: rt.ManagerConfig, sim: SimConfig = SIM, *, sizes=None,
                 attach: bool = True, **kwargs):
        self.srv = Server(sim)
        self.srv.state = None  # the manager owns the canary state
        sizes = sizes or self.srv.cfg
        self.mgr = rt.CanaryManager(config, sizes, forward=forward_for(sizes, sim.kv_width),
                                    **kwargs)
        if attach and config.sweep_interval > 0:
            self.mgr.attach_radix_cache(self.srv.sweep_inputs)
        self.last_sched = []

    def prepare(self):
        sched, batch, rtt, lut = self.srv.prepare()
        return sched, batch, rtt, lut

    def step(self, n: int = 1):
        for _ in range(n):
            t0 = time.perf_counter()
            sched, batch, rtt, lut = self.prepare()
            self.srv.kv = self.mgr.step(self.srv.kv, batch, rtt, lut,
                                        requests=[r for r, _ in sched])
            self.srv.complete(sched, t0, poll=False)
            self.last_sched = sched
        return self.last_sched

    def serve(self, n: int = 1) -> list:
        """``n`` steps as a server that remediates and keeps serving: a
        :class:`~kvcanary_jax.runtime.CanaryViolationError` is caught and kept, the step finished
        with the error's KV (the step ran; the KV passed in was donated). Returns the errors."""
        errors = []
        for _ in range(n):
            t0 = time.perf_counter()
            sched, batch, rtt, lut = self.prepare()
            try:
                self.srv.kv = self.mgr.step(self.srv.kv, batch, rtt, lut,
                                            requests=[r for r, _ in sched])
            except rt.CanaryViolationError as e:
                assert e.kv is not None, "a step's error without the step's KV"
                self.srv.kv = e.kv
                errors.append(e)
            self.srv.complete(sched, t0, poll=False)
            self.last_sched = sched
        return errors

    def close(self) -> list:
        """``close()``, its error (if any) kept as :meth:`serve` keeps them."""
        try:
            self.mgr.close()
        except rt.CanaryViolationError as e:
            return [e]
        return []

    def live_prefix_slot(self):
        """(request, slot) of the first live request with a written prefix slot."""
        for req in self.srv.live:
            if req.slots:
                return req, req.slots[0]
        raise AssertionError("no live request with a cached prefix")

    def corrupt_kv(self, slot: int):
        faults._flip_kv_byte(self.srv, "FULL", slot)

    def dirty_padding_slot(self):
        layers = self.srv.kv["FULL"]["layers"]
        k = layers["K"][0]  # layer 0: the padding guard reads SGLang's fingerprint sources
        k = (k.at[0, 0].set(jnp.asarray(1.0, k.dtype)),) + layers["K"][1:]
        self.srv.kv = {**self.srv.kv, "FULL": {"layers": {**layers, "K": k}}}


def device_inputs(h: Harness):
    """A batch and tables already on the device (for steps under a transfer guard)."""
    sched, batch, rtt, lut = h.prepare()
    jax.block_until_ready((batch, rtt, lut))
    return sched, batch, rtt, lut
