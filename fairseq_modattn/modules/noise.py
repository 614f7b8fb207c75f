"""DMA's Gaussian noise: where it is drawn, and drawing it again in backward instead of keeping it.

DMA samples its attention inputs and queries, z~ = z + s eps (paper, 4.3; ``sample_inputs``),
with as many noise values as the layers have activations. Every draw goes through
``standard_normal`` (or ``ReplayableNoise``), which takes one of two generators by the device's
code path (``device_paths.path_device``):

* on the CPU, ``native_normal``'s Philox4x32-10 stream under a 64-bit key that is itself drawn
  from torch's generator, so ``torch.manual_seed`` (fairseq's ``--seed``) fixes the values, as it
  fixes everything else; ~2x faster than torch's CPU generator with AVX-512;
* on a GPU (and on the CPU where the library cannot be built), torch's generator.

The sample is kept for backward by the layers that read it, and the GMM clusters it; its KL is
taken at the mean z = z~ - s eps, which backward needs too. Keeping eps (or z) would cost one
more activation per module, as large as the layer's input; ``ReplayableNoise`` keeps the key
(torch's path: the generator's state, as activation checkpointing does) and draws eps again
when backward asks for it: the same values, one more draw.
"""

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import native_normal
from .device_paths import path_device

Layout = Tuple[torch.Size, torch.dtype, torch.device]


def uses_native(device: torch.device) -> bool:
    """Whether draws for ``device`` take the native CPU generator (module docstring)."""
    return device.type == "cpu" and path_device(device) == "cpu" and native_normal.library() is not None


def cpu_generator() -> str:
    """Which generator CPU draws take, for a benchmark's header: "philox (N lanes)" or "torch"."""
    lib = native_normal.library()
    return "torch" if lib is None else f"philox ({lib.modattn_normal_lanes(0)} lanes)"


def draw_key() -> int:
    """A key for the native stream: 63 bits from torch's global CPU generator."""
    return int(torch.empty((), dtype=torch.int64).random_())


def native_draw(shape: Sequence[int], dtype: torch.dtype, device: torch.device, key: int) -> Tensor:
    """The native stream of ``key`` as a contiguous tensor of ``shape``, drawn in fp32 and cast
    to ``dtype``."""
    out = native_normal.fill(torch.empty(shape, dtype=torch.float32, device=device), key)
    return out if dtype == torch.float32 else out.to(dtype)


def standard_normal(shape: Sequence[int], dtype: torch.dtype, device: Union[torch.device, str]) -> Tensor:
    """A contiguous tensor of standard normal values (module docstring: which generator)."""
    device = torch.device(device)
    if uses_native(device):
        return native_draw(shape, dtype, device, draw_key())
    return torch.randn(shape, dtype=dtype, device=device)


def standard_normal_like(t: Tensor) -> Tensor:
    """``standard_normal`` with ``t``'s shape, dtype and device (contiguous, whatever ``t``'s layout)."""
    return standard_normal(t.shape, t.dtype, t.device)


def _generator_state(device: torch.device) -> Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


class ReplayableNoise:
    """Standard normal draws, as ``standard_normal`` draws them, that ``replay`` reproduces
    exactly later without touching the generators' current state.

    ``draw(*like)`` returns one contiguous tensor per entry of ``like``, a tensor (its shape,
    dtype and device) or a (shape, dtype, device) triple, drawn one after the other. Call it once.
    """

    def __init__(self):
        self._layouts: List[Layout] = []
        self._keys: Optional[List[int]] = None  # native path: one key per tensor
        self._state: Optional[Tensor] = None  # torch's path: the generator's state before the draws

    def draw(self, *like: Union[Tensor, Tuple[Sequence[int], torch.dtype, torch.device]]) -> List[Tensor]:
        if self._keys is not None or self._state is not None:
            raise RuntimeError("ReplayableNoise.draw is called once; replay() repeats it")
        for t in like:
            shape, dtype, device = (t.shape, t.dtype, t.device) if torch.is_tensor(t) else t
            self._layouts.append((torch.Size(shape), dtype, device))
        device = self._layouts[0][2]
        if uses_native(device):
            self._keys = [draw_key() for _ in self._layouts]
        else:
            self._state = _generator_state(device)
        return self._sample()

    def _sample(self) -> List[Tensor]:
        if self._keys is not None:
            return [native_draw(*layout, key) for layout, key in zip(self._layouts, self._keys)]
        return [torch.randn(shape, dtype=dtype, device=device) for shape, dtype, device in self._layouts]

    def replay(self) -> List[Tensor]:
        """The tensors ``draw`` returned, drawn again; the generators' state is left as it was."""
        if self._keys is not None:
            return self._sample()
        if self._state is None:
            raise RuntimeError("ReplayableNoise.replay repeats a draw: call draw() first")
        device = self._layouts[0][2]
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda, device_type=device.type):
            if device.type == "cuda":
                torch.cuda.set_rng_state(self._state, device)
            else:
                torch.set_rng_state(self._state)
            return self._sample()
