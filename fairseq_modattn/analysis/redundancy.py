"""Attention redundancy: LR (within a layer) and HR (between all heads of the model).

DMA paper (Chien & Huang), section 5, after Tables 2-3 and Fig. 3; definitions in docs/design.md,
"Evaluation definitions". For one query row, let A^1..A^H be the attention distributions of a
layer's H heads over the same keys, entropies in bits (0 log 0 = 0):

    GJS(A^1..A^H) = H(mean_h A^h) - mean_h H(A^h)           (generalised Jensen-Shannon, <= log2 H)
    LR = mean over layers and query rows of (log2 H - GJS) / log2 H
    JS2(A^a, A^b) = H((A^a + A^b) / 2) - (H(A^a) + H(A^b)) / 2      (in [0, 1])
    R_ab = mean over query rows of 1 - JS2(A^a, A^b)        (the head-redundancy matrix, Fig. 3)
    HR = mean over all head pairs a != b of the whole model (every layer's heads) of R_ab

Identical heads give LR = HR = 1; heads with disjoint supports give 0. Query rows are the real
(non-padding) query positions of a data split, each row weighted equally; every layer sees the
same rows, so "mean over layers and rows" is one mean. Lower is less redundant.
"""

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from . import AnalysisError

LOG2 = math.log(2.0)


def entropy_bits(p: Tensor) -> Tensor:
    """Shannon entropy in bits over the last axis, 0 log 0 = 0."""
    return -torch.special.xlogy(p, p).sum(-1) / LOG2


def layer_redundancy(rows: Tensor) -> Tensor:
    """LR of each query row, (R,), from one layer's weights (R, H, S) with H >= 2."""
    heads = rows.size(1)
    gjs = entropy_bits(rows.mean(dim=1)) - entropy_bits(rows).mean(dim=1)
    return (math.log2(heads) - gjs) / math.log2(heads)


def pairwise_similarity_sum(rows: Tensor, max_elements: int = 1 << 24) -> Tensor:
    """sum over query rows of 1 - JS2(A^a, A^b), an (N, N) matrix, from (R, N, S) weights.

    The mixture entropy of every pair needs an (r, N, N, S) block; rows are taken in chunks
    of at most ``max_elements`` such entries.
    """
    count, heads, keys = rows.shape
    own = entropy_bits(rows)  # (R, N)
    total = rows.new_zeros(heads, heads)
    chunk = max(1, max_elements // max(1, heads * heads * keys))
    for start in range(0, count, chunk):
        p = rows[start:start + chunk]
        mixture = entropy_bits(0.5 * (p.unsqueeze(2) + p.unsqueeze(1)))  # (r, N, N)
        own_p = own[start:start + chunk]
        js = mixture - 0.5 * (own_p.unsqueeze(2) + own_p.unsqueeze(1))
        total += (1.0 - js).sum(dim=0)
    return total


def gather_rows(weights: Tensor, query_mask: Optional[Tensor]) -> Tensor:
    """(B, H, T, S) -> (R, H, S) over the real query positions of ``query_mask`` (B, T)."""
    rows = weights.permute(0, 2, 1, 3)
    if query_mask is None:
        return rows.reshape(-1, rows.size(2), rows.size(3))
    return rows[query_mask.bool()]


@dataclass
class RedundancyResult:
    lr: float
    hr: float
    lr_per_layer: List[float]
    matrix: List[List[float]]  # R_ab over all heads, layer-major
    labels: List[str]  # "L1H1", ... in the order of the matrix
    heads_per_layer: int
    rows: int  # query rows averaged over

    def matrix_array(self):
        import numpy as np

        return np.asarray(self.matrix)

    def as_dict(self) -> Dict:
        return {
            "LR": self.lr, "HR": self.hr, "LR_per_layer": self.lr_per_layer,
            "heads_per_layer": self.heads_per_layer, "layers": len(self.lr_per_layer),
            "query_rows": self.rows, "head_labels": self.labels, "head_redundancy_matrix": self.matrix,
        }


@dataclass
class RedundancyAccumulator:
    """Sums over batches: ``add`` each batch's per-layer weights, then ``result``."""

    lr_sums: Optional[Tensor] = None
    pair_sums: Optional[Tensor] = None
    rows: int = 0
    heads: int = 0
    layers: int = 0

    def add(self, layer_weights: Sequence[Tensor], query_mask: Optional[Tensor] = None):
        """``layer_weights``: one (B, H, T, S) tensor per layer, same B, H, T, S; ``query_mask``
        (B, T) True on real queries. Rows must be distributions over the keys."""
        if not layer_weights:
            raise AnalysisError("no attention layers to measure")
        shapes = {tuple(w.shape) for w in layer_weights}
        if len(shapes) != 1:
            raise AnalysisError(f"every layer must give weights of one shape (B, H, T, S), got {sorted(shapes)}")
        heads = layer_weights[0].size(1)
        if heads < 2:
            raise AnalysisError("redundancy needs at least 2 heads per layer (log2 H = 0 for one head)")
        if self.layers and (heads, len(layer_weights)) != (self.heads, self.layers):
            raise AnalysisError("batches disagree on the number of layers or heads")
        self.heads, self.layers = heads, len(layer_weights)
        per_layer = [gather_rows(w.double(), query_mask) for w in layer_weights]  # each (R, H, S)
        if per_layer[0].size(0) == 0:
            return
        sums = torch.stack([layer_redundancy(rows).sum() for rows in per_layer])
        pairs = pairwise_similarity_sum(torch.cat(per_layer, dim=1))
        self.lr_sums = sums if self.lr_sums is None else self.lr_sums + sums
        self.pair_sums = pairs if self.pair_sums is None else self.pair_sums + pairs
        self.rows += per_layer[0].size(0)

    def result(self) -> RedundancyResult:
        if self.rows == 0:
            raise AnalysisError("no query rows were seen: the split is empty or every position is padding")
        lr_sums, pair_sums = self.lr_sums, self.pair_sums
        assert lr_sums is not None and pair_sums is not None  # set by the add() that counted rows
        lr_layers = (lr_sums / self.rows).tolist()
        matrix = pair_sums / self.rows
        n = matrix.size(0)
        off_diagonal = ~torch.eye(n, dtype=torch.bool)
        labels = [f"L{layer + 1}H{head + 1}" for layer in range(self.layers) for head in range(self.heads)]
        return RedundancyResult(
            lr=float(sum(lr_layers) / len(lr_layers)),
            hr=float(matrix[off_diagonal].mean()),
            lr_per_layer=lr_layers,
            matrix=matrix.tolist(),
            labels=labels,
            heads_per_layer=self.heads,
            rows=self.rows,
        )
