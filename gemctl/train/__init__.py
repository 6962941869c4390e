"""Training: the loop, optimizers, evaluation."""
