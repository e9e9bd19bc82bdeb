"""Optimizer state checkpointed with logical (unsharded) meaning: exact resume, resharding across world
sizes and engines (see docs/checkpoints.md)."""

from .api import load, save, state_path
from .files import STATE_FILE, StateReader, read_metadata, read_state_file
from .logical import CheckpointError, export_state, import_state

__all__ = [
    "save",
    "load",
    "state_path",
    "STATE_FILE",
    "read_metadata",
    "read_state_file",
    "StateReader",
    "CheckpointError",
    "export_state",
    "import_state",
]
