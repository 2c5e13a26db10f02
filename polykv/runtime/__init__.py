"""Runtime: execute a Plan on a transformers model."""
