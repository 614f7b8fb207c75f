"""Registered models; importing a file registers its model and named architectures."""

from . import dma_transformer  # noqa: F401
from . import tim_transformer  # noqa: F401
from . import talking_heads_transformer  # noqa: F401
from . import rim_lstm  # noqa: F401
