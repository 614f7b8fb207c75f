"""The source text of an installed fairseq function, which each fix reads to decide whether the
behaviour it corrects is there.

A fix that probes the code instead of the version number stays right for every fork and
release: ``fairseq-fixed`` 0.12.3.x already differs from 0.12.2, and a release that corrects a
behaviour makes its fix a no-op without anyone having to change a version table.
"""

import inspect


def source_of(function) -> str:
    """FUNCTION's source; "" where it cannot be read, so that no fix is applied then."""
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""
