"""The server side of a fleet: the global model, the strategy, the rounds, their checkpoints and report."""
