"""The one error type every layer raises for bad input.

The CLI turns a ``CortiqError`` into a one-line message and a non-zero exit;
anything else is a bug and keeps its traceback.
"""


class CortiqError(Exception):
    """Bad input the user can fix: a missing file, a foreign format, a shape mismatch."""
