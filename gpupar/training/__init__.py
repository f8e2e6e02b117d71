"""Training: the kinds of step and their inner loop, the Trainer, the modes, the one set-up, the outer loop, the run.

Imports point one way: loss <- inner loop <- steps <- trainer <- modes <- setup <- observers <- loop <- run.
Checkpoints, signals, output folders, observers and results are the loop's and the run's helpers.
"""
