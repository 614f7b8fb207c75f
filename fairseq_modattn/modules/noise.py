"""Gaussian noise that backward draws again instead of keeping it (DMA's training samples).

DMA samples its attention inputs and queries, z~ = z + s eps (paper, 4.3; ``sample_inputs``).
The sample is kept for backward by the layers that read it, and the GMM clusters it; its KL is
taken at the mean z = z~ - s eps, which backward needs too. Keeping eps (or z) would cost one
more activation per module, as large as the layer's input; ``ReplayableNoise`` keeps the random
generator's state instead, as activation checkpointing does, and draws eps again when backward
asks for it: the same values, one more launch.
"""

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor


def _generator_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


class ReplayableNoise:
    """Standard normal draws shaped like given tensors, from torch's global generator, that
    ``replay`` reproduces exactly later without touching the generator's current state.

    ``draw(*like)`` returns one tensor per entry of ``like``, drawn one after the other: for a
    tensor, as ``torch.randn_like`` draws (its shape, strides, dtype and device); for a
    (shape, dtype, device) triple, as ``torch.randn`` draws. Call it once.
    """

    def __init__(self):
        self._layouts: List[Tuple[torch.Size, Tuple[int, ...], torch.dtype, torch.device]] = []
        self._state: Optional[Tensor] = None

    def draw(self, *like: Union[Tensor, Tuple[Sequence[int], torch.dtype, torch.device]]) -> List[Tensor]:
        if self._state is not None:
            raise RuntimeError("ReplayableNoise.draw is called once; replay() repeats it")
        for t in like:
            if torch.is_tensor(t):
                self._layouts.append((t.shape, t.stride(), t.dtype, t.device))
            else:
                shape, dtype, device = t
                self._layouts.append((torch.Size(shape), torch.empty(shape, device="meta").stride(), dtype, device))
        self._state = _generator_state(self._layouts[0][3])
        return self._sample()

    def _sample(self) -> List[Tensor]:
        return [torch.empty_strided(shape, stride, dtype=dtype, device=device).normal_()
                for shape, stride, dtype, device in self._layouts]

    def replay(self) -> List[Tensor]:
        """The tensors ``draw`` returned, drawn again; the generator's state is left as it was."""
        if self._state is None:
            raise RuntimeError("ReplayableNoise.replay repeats a draw: call draw() first")
        device = self._layouts[0][3]
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=device.type):
            if device.type == "cuda":
                torch.cuda.set_rng_state(self._state, device)
            else:
                torch.set_rng_state(self._state)
            return self._sample()
