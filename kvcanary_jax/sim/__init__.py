"""The demo's engine: a simulated server driving the canary (:mod:`.server`), fault injectors
(:mod:`.faults`, a registry) and the fault campaign (:mod:`.campaign`)."""

from kvcanary_jax.sim.campaign import (
    CampaignResult,
    FaultReport,
    default_window,
    fault_kinds,
    run_campaign,
    run_clean,
    run_trial,
)
from kvcanary_jax.sim.faults import (
    FAULT_KINDS,
    FAULTS,
    SWEEP_PLACED,
    Fault,
    disarm,
    fault,
    flip_kv_bit,
    hooks_armed,
    inject,
)
from kvcanary_jax.sim.server import (
    HALVES,
    CacheEntry,
    Request,
    Server,
    SimConfig,
    StepInfo,
    kv_salt,
    make_forward,
)

__all__ = [
    "SimConfig",
    "Server",
    "Request",
    "CacheEntry",
    "StepInfo",
    "make_forward",
    "kv_salt",
    "HALVES",
    "Fault",
    "FAULTS",
    "FAULT_KINDS",
    "SWEEP_PLACED",
    "fault",
    "inject",
    "flip_kv_bit",
    "hooks_armed",
    "disarm",
    "FaultReport",
    "CampaignResult",
    "run_clean",
    "fault_kinds",
    "default_window",
    "run_trial",
    "run_campaign",
]
