"""The KV a step hands the canary: SGLang's real-KV sources of each half and, for the coverage
digest (ours), every layer of each buffer group.

A step's ``kv`` is a mapping ``{group: entry}`` (groups ``"FULL"`` and, with an SWA group,
``"SWA"``; rows of its arrays are the group's slots). An entry is one of:

* ``{"K": [sources], "V": [sources]}`` (or the pair ``([K sources], [V sources])``): SGLang's form.
  The sources of a half (1 to 4 arrays ``[slots, ...]`` or :class:`~kvcanary_jax.RealKvSource`)
  are all folded into that half's real-KV fingerprint by its TAIL and SWEEP launches; a half the
  config does not run (``enable_v_half`` off) is not read.
* ``{"layers": {"K": [L arrays], "V": [L arrays]}}``: every layer of the group, K and V (or
  ``{"layers": {"KV": [L arrays]}}`` for fused layers, one buffer holding a layer's K and V).
  SGLang's fingerprint of a half reads that half's layer 0, as SGLang's pool adapters do
  (``k_buffer[0]``, ``v_buffer[0]``), so its bytes are SGLang's; a half listed beside
  ``"layers"`` (``{"layers": ..., "K": [sources]}``, e.g. a fused layer's K head strips) gives
  the fingerprint's sources instead. The coverage digest (:mod:`kvcanary_jax.runtime.coverage`)
  reads every layer, in layer order: ``K_0, V_0, K_1, V_1, ...`` (or ``KV_0, KV_1, ...``). A
  layer's entry may be a list of sources itself (its strips, e.g. one per 128-lane row of a
  fused layer, which TPU kernels read in place where a whole row of several would be copied
  first), read in their order.

With ``coverage_window > 0`` every group needs its ``"layers"``, each list holding the config's
layer count of that group (``num_layers`` / ``swa_num_layers``), and every layer must hold every
slot of the group: anything else is a ValueError naming the setting while the step is traced,
never a digest over fewer bytes than the model's KV.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp

from kvcanary_jax.context import RealKvSource
from kvcanary_jax.ops import _registry
from kvcanary_jax.runtime.state import CanaryConfig

__all__ = ["HALVES", "LAYER_FORMS", "kv_sources", "as_kv_dict", "digest_sources", "translate",
           "source_slots", "digest_reads_rows"]

HALVES = ("K", "V")
# The accepted keys of an entry's "layers": split K/V layers, or fused ones.
LAYER_FORMS = (("K", "V"), ("KV",))


def kv_sources(kv: Sequence[jax.Array] | None, *, read_bytes: int | None = None):
    """Real-KV sources over 2-D KV arrays ``[slots, width]`` of any dtype (bf16 in the demo), as
    they are: one slot per row (its bytes folded), page size 1. A
    :class:`~kvcanary_jax.RealKvSource` in the list is taken as it is (a strip of a fused or
    paged buffer, addressed by the caller)."""
    if not kv:
        return ()
    out = []
    for arr in kv:
        if isinstance(arr, RealKvSource):
            out.append(arr)
            continue
        # The array as it is (a source may be of any dtype; the fingerprint reads its bytes):
        # a bitcast to uint8 would be a real op on a TPU, whose layout for the [slots, width, 2]
        # bytes of a bf16 array pads the 2 to 128 lanes (16 GiB for a 256 MiB KV layer).
        b = arr.reshape(arr.shape[0], -1)
        nbytes = int(b.shape[1]) * b.dtype.itemsize
        out.append(
            RealKvSource(
                tensor=b, page_size=1, num_bytes_per_token=nbytes,
                read_bytes=nbytes if read_bytes is None else read_bytes,
            )
        )
    return tuple(out)


def digest_reads_rows(implementation: str | None, like) -> bool:
    """Whether the coverage digest that ``implementation`` (``None``: the default where ``like``,
    an array of the KV, is placed or traced for) resolves to is the Mosaic TPU kernel, which
    reads a source in place only when its strip lies inside one 128-lane row of the buffer:
    the integrations then hand a fused layer as one strip per row (anything wider XLA lays out
    as 32-bit rows first, a copy of every layer each step). Elsewhere a layer is one source
    over the slot's whole row, the form the GPU kernel's launch heuristics were measured with.
    The digest's value depends on the form (the fold runs per source), never what it covers.
    (A fallback's FallbackWarning is given once per process, here or at the digest's call.)"""
    return _registry.op("digest").select(implementation, args=like) == "pallas_mosaic_tpu"


def _parts(layer) -> tuple:
    """A layer's sources: the layer itself, or the strips a list of them gives."""
    return tuple(layer) if isinstance(layer, (list, tuple)) else (layer,)


def source_slots(src) -> int:
    """The slots an array (one per row) or a :class:`~kvcanary_jax.RealKvSource` (rows x page
    size) addresses."""
    if isinstance(src, RealKvSource):
        return int(src.meta.shape[0]) * src.page_size
    return int(jnp.shape(src)[0])


def _where(group, *keys) -> str:
    return f"kv[{group!r}]" + "".join(f"[{k!r}]" for k in keys)


def _layers(cfg: CanaryConfig, group: str, entry) -> dict | None:
    """The entry's ``"layers"`` checked against the config (``None``: SGLang's form)."""
    if not isinstance(entry, Mapping) or "layers" not in entry:
        return None
    layers = entry["layers"]
    form = next((f for f in LAYER_FORMS if isinstance(layers, Mapping) and set(layers) == set(f)),
                None)
    if form is None:
        got = tuple(layers) if isinstance(layers, Mapping) else type(layers).__name__
        raise ValueError(f"kv-canary runtime: {_where(group, 'layers')} must map 'K' and 'V' "
                         f"(or 'KV', fused) to the lists of every layer's arrays, got {got}")
    want = cfg.layers(group)
    setting = "swa_num_layers" if group == "SWA" and cfg.swa_num_layers is not None \
        else "num_layers"
    slots = cfg.group_slots(group)
    for name, arrays in layers.items():
        if isinstance(arrays, (str, bytes)) or not isinstance(arrays, Sequence) or not arrays:
            raise ValueError(f"kv-canary runtime: {_where(group, 'layers', name)} must be a "
                             "non-empty list of the layers' arrays")
        if want is not None and len(arrays) != want:
            raise ValueError(
                f"kv-canary runtime: {_where(group, 'layers', name)} holds {len(arrays)} "
                f"layer(s), the config's {setting} is {want}: every layer of the model's KV is "
                "handed to the canary (a missing one would go unverified)")
        for i, arr in enumerate(arrays):
            parts = _parts(arr)
            if not parts:
                raise ValueError(f"kv-canary runtime: {_where(group, 'layers', name)}[{i}] is an "
                                 "empty list of strips")
            have = next((h for h in map(source_slots, parts) if h != slots), slots)
            if have != slots:
                raise ValueError(
                    f"kv-canary runtime: {_where(group, 'layers', name)}[{i}] holds {have} "
                    f"slots, the {group} group has {slots} "
                    f"({'num_slots' if group == 'FULL' else 'swa_num_slots'}): every layer of "
                    "a group holds every slot (sources of different slot counts)")
    return {name: layers[name] for name in form}  # in the form's order: K before V


def as_kv_dict(cfg: CanaryConfig, kv) -> dict:
    """SGLang's real-KV sources per group and half the config runs:
    ``{group: {half: (arrays or sources)}}`` (see the module docstring for the forms taken)."""
    if not isinstance(kv, Mapping):
        raise ValueError(f"kv-canary runtime: the step's kv must map each buffer group "
                         f"({', '.join(map(repr, cfg.groups))}) to its KV (see "
                         f"kvcanary_jax.runtime.kv), got {type(kv).__name__}")
    out = {}
    for g in cfg.groups:
        if g not in kv:
            raise ValueError(f"kv-canary runtime: the KV has no {g!r} group (it has "
                             f"{', '.join(map(repr, kv)) or 'none'}); rows of a group's arrays "
                             "are its slots")
        entry = kv[g]
        layers = _layers(cfg, g, entry)
        if isinstance(entry, Mapping):
            halves = {}
            for h in cfg.halves:
                if h in entry:
                    halves[h] = _sources(entry[h], _where(g, h))
                elif layers is not None and h in layers:
                    halves[h] = _parts(layers[h][0])  # SGLang's adapters: layer 0 of each half
                elif layers is not None:
                    raise ValueError(
                        f"kv-canary runtime: {_where(g)} gives fused layers ('KV') and no {h!r} "
                        f"sources for SGLang's fingerprint of the {h} half: list them beside "
                        f"'layers' ({_where(g)}[{h!r}] = [sources])")
                else:
                    raise ValueError(
                        f"kv-canary runtime: {_where(g)} has no {h!r} sources for SGLang's "
                        f"fingerprint of the {h} half (the config runs halves "
                        f"{', '.join(cfg.halves)}; enable_v_half adds V)")
            out[g] = halves
        else:
            need = 1 + HALVES.index(cfg.halves[-1])  # the pair, or (K,) where V is not run
            if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) \
                    or not need <= len(entry) <= len(HALVES):
                raise ValueError(f"kv-canary runtime: {_where(g)} must be {{'K': [sources], "
                                 "'V': [sources]}, the pair ([K sources], [V sources]) or "
                                 f"{{'layers': ...}}, got {type(entry).__name__}")
            out[g] = {h: _sources(entry[i], f"{_where(g)}[{i}]")
                      for i, h in enumerate(HALVES) if h in cfg.halves}
    return out


def _sources(value, where: str) -> tuple:
    """A half's list of sources; one array given alone would be taken row by row."""
    if isinstance(value, (RealKvSource, str, bytes)) or hasattr(value, "shape") \
            or not isinstance(value, Sequence):
        raise ValueError(f"kv-canary runtime: {where} must be a list of sources (1 to 4 arrays "
                         f"[slots, ...] or RealKvSource), got {type(value).__name__}: wrap a "
                         "single one in a list")
    return tuple(value)


def digest_sources(cfg: CanaryConfig, kv, group: str) -> tuple[RealKvSource, ...]:
    """The coverage digest's sources of ``group``: every layer of its ``"layers"``, in layer
    order (``K_0, V_0, K_1, ...``), each over all of its bytes. Raises ValueError (while
    tracing) for a KV without them."""
    entry = kv.get(group) if isinstance(kv, Mapping) else None
    layers = _layers(cfg, group, entry)
    if layers is None:
        raise ValueError(
            f"kv-canary runtime: coverage_window {cfg.coverage_window} digests every layer's K "
            f"and V, but {_where(group)} does not list its layers: pass "
            f"{_where(group)} = {{'layers': {{'K': [every layer], 'V': [every layer]}}}} (or "
            "{'KV': [...]} for fused layers); SGLang's per-half form holds the fingerprint's "
            "sources only")
    # Every list holds the config's count (checked above: a window needs num_layers).
    count = cfg.layers(group)
    return kv_sources([part for i in range(count) for arrays in layers.values()
                       for part in _parts(arrays[i])])


def translate(group: str, loc, lut):
    """Full-pool slots -> the group's canary slots (negative = skip, passes through)."""
    if group == "FULL":
        return loc
    safe = jnp.clip(loc, 0, lut.shape[0] - 1)
    return jnp.where(loc < 0, loc, lut[safe])
