"""The toolkit's exception hierarchy.

Errors a user can cause (bad config, bad file, bad id, mismatched world size) are raised as a
subclass of :class:`HpctrainError` with a message that says what and where. The CLI prints
such an error as one line and exits with code 2; anything else is a bug and aborts the job
with a traceback (see :mod:`hpctrain.runtime.abort`).
"""

from __future__ import annotations

__all__ = [
    "HpctrainError",
    "ConfigError",
    "DataError",
    "CommError",
    "EmbeddingError",
    "PSError",
    "CheckpointError",
    "NonFiniteError",
]


class HpctrainError(Exception):
    """Base of every error a user can cause; printed as one line, exit code 2."""


class ConfigError(HpctrainError):
    """A config key is unknown, ill-typed or out of range; the message names the key path."""


class DataError(HpctrainError):
    """Input data is missing or malformed; the message names the file and line."""


class CommError(HpctrainError):
    """A collective was called with arguments that cannot work (dtype, size, op, layout)."""


class EmbeddingError(HpctrainError):
    """An embedding id or table is invalid; the message names the table and id."""


class PSError(HpctrainError):
    """A parameter-server request failed or a server stopped; the message names the rank."""


class CheckpointError(HpctrainError):
    """A checkpoint is missing, truncated, foreign or incompatible with the config."""


class NonFiniteError(HpctrainError):
    """A training step met a NaN or Inf; the message names the step, tensor and rank."""
