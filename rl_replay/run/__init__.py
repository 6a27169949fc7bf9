"""Running training: setup and the loop, run directories, checkpoint files, logging and wandb,
guards around a run (signals, evaluation, the gradient-horizon diagnostic) and the command line.

The top floor: it imports every other part of the package; nothing imports it back.
"""
