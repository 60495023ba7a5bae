"""Data tools: TFRecord reading/writing, indexes, datasets, checks."""
