"""Training: config, models, data loading, the loop, checkpoints and the torchrun launcher."""
