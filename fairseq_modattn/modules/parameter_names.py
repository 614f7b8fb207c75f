"""What a parameter check calls the values it checks.

A module checks its own constructor parameters and names them by their parameter names. A
model family runs the same check on its flags before it builds anything, passing the flag it
reads each parameter from, so that ``fairseq-train`` refuses a bad value in one line naming
the flag. Each check is thus written once, in the module, and each layer speaks its own names.
"""

from typing import Mapping, Optional


class ParameterNames(dict):
    """{parameter: what the caller calls it}; a parameter left out is called by its own name."""

    def __missing__(self, parameter: str) -> str:
        return parameter


def parameter_names(names: Optional[Mapping[str, str]] = None) -> ParameterNames:
    return ParameterNames(names or {})
