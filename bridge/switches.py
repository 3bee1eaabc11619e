"""The bridge's environment switches, read once at import.

``KVCANARY_BRIDGE_DIRECT``, ``KVCANARY_BRIDGE_FRONT`` and ``KVCANARY_BRIDGE_VALUE_CHECKS`` take
SGLang's boolean spellings (its ``EnvBool``: ``true/1/yes/y`` and ``false/0/no/n``, any case) and
``on``/``off``;
``KVCANARY_BRIDGE_VALUE_CHECKS`` also takes ``auto``, ``KVCANARY_BRIDGE_STREAM_SYNC`` one of
``event`` and ``fence``, and ``KVCANARY_BRIDGE_LAUNCH`` one of ``direct`` and ``triton``. Anything else is a ``ValueError`` naming the variable when the bridge is
imported: a misspelt switch never leaves the bridge on a path the user meant to turn off. The
setters (``set_direct``, ``set_value_checks``, ``set_stream_sync``) read the same words, and
refuse the rest the same way.

The boolean words are SGLang's (:data:`kvcanary_jax.runtime.config.ENV_TRUE` / ``ENV_FALSE``,
what its ``SGLANG_KV_CANARY_*`` variables take) with ``on`` / ``off`` beside them.
"""

from __future__ import annotations

import numbers
import os

import numpy as np

from kvcanary_jax.runtime.config import ENV_FALSE, ENV_TRUE

__all__ = ["TRUE_WORDS", "FALSE_WORDS", "switch", "choice", "env_switch", "env_choice"]

TRUE_WORDS = (*ENV_TRUE, "on")
FALSE_WORDS = (*ENV_FALSE, "off")


def switch(name: str, value, others: tuple[str, ...] = ()):
    """``value`` read as a switch: a bool (numpy's too) or an integer 0 / 1, or a word of
    :data:`TRUE_WORDS` / :data:`FALSE_WORDS` (any case, spaces around ignored) as True / False,
    or one of ``others`` (returned lower-case). Anything else: ``ValueError`` naming ``name``."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
        if word in others:
            return word
    words = "/".join(TRUE_WORDS) + " or " + "/".join(FALSE_WORDS) + "".join(
        f" or {w}" for w in others)
    raise ValueError(f"kv-canary bridge: {name}={value!r} is not a valid switch ({words})")


def env_switch(name: str, default, others: tuple[str, ...] = ()):
    """:func:`switch` of the environment variable ``name``; ``default`` where it is unset or
    empty."""
    text = os.environ.get(name, "")
    return default if not text.strip() else switch(name, text, others)


def choice(name: str, value, choices: tuple[str, ...]) -> str:
    """``value``, one of ``choices`` (any case, spaces around ignored), lower-case; anything else
    a ``ValueError`` naming ``name``."""
    word = value.strip().lower() if isinstance(value, str) else None
    if word not in choices:
        raise ValueError(f"kv-canary bridge: {name}={value!r} must be one of "
                         f"{', '.join(choices)}")
    return word


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """The environment variable ``name``, one of ``choices`` (any case); ``default`` where it is
    unset or empty; anything else a ``ValueError`` naming the variable."""
    text = os.environ.get(name, "")
    return default if not text.strip() else choice(name, text, choices)
