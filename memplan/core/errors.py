"""The one exception type the library raises for bad user input.

The CLI turns it into a one-line message on stderr and exit code 2.
"""


class MemplanError(ValueError):
    """Bad input: an inconsistent spec, an unknown preset, an unparsable size."""
