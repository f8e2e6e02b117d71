"""`python -m gpupar [flags]`: the same as the `gpupar` command."""

from gpupar.cli import run

run()
