"""The two errors users see: a request that cannot be served as given, a configuration that cannot load.
Both name the field to fix."""
from __future__ import annotations


class RequestError(ValueError):
    """A request cannot be served as given; `field` names what the client must fix."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class ConfigError(ValueError):
    """A configuration value is invalid; `field` names the key to fix."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
