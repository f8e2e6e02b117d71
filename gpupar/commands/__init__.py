"""The commands above training: `gpupar diagnose`, `gpupar devices [--check]` and `gpupar plot`."""
