"""The error every configuration problem raises."""


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key."""
