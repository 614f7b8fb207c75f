"""fairseq_modattn: DMA, talking-heads, TIM and RIM attention variants as a fairseq plugin.

Load with ``--user-dir fairseq_modattn`` (or ``import fairseq_modattn``). fairseq's
``--user-dir`` imports only ``models/`` and ``tasks/`` by itself, so this file imports the
rest; ``compat`` first, because it restores fairseq behaviour everything else relies on.
"""

from . import compat  # noqa: F401  (documented fairseq/torch fixes; see compat.py)
from . import criterions, models, modules  # noqa: F401

__version__ = "0.1.0"
