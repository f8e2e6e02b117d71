"""Training: the steps (inner loop), the engine (one set-up per run), the loop (one for every mode), the run.

Imports point one way: steps <- engine <- loop <- run. Checkpoints, signals, summaries, output
folders and results are the loop's and the run's helpers.
"""
