"""The one error every checkpoint reader and writer raises for a bad checkpoint."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not match the model; nothing was loaded."""
