"""Agreement: the decision to raise (a violation in ``raise`` mode, a stalled launch, a phase error,
a corrupted write index) is taken by every process together, so every process raises on the same
step, naming the rank and the slot, and none is left waiting on a peer that raised alone.

Within one process, over a device mesh, the error flag is max-reduced over the mesh axis inside
the step (:mod:`kvcanary_jax.runtime.device`). Across processes started with
``jax.distributed.initialize``, :class:`Agreement` exchanges a small :class:`Finding` per readback
through the key-value store of jax.distributed's coordination service (the one every process is
already connected to): each process publishes its own under a key of that exchange, then reads
every peer's, waiting at most ``ManagerConfig.agreement_timeout_s`` (ours; default 300 s) in all.

**The timeout.** A peer whose finding does not arrive in time (hung, dead, or no longer stepping
in lockstep) makes every live process raise :class:`~kvcanary_jax.runtime.reporting.
CanaryAgreementError` naming the peer (``peers``), with the step's KV attached when raised from a
step, instead of blocking. A peer at another step of the same exchange (one process called
``step``/``observe``/``flush`` more often than another) is named the same way. Every process
checks the settings that must match (mode, sweep interval, ring capacity, padding guard, coverage
window) when its manager is built, with the same timeout, mode ``none`` included: a mismatch is a
``ValueError`` naming every rank's settings on every process; a process that never builds its
manager is named after the timeout.

Set the timeout above the longest step any process can take (a first compilation included) and
above the spread of the moments the processes build their managers.

**What the user must set.** jax.distributed's coordination service watches every process through
heartbeats. When a process dies, it tells the others after ``heartbeat_timeout_seconds`` (an
argument of ``jax.distributed.initialize``, 100 s by default), and JAX then *terminates* every
live process, canary or not. For the live processes to get the canary's error and keep serving,
enable JAX's recoverability before ``jax.distributed.initialize`` in every process:
``jax.config.update("jax_enable_recoverability", True)`` (or ``JAX_ENABLE_RECOVERABILITY=1``);
the manager logs a warning when it agrees across processes without it. The death of process 0,
which hosts the coordination service, terminates every process whatever is set (JAX's client
aborts when its service is gone): nothing in the process can report it.

Each exchange costs one key set, one directory read of that exchange's keys (plus a blocking read
per peer not there yet) and one delete, on the host, after the next step was dispatched.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time

import jax

from kvcanary_jax.runtime.config import ManagerConfig
from kvcanary_jax.runtime.reporting import CanaryAgreementError, logger

__all__ = ["SETTINGS", "Finding", "AgreementFailure", "Agreement"]

# The settings every process must share to agree on when to raise.
SETTINGS = ("mode", "sweep_interval", "ring_capacity", "padding_guard", "coverage_window")

_KEY_ROOT = "kvcanary_jax/agreement"
# Managers that agree across processes, numbered in the order each process builds them: the n-th
# manager of every process shares the n-th key space.
_MANAGER_NUMBERS = itertools.count()


@dataclasses.dataclass(frozen=True)
class Finding:
    """What one process read back at one exchange, as its peers see it."""

    step: int
    new_violations: int = 0  # raise mode only: the rows that make everyone raise
    first_slot: int = -1
    first_tag: str = ""
    first_shard: int = -1
    stalled_tags: int = 0
    phase_errors: int = 0
    negative_index: int = 0
    unrecorded: int = 0  # raise mode only: violations past a full ring (their slots unknown)

    @property
    def raises(self) -> bool:
        return bool(self.new_violations or self.stalled_tags or self.phase_errors
                    or self.negative_index or self.unrecorded)


class AgreementFailure(Exception):
    """No agreement: ``peers`` did not answer as they should; ``reason`` says how."""

    def __init__(self, reason: str, peers):
        super().__init__(reason)
        self.reason = reason
        self.peers = tuple(peers)


def _coordination_client():
    # jax.distributed's public API has no key-value store; its coordination client does
    # (key_value_set, key_value_dir_get, blocking_key_value_get with a timeout, key_value_delete),
    # in jax 0.10 and 0.12 alike.
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def _ranks(peers) -> str:
    peers = sorted(peers)
    return ("rank " if len(peers) == 1 else "ranks ") + ", ".join(str(p) for p in peers)


class Agreement:
    """The agreement of one manager (see the module docstring). Within one process (one
    process, or ``agree_across_processes=False``) every exchange returns this process's finding
    alone."""

    def __init__(self, config: ManagerConfig):
        self.rank = jax.process_index()
        self.timeout_s = config.agreement_timeout_s
        agree = config.agree_across_processes
        processes = jax.process_count()
        self.processes = processes if (processes > 1 if agree is None else agree) else 1
        self._client = None
        if self.processes == 1:
            return
        self._client = _coordination_client()
        if self._client is None:
            raise ValueError("kv-canary: agreement across processes runs through "
                             "jax.distributed's coordination service: call "
                             "jax.distributed.initialize() first")
        if not jax.config.jax_enable_recoverability:
            logger.warning(
                "kv-canary agreement: jax_enable_recoverability is off, so when a peer process "
                "dies jax.distributed terminates this one after its heartbeat timeout instead "
                "of letting the canary raise; set jax.config.update('jax_enable_recoverability', "
                "True) before jax.distributed.initialize() in every process")
        self._prefix = f"{_KEY_ROOT}/{next(_MANAGER_NUMBERS)}"
        self._exchanges = 0
        self._own_keys: list[str] = []

    @property
    def across_processes(self) -> bool:
        return self._client is not None

    # ----------------------------------------------------------------------------- gather
    def _present(self, prefix: str) -> dict[int, str]:
        return {int(key.rsplit("/", 1)[1]): value
                for key, value in self._client.key_value_dir_get(prefix)}

    def _gather(self, name: str, value: str, what: str) -> dict[int, str]:
        """Publish ``value`` under exchange ``name`` and read every process's, within the
        timeout; :class:`AgreementFailure` naming the processes that did not publish."""
        prefix = f"{self._prefix}/{name}/"
        own = prefix + str(self.rank)
        self._client.key_value_set(own, value)
        self._own_keys.append(own)
        deadline = time.monotonic() + self.timeout_s
        got = self._present(prefix)
        for peer in range(self.processes):
            if peer in got:
                continue
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            try:
                got[peer] = self._client.blocking_key_value_get(prefix + str(peer), left_ms)
            except Exception as e:  # noqa: BLE001 - jaxlib's error type differs across versions
                if "DEADLINE_EXCEEDED" not in str(e):
                    missing = [p for p in range(self.processes) if p not in got]
                    raise AgreementFailure(
                        f"jax.distributed's coordination service failed while this process "
                        f"(rank {self.rank}) waited for {_ranks(missing)} to report {what}: "
                        f"{e}", missing) from e
                break
        missing = [p for p in range(self.processes) if p not in got]
        if missing:
            got.update(self._present(prefix))  # a last look: who came while the others timed out
            missing = [p for p in range(self.processes) if p not in got]
        if missing:
            raise AgreementFailure(
                f"{_ranks(missing)} did not report {what} within {self.timeout_s:g} s "
                f"(agreement_timeout_s): hung, dead, or no longer stepping in lockstep with "
                f"this process (rank {self.rank})", missing)
        return got

    # --------------------------------------------------------------------------- exchanges
    def check_settings(self, config: ManagerConfig) -> None:
        """Every process runs the same :data:`SETTINGS`: ValueError naming every rank's, or
        :class:`CanaryAgreementError` naming a rank that did not publish them in time."""
        if not self.across_processes:
            return
        mine = {name: getattr(config, name) for name in SETTINGS}
        try:
            got = self._gather("settings", json.dumps(mine), "its canary settings while the "
                               "managers were built")
        except AgreementFailure as e:
            raise CanaryAgreementError(f"kv-canary agreement: {e.reason}", peers=e.peers,
                                       step=0) from None
        everyone = {rank: json.loads(value) for rank, value in sorted(got.items())}
        if any(settings != mine for settings in everyone.values()):
            rows = "; ".join(f"rank {rank}: " + " ".join(f"{k}={s[k]}" for k in SETTINGS)
                             for rank, s in everyone.items())
            raise ValueError("kv-canary: the processes run different canary settings, so they "
                             f"cannot agree on when to raise: {rows}")

    def exchange(self, finding: Finding) -> dict[int, Finding]:
        """Every process's finding of this exchange, by rank: :class:`AgreementFailure` naming
        the processes that did not report in time, or that report another step."""
        if not self.across_processes:
            return {self.rank: finding}
        number = self._exchanges
        self._exchanges += 1
        got = self._gather(f"step/{number}", json.dumps(dataclasses.asdict(finding)),
                           f"step {finding.step}")
        everyone = {rank: Finding(**json.loads(value)) for rank, value in sorted(got.items())}
        elsewhere = {rank: f.step for rank, f in everyone.items() if f.step != finding.step}
        # Every peer has published this exchange, so each has read this process's keys of the
        # ones before: they can go.
        stale, self._own_keys = self._own_keys[:-1], self._own_keys[-1:]
        for key in stale:
            self._client.key_value_delete(key)
        if elsewhere:
            raise AgreementFailure(
                "; ".join(f"rank {rank} is at step {step}" for rank, step in elsewhere.items())
                + f" where this process (rank {self.rank}) is at step {finding.step}: the "
                "processes no longer step in lockstep (every process calls step(), observe() "
                "and flush() alike)", elsewhere)
        return everyone
