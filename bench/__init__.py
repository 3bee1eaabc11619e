"""H200 benchmark of kvcanary-jax against SGLang 0.5.23's Triton/CUDA kernels (``python -m bench``)."""
