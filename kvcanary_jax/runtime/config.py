"""The canary runtime's configuration: SGLang 0.5.23's flags and environment variables.

SGLang configures its runtime (``sglang/srt/kv_canary/config.py``) from three server flags and
a few ``SGLANG_KV_CANARY_*`` environment variables; :class:`ManagerConfig` has the same knobs,
names and defaults, plus the few this port adds (marked "ours"):

====================================  ===============================================  =========
SGLang                                :class:`ManagerConfig` field                     default
====================================  ===============================================  =========
``--kv-canary {none,log,raise}``      ``mode``                                         ``none``
``--kv-canary-real-data``             ``real_data`` (``none``, ``partial``, ``all``)   ``none``
``--kv-canary-sweep-interval N``      ``sweep_interval``                               ``0``
``SGLANG_KV_CANARY_RING_CAPACITY``    ``ring_capacity``                                ``1024``
``SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS``  ``stats_print_every_n_steps``          ``100``
``SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT``  ``enable_write_input_assert``          ``False``
``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT`` ``enable_verify_token_assert``         ``False``
(``model_runner.is_draft_worker``)    ``draft_worker`` (token/position offset 1)       ``False``
(health checker constants)            ``health_check_warmup_steps`` / ``_every_n_steps``  ``100``
ours: ``--kv-canary-padding-guard``   ``padding_guard`` (the sweep checks slot 0)      ``False``
ours                                  ``coverage_window``: every layer's K and V of    ``0``
                                      every live slot verified within N steps (0: off)
                                      ``--kv-canary-coverage-window N``,
                                      ``SGLANG_KV_CANARY_COVERAGE_WINDOW``
ours                                  ``agree_across_processes`` (``None``: when       ``None``
                                      ``jax.process_count() > 1``)
ours                                  ``agreement_timeout_s``: how long a process      ``300``
                                      waits for its peers' findings (and settings)
====================================  ===============================================  =========

Every value is checked when the config is built (``ValueError`` naming the flag or variable, the
value and the rule), never mid-serving; so are the contradictory settings SGLang refuses (a sweep
interval with mode ``none``) and ours (a padding guard without a sweep, real-KV checks with mode
``none``, a coverage window with mode ``none``, without a sweep, or on a draft worker).

The coverage window (ours; :mod:`kvcanary_jax.runtime.coverage`, docs/spec.md §17) bounds two
delays, each stated: a slot that steps keep reading is verified within ``coverage_window`` steps
of them, a cached slot no step reads at the next sweep (``sweep_interval`` steps). So a window
needs the sweep: without one, cached slots would never be verified, less coverage than asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import numbers
import os
from typing import Mapping

from kvcanary_jax.runtime.state import MAX_COVERAGE_WINDOW, MAX_SIZE

__all__ = ["ManagerConfig", "MODES", "REAL_DATA", "ENV_VARS", "OUR_ENV_VARS", "add_arguments",
           "env_value", "ENV_TRUE", "ENV_FALSE"]

MODES = ("none", "log", "raise")
REAL_DATA = ("none", "partial", "all")

# field -> SGLang's environment variable (sglang/srt/environ.py).
ENV_VARS = {
    "ring_capacity": "SGLANG_KV_CANARY_RING_CAPACITY",
    "stats_print_every_n_steps": "SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS",
    "enable_write_input_assert": "SGLANG_KV_CANARY_ENABLE_WRITE_INPUT_ASSERT",
    "enable_verify_token_assert": "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT",
}
# field -> our environment variable, named like SGLang's.
OUR_ENV_VARS = {"coverage_window": "SGLANG_KV_CANARY_COVERAGE_WINDOW"}
_ENV = {**ENV_VARS, **OUR_ENV_VARS}

# field -> the flag that sets it (named in errors).
_FLAGS = {
    "mode": "--kv-canary",
    "real_data": "--kv-canary-real-data",
    "sweep_interval": "--kv-canary-sweep-interval",
    "padding_guard": "--kv-canary-padding-guard",
    "coverage_window": "--kv-canary-coverage-window",
}

# Integer fields and their minimum.
_INTS = {
    "sweep_interval": 0,
    "ring_capacity": 1,
    "stats_print_every_n_steps": 0,
    "health_check_warmup_steps": 0,
    "health_check_every_n_steps": 1,
    "coverage_window": 0,
}
# Ours: the most the fields the canary's state or its step counters take may be (a larger
# sweep interval overflowed the report's int64 step arithmetic): CanaryConfig's bound, refused
# here naming the flag or variable.
_MAXES = {"sweep_interval": MAX_SIZE, "ring_capacity": MAX_SIZE}
_BOOLS = ("enable_write_input_assert", "enable_verify_token_assert", "draft_worker",
          "padding_guard")


def _origin(field: str) -> str:
    names = [n for n in (_FLAGS.get(field), _ENV.get(field)) if n]
    return f"{field} ({' / '.join(names)})" if names else field


# SGLang's EnvBool words (any case).
ENV_TRUE = ("true", "1", "yes", "y")
ENV_FALSE = ("false", "0", "no", "n")


def _parse_env_bool(name: str, text: str) -> bool:
    # SGLang's EnvBool.parse, with the variable named.
    value = text.strip().lower()
    if value in ENV_TRUE:
        return True
    if value in ENV_FALSE:
        return False
    raise ValueError(f'kv-canary: {name}="{text}" is not a valid boolean value '
                     f"({'/'.join(ENV_TRUE)} or {'/'.join(ENV_FALSE)})")


def _parse_env_int(name: str, text: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f'kv-canary: {name}="{text}" is not a valid integer value') from None


def env_value(field: str, environ: Mapping[str, str] | None = None):
    """The value of ``field``'s ``SGLANG_KV_CANARY_*`` variable in ``environ`` (default
    ``os.environ``), parsed as SGLang parses it; ``None`` where it is not set. A value that does
    not parse, or is out of range, is refused naming the variable."""
    if field not in _ENV:
        raise ValueError(f"kv-canary: no SGLANG_KV_CANARY_* variable sets {field!r}; those that "
                         f"do: {', '.join(_ENV)}")
    environ = os.environ if environ is None else environ
    name = _ENV[field]
    if name not in environ:
        return None
    text = environ[name]
    if field in _BOOLS:
        return _parse_env_bool(name, text)
    value = _parse_env_int(name, text)
    if value < _INTS[field]:
        raise ValueError(f'kv-canary: {name}="{text}" must be >= {_INTS[field]}')
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """What :class:`~kvcanary_jax.runtime.CanaryManager` runs (see the module docstring for
    SGLang's name of each field). Strings are matched case-insensitively, as SGLang does."""

    mode: str = "none"
    real_data: str = "none"
    sweep_interval: int = 0
    ring_capacity: int = 1024
    stats_print_every_n_steps: int = 100
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    draft_worker: bool = False
    health_check_warmup_steps: int = 100
    health_check_every_n_steps: int = 100
    padding_guard: bool = False
    agree_across_processes: bool | None = None
    agreement_timeout_s: float = 300.0
    coverage_window: int = 0

    def __post_init__(self):
        for field, choices in (("mode", MODES), ("real_data", REAL_DATA)):
            value = getattr(self, field)
            if not isinstance(value, str) or value.strip().lower() not in choices:
                raise ValueError(f"kv-canary: {_origin(field)} must be one of "
                                 f"{'/'.join(choices)}, got {value!r}")
            object.__setattr__(self, field, value.strip().lower())
        for field, minimum in _INTS.items():
            value = getattr(self, field)
            # bool is an int to Python; a flag given True here is a slip, not a count. NumPy's
            # integers are taken, as ints.
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"kv-canary: {_origin(field)} must be an integer, got "
                                 f"{value!r} ({type(value).__name__})")
            value = int(value)
            object.__setattr__(self, field, value)
            if value < minimum:
                raise ValueError(f"kv-canary: {_origin(field)} must be >= {minimum}, got {value}")
            if field in _MAXES and value > _MAXES[field]:
                raise ValueError(f"kv-canary: {_origin(field)} must be <= "
                                 f"2**{_MAXES[field].bit_length() - 1}, got {value}")
        for field in _BOOLS:
            value = getattr(self, field)
            if not isinstance(value, bool):
                raise ValueError(f"kv-canary: {_origin(field)} must be True or False, got "
                                 f"{value!r} ({type(value).__name__})")
        if self.agree_across_processes not in (None, True, False):
            raise ValueError("kv-canary: agree_across_processes must be None, True or False, "
                             f"got {self.agree_across_processes!r}")
        timeout = self.agreement_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (
                0 < timeout < float("inf")):
            raise ValueError("kv-canary: agreement_timeout_s must be a number of seconds > 0, "
                             f"got {timeout!r}")
        # SGLang's validation hook refuses this one, in these words.
        if self.sweep_interval > 0 and self.mode == "none":
            raise ValueError("--kv-canary-sweep-interval requires --kv-canary in {log, raise}")
        # Ours: settings that would silently never act.
        if self.real_data != "none" and self.mode == "none":
            raise ValueError("--kv-canary-real-data requires --kv-canary in {log, raise} "
                             f"(got --kv-canary-real-data {self.real_data} with --kv-canary none)")
        if self.padding_guard and self.sweep_interval == 0:
            raise ValueError("--kv-canary-padding-guard runs with the sweep: it requires "
                             "--kv-canary-sweep-interval > 0")
        self._check_coverage()

    def _check_coverage(self):
        """Ours: a coverage window whose bound could not hold is refused (module docstring)."""
        window = self.coverage_window
        if window == 0:
            return
        flag = f"--kv-canary-coverage-window {window}"
        if window > MAX_COVERAGE_WINDOW:
            raise ValueError(f"{flag}: a window is at most {MAX_COVERAGE_WINDOW} steps")
        if self.mode == "none":
            raise ValueError(f"{flag} requires --kv-canary in {{log, raise}}")
        if self.sweep_interval == 0:
            raise ValueError(
                f"{flag} verifies the slots steps read within {window} steps and cached slots "
                "at each sweep: it requires --kv-canary-sweep-interval > 0 (without a sweep, "
                "cached slots no request reads would never be verified)")
        if self.draft_worker:
            raise ValueError(
                f"{flag} needs the sweep for cached slots, and a draft worker's manager runs "
                "none (SGLang attaches the radix cache to the target worker only): leave the "
                "window at 0 on the draft worker")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def kv_token_id_vs_position_offset(self) -> int:
        """SGLang's ``1 if model_runner.is_draft_worker else 0``."""
        return 1 if self.draft_worker else 0

    @classmethod
    def from_env(cls, *, kv_canary: str = "none", kv_canary_real_data: str = "none",
                 kv_canary_sweep_interval: int = 0, environ: Mapping[str, str] | None = None,
                 **fields) -> "ManagerConfig":
        """SGLang's ``CanaryConfig.from_env``: the three flags as arguments, the rest from the
        ``SGLANG_KV_CANARY_*`` variables (SGLang's and :data:`OUR_ENV_VARS`) of ``environ``
        (default ``os.environ``) where set, and
        ``fields`` last (they override both). A variable that does not parse, or parses to a
        value out of range, is refused naming the variable."""
        values = dict(mode=kv_canary, real_data=kv_canary_real_data,
                      sweep_interval=kv_canary_sweep_interval)
        for field in _ENV:
            value = env_value(field, environ)
            if value is not None:
                values[field] = value
        from_env = "coverage_window" in values and "coverage_window" not in fields
        values.update(fields)
        try:
            return cls(**values)
        except ValueError as e:
            if not (from_env and str(e).startswith("--kv-canary-coverage-window")):
                raise
            # The flag's words, and where the value came from.
            raise ValueError(f"{e} (the window from {_ENV['coverage_window']})") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, environ: Mapping[str, str] | None = None,
                  **fields) -> "ManagerConfig":
        """From a namespace parsed with :func:`add_arguments` (and the environment)."""
        if getattr(args, "kv_canary_padding_guard", False):
            fields.setdefault("padding_guard", True)
        if getattr(args, "kv_canary_coverage_window", None) is not None:
            # The flag, when given, over the environment variable.
            fields.setdefault("coverage_window", args.kv_canary_coverage_window)
        return cls.from_env(kv_canary=args.kv_canary, kv_canary_real_data=args.kv_canary_real_data,
                            kv_canary_sweep_interval=args.kv_canary_sweep_interval,
                            environ=environ, **fields)


def add_arguments(parser: argparse.ArgumentParser, *, prefix: str = "--kv-canary",
                  default_mode: str = "none", default_sweep_interval: int = 0) -> None:
    """SGLang's three flags (and our padding guard and coverage window) on an argparse parser.
    ``prefix`` renames them (``--kv-canary``, ``--kv-canary-real-data``, ...)."""
    parser.add_argument(prefix, dest="kv_canary", choices=MODES, default=default_mode,
                        help="KV cache canary mode. 'none' disables the canary. 'log' logs "
                             "violations while serving continues. 'raise' fails on the first "
                             f"detected mismatch (default {default_mode})")
    parser.add_argument(f"{prefix}-real-data", dest="kv_canary_real_data", choices=REAL_DATA,
                        default="none",
                        help="check the real KV cache: 'partial' the first 16 bytes of each "
                             "slot, 'all' the whole slot (default none)")
    parser.add_argument(f"{prefix}-sweep-interval", dest="kv_canary_sweep_interval", type=int,
                        default=default_sweep_interval,
                        help="every N forward steps, re-verify every cached prefix (0: never; "
                             f"default {default_sweep_interval})")
    parser.add_argument(f"{prefix}-padding-guard", dest="kv_canary_padding_guard",
                        action="store_true",
                        help="the sweep also checks that the padding slot 0 of the real KV stays "
                             "all zero (not an SGLang check)")
    parser.add_argument(f"{prefix}-coverage-window", dest="kv_canary_coverage_window",
                        type=int, default=None, metavar="N",
                        help="verify every byte of every layer's K and V of every live slot: "
                             "slots steps keep reading within N steps (each step checks 1/N of "
                             "the slots it reads), cached slots at each sweep; needs "
                             f"{prefix}-sweep-interval > 0 (not an SGLang check; default "
                             "SGLANG_KV_CANARY_COVERAGE_WINDOW, else 0: off)")
