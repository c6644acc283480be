"""User-facing errors.

Anything a user can cause (bad settings, missing files, prompts that do not fit) raises
:class:`VerispecError`; the CLI prints its message on one line instead of a traceback.
"""


class VerispecError(Exception):
    """An error caused by input or environment, with a message meant for the user."""
