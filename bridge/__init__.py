"""Torch bridge: SGLang-compatible kv-canary launchers over DLPack (zero-copy in, in place out)."""
