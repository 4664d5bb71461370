"""Model families as recipes the one Trainer runs (see :mod:`parallax.train.recipe`)."""
