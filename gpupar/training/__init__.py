"""Training: the step and its inner loop, the modes, the one set-up, the outer loop and its observers, the run.

Imports point one way: objective <- inner loop <- step <- own step <- engine <- modes <- setup <- observers <- loop <- run.
Checkpoints, signals, output folders, observers and results are the loop's and the run's helpers.
"""
