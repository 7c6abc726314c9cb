"""Training: losses and the jitted train step."""
