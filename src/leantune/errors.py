"""User-facing errors.

Every problem caused by user input (a path, a file, a flag) is raised as `LeantuneError` with a
one-line message that names the file, line or field and says what to do. The CLI prints the
message and exits with code 2, never a traceback.
"""


class LeantuneError(Exception):
    """A user-facing error: one line, names the culprit, says what to do."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
