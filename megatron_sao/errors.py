"""Errors that are the user's to fix, not bugs, and the two ways a run stops before its last step.

`sao` prints a `UserError` (and a `config.ConfigError`) as one line naming what is wrong (the config
key, the file, the tensor) and exits with status 2; any other exception is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """Bad input: the message alone tells the user what to fix."""


class MissingInputError(UserError, FileNotFoundError):
    """An input file or directory the user named (in the config or on the command line) is not there."""


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (non-finite steps, dead rollout engine, failed weight sync); a
    checkpoint was written."""


class TrainingInterrupted(RuntimeError):
    """Ctrl-C / SIGTERM: the current step finished, a checkpoint was written, the run ended."""
