"""The library inside a training process: events from the training loop, hot backups, recovery."""
