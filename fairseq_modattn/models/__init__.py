"""Registered models; importing a file registers its model and named architectures."""

# isort: off  (the families register in this order, which is the order fairseq lists them in --arch)
from . import (
    dma_transformer,  # noqa: F401
    rim_lstm,  # noqa: F401
    talking_heads_transformer,  # noqa: F401
    tim_transformer,  # noqa: F401
)
# isort: on
