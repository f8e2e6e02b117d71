"""Watching training: input waits, GPU utilisation, profiles, `gpupar diagnose`, `gpupar devices` and `gpupar plot`."""
