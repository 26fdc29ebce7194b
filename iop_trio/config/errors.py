"""The one error of the configuration: :class:`ConfigError`, whose message names the
file and the key path."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the key."""
