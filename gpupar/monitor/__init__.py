"""Probes that training uses: input waits, GPU utilisation, profiles (the commands that report them are in gpupar.commands)."""
