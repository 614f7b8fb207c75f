"""``DataError``: the one error data preparation raises for bad or missing input.

Its message names the file (and the 1-based line) and says what was expected, so
``fairseq-modattn prepare`` prints it as one line, without a traceback.
"""

from pathlib import Path
from typing import Optional, Union


class DataError(Exception):
    """Bad or missing input: the message names the file (and 1-based line) and what was expected."""

    def __init__(self, message: str, path: Optional[Union[str, Path]] = None, line: Optional[int] = None):
        self.path = None if path is None else str(path)
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
