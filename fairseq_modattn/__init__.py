"""fairseq_modattn: DMA, talking-heads, TIM and RIM attention variants as a fairseq plugin.

Load with ``--user-dir fairseq_modattn`` (or ``import fairseq_modattn``). fairseq's
``--user-dir`` imports only ``models/`` and ``tasks/`` by itself, so this file imports the
rest; ``compat`` first, because it restores fairseq behaviour everything else relies on (and
two of its fixes must act around fairseq's first import).

In Python, each model class's ``from_pretrained(...).translate(text)`` (and
``fairseq_modattn.from_pretrained`` for any checkpoint) applies the data-bin's recorded text
pipeline: ``models/hub_interface.py``, docs/python_api.md.
"""

from . import compat

compat.apply()  # the documented fairseq/torch fixes, in order (fairseq_modattn/compat/__init__.py)

from . import criterions, models, modules  # noqa: E402,F401  (after the fixes they rely on)
from .models.hub_interface import FromPretrainedError, from_pretrained  # noqa: E402,F401  (the Python API)

__version__ = "0.1.0"
