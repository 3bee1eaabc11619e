"""H200 benchmark of kvcanary-jax against SGLang 0.5.23's Triton/CUDA kernels.

Installed with the package as ``kvcanary_jax.bench`` (this folder, through pyproject's
``package-dir``): ``python -m kvcanary_jax.bench``, ``kvcanary-jax bench``, and from a checkout's
root ``python -m bench`` or ``python -m bench.<module>``, which run the installed checkout's
modules under their one name, kvcanary_jax.bench.
"""

if __name__ != "kvcanary_jax.bench":
    # ``python -m bench[.<module>]`` from a checkout's root imports this folder under its own name
    # first. Every module of it imports the others as kvcanary_jax.bench (one name per module, one
    # copy of its state), which resolves only where this checkout is installed: say so here
    # rather than fail on the first import, or run another checkout's bench.
    import importlib.util as _util
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    try:
        _spec = _util.find_spec("kvcanary_jax.bench")
    except ImportError:  # kvcanary_jax itself is not importable
        _spec = None
    _there = _os.path.dirname(_spec.origin) if _spec is not None and _spec.origin else None
    if _there is None or not _os.path.samefile(_there, _here):
        raise ImportError(
            f"python -m {__name__} runs this checkout's benchmark as kvcanary_jax.bench, which "
            f"resolves to {_there or 'nothing'}, not {_here}: install the checkout "
            f"(pip install -e {_os.path.dirname(_here)}), or run python -m kvcanary_jax.bench")
