"""Errors the user can fix by changing their input."""


class ConfigError(ValueError):
    """A config, override or preset is invalid; the message names the key, the value and what is valid."""


class TrainingHalted(RuntimeError):
    """The run stopped itself to protect what it saved (non-finite steps, too many skips); the CLI exits 3."""


class CheckpointWriteError(TrainingHalted):
    """A checkpoint could not be written (disk full, no permission); the complete ones stay restorable."""
