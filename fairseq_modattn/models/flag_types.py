"""argparse types of this package's model flags.

fairseq parses ``--arch``-specific flags with the ``add_args`` of the model class, so a value
that argparse accepts reaches the model unchanged. Python's ``float`` accepts ``nan`` and
``inf``, and comparisons with NaN are all false: ``--dma-noise-var nan`` would pass every range
check and surface only at the first update, as an unrelated ``StopIteration`` deep inside
training. ``finite_float`` rejects such values while argparse still holds the flag's name, so
``fairseq-train`` stops at start-up with one line:
``fairseq-train: error: argument --dma-noise-var: must be a finite number, got 'nan'``.
"""

import argparse
import math


def finite_float(text: str) -> float:
    """A float that is neither NaN nor infinite (argparse ``type=``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def check_finite(value: float, flag: str, minimum: float = None, exclusive: bool = False):
    """ValueError naming FLAG unless VALUE is finite (and >= MINIMUM, or > with EXCLUSIVE).

    For configurations that did not come through argparse (a saved config, a test, Python code);
    NaN fails every comparison, so it is tested first."""
    if not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number, got {value}")
    if minimum is not None and (value <= minimum if exclusive else value < minimum):
        raise ValueError(f"{flag} must be {'>' if exclusive else '>='} {minimum:g}, got {value}")
