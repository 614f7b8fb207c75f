"""Small models of every family for CPU-sized comparisons (``quickstart``, ``benchmarks/multi30k.py``).

Every transformer recipe is fairseq's transformer at 2 + 2 layers, width 128, FFN 256, 4 heads,
with all embeddings shared (about 1.7 M parameters on an 8k joint BPE vocabulary); the method
changes only what the method is. The two LSTM recipes are sized to the same parameter budget.
All of them train with the same optimiser, schedule and batch size (``TRAIN_FLAGS``), so a
budget in updates is an equal training budget.

DMA trains with the tiny preset's own settings (``dma_transformer_iwslt_de_en_tiny``: Table 5's
c_qq 50, c_xq 5, c_kl 0.01, c_grad 10, n_c 4, and the paper's annealing rate 5e-4) under the
authors' objective, the preset's default: it sums each regulariser over sentences and divides
by the target tokens, so Table 5's weights apply unchanged (per-token means over all modules
would weigh the regularisers several times more and need hand-tuned weights);
``benchmarks/dma_objective.py`` measures the preset as it is (docs/results.md).
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

#: optimiser, schedule, regularisation and batch size, identical for every recipe
TRAIN_FLAGS = [
    "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--clip-norm", "0.0",
    "--lr", "2e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "200",
    "--dropout", "0.1", "--weight-decay", "0.0001", "--label-smoothing", "0.1",
    "--max-tokens", "4096",
]

TRANSFORMER_SIZE = [
    "--encoder-layers", "2", "--decoder-layers", "2",
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128",
    "--encoder-ffn-embed-dim", "256", "--decoder-ffn-embed-dim", "256",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
    "--share-all-embeddings",
]

_LSTM_DECODER = [
    "--encoder-embed-dim", "128", "--decoder-embed-dim", "128", "--decoder-out-embed-dim", "128",
    "--decoder-layers", "1", "--decoder-hidden-size", "176", "--share-all-embeddings",
]


@dataclass(frozen=True)
class ModelRecipe:
    """One model of the comparison: its fairseq-train flags and what it is."""

    name: str
    description: str
    flags: List[str] = field(default_factory=list)
    criterion: str = "label_smoothed_cross_entropy"
    #: True for models with fairseq multi-head attention, whose head redundancy can be measured
    has_attention_heads: bool = True
    #: the family whose baseline this model is compared with ("transformer" or "lstm")
    family: str = "transformer"

    def train_flags(self) -> List[str]:
        """Everything fairseq-train needs besides the data, --user-dir, --save-dir and the budget."""
        return [*self.flags, "--criterion", self.criterion, *TRAIN_FLAGS]

    def train_command(self, data, save_dir, *, seed: int, max_update: int, max_epoch: Optional[int] = None,
                      keep_last_epochs: int = 1, cpu: bool = True, extra: Sequence[str] = ()) -> List[str]:
        """The complete fairseq-train command line (EXTRA last, so it overrides the recipe)."""
        from .fairseq_commands import PLUGIN_DIR, fairseq_script

        command = [fairseq_script("fairseq-train"), str(data), "--user-dir", str(PLUGIN_DIR),
                   "--save-dir", str(save_dir), "--seed", str(seed), "--max-update", str(max_update),
                   "--keep-last-epochs", str(keep_last_epochs), "--log-format", "simple", "--log-interval", "25",
                   *self.train_flags(), *extra]
        if max_epoch is not None:
            command += ["--max-epoch", str(max_epoch)]
        if cpu:
            command.append("--cpu")
        return command


RECIPES: Dict[str, ModelRecipe] = {r.name: r for r in [
    ModelRecipe("transformer", "fairseq's transformer (the baseline)", ["--arch", "transformer", *TRANSFORMER_SIZE]),
    ModelRecipe("dma", "DMA transformer, n_c = 4",
                ["--arch", "dma_transformer_iwslt_de_en_tiny", *TRANSFORMER_SIZE, "--dma-clusters", "4"],
                criterion="label_smoothed_cross_entropy_with_aux"),
    ModelRecipe("dma_nc8", "DMA transformer, n_c = 8",
                ["--arch", "dma_transformer_iwslt_de_en_tiny", *TRANSFORMER_SIZE, "--dma-clusters", "8"],
                criterion="label_smoothed_cross_entropy_with_aux"),
    ModelRecipe("talking_heads", "talking-heads attention in encoder self-attention (the default --th-attention)",
                ["--arch", "talking_heads_transformer", *TRANSFORMER_SIZE]),
    # --tim-encoder-layers auto would leave a 2-layer encoder without TIM layers (it keeps the
    # first two standard); the second layer becomes TIM, widened to the standard layer's size
    ModelRecipe("tim", "TIM in encoder layer 2 (n_s = 2, parameter-matched)",
                ["--arch", "tim_transformer", *TRANSFORMER_SIZE, "--tim-encoder-layers", "1",
                 "--tim-match-params"]),
    ModelRecipe("rim_lstm", "RIM encoder (6 RIMs, 4 active) under fairseq's LSTM decoder",
                ["--arch", "rim_lstm", *_LSTM_DECODER, "--rim-num", "6", "--rim-top-k", "4", "--rim-size", "32",
                 "--rim-input-key-size", "64", "--rim-input-value-size", "96"],
                has_attention_heads=False, family="lstm"),
    ModelRecipe("lstm", "fairseq's LSTM encoder-decoder with attention (the RIM baseline)",
                ["--arch", "lstm", *_LSTM_DECODER, "--encoder-layers", "1", "--encoder-hidden-size", "176"],
                has_attention_heads=False, family="lstm"),
]}


#: the baseline of each family: every other model of the family is compared with it
FAMILY_BASELINES = {"transformer": "transformer", "lstm": "lstm"}


def recipe(name: str) -> ModelRecipe:
    if name not in RECIPES:
        raise KeyError(f"unknown model {name!r}; choose from {', '.join(RECIPES)}")
    return RECIPES[name]
