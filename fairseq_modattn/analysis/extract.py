"""What the analysis commands measure and draw, read out of a model on a data split.

Every function takes a loaded (model, task) (``loading.load_model``) and runs the model's
teacher-forced forward, exactly the computation of validation, on the split's sentences:

    measure_redundancy   LR / HR over a split (``redundancy``), paper Tables 2-3 and Fig. 3
    cluster_top_tokens   the token types with the highest mean posterior per DMA cluster (Fig. 4)
    sentence_clusters    one sentence's cluster probabilities and semantic mask (Fig. 5)
    layer_queries        the queries of one layer, per head, for a 2-D projection (Fig. 6)
    tim_competition      one sentence's TIM competition per layer
    rim_activation       one sentence's RIM activation per layer
"""

from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import numpy as np
import torch

from ..models.attention_types import key_stack, query_stack
from . import AnalysisError
from .capture import (
    attention_modules,
    describe_module,
    dma_posteriors,
    dma_semantic_mask,
    forward_sample,
    query_padding_mask,
    record_attention,
    record_modules,
    require_dma,
)
from .loading import iterate_batches, model_name, split_size
from .redundancy import RedundancyAccumulator, RedundancyResult

Log = Optional[Callable[[str], None]]


#: the tokens of a stack's positions: the encoder reads the source, the decoder the target
STACK_SIDES = {"encoder": "source", "decoder": "target"}


def query_side(attention_type: str) -> str:
    """Whose tokens the queries of ``attention_type`` are: 'source' or 'target'."""
    return STACK_SIDES[query_stack(attention_type)]


def key_side(attention_type: str) -> str:
    return STACK_SIDES[key_stack(attention_type)]


def side_tokens(sample: dict, side: str):
    """(B, T) token ids of a side: the source, or the decoder input (target shifted right)."""
    net_input = sample["net_input"]
    return net_input["src_tokens"] if side == "source" else net_input["prev_output_tokens"]


def side_dictionary(task, side: str):
    return task.source_dictionary if side == "source" else task.target_dictionary


def token_strings(dictionary, ids) -> List[str]:
    return [dictionary[i] for i in ids if i != dictionary.pad()]


def sentence_sample(task, model, subset: str, index: int) -> dict:
    """A batch holding sentence ``index`` of ``subset`` alone, on the model's device."""
    from fairseq import utils

    size = split_size(task, subset)
    if not 0 <= index < size:
        raise AnalysisError(
            f"--sentence {index} is out of range: split {subset!r} has {size} sentences (0..{size - 1})")
    dataset = task.dataset(subset)
    sample = dataset.collater([dataset[index]])
    return utils.move_to_cuda(sample) if next(model.parameters()).device.type == "cuda" else sample


ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def pick_layer(modules: List[Tuple[str, ModuleT]], layer: Optional[int]) -> Tuple[str, ModuleT]:
    """Layer ``layer`` (1-based; None = the last) of ``modules``."""
    if layer is None:
        return modules[-1]
    if not 1 <= layer <= len(modules):
        raise AnalysisError(
            f"--layer {layer} is out of range: the model has {len(modules)} such layers (1..{len(modules)})")
    return modules[layer - 1]


def check_head(module, head: int) -> int:
    """0-based index of the 1-based ``head``."""
    if not 1 <= head <= module.num_heads:
        raise AnalysisError(
            f"--head {head} is out of range: the layer has {module.num_heads} heads (1..{module.num_heads})")
    return head - 1


def measure_redundancy(
    model, task, subset: str, attention_type: str = "enc_self", max_tokens: int = 4000,
    max_batches: Optional[int] = None, log: Log = None,
) -> RedundancyResult:
    """LR and HR of ``attention_type`` over the real query positions of ``subset``."""
    size = split_size(task, subset)
    pad = side_dictionary(task, query_side(attention_type)).pad()
    accumulator, seen = RedundancyAccumulator(), 0
    with record_attention(model, attention_type) as recorder:
        for index, sample in enumerate(iterate_batches(task, model, subset, max_tokens, max_batches=max_batches)):
            forward_sample(model, sample)
            accumulator.add(recorder.layer_weights(), query_padding_mask(sample, attention_type, pad))
            seen += sample["nsentences"]
            if log is not None and (index % 20 == 0 or seen == size):
                log(f"redundancy ({attention_type}): {seen}/{size} sentences")
    return accumulator.result()


def cluster_top_tokens(
    model, task, subset: str, attention_type: str = "enc_self", layer: Optional[int] = None, head: int = 1,
    top_k: int = 10, min_count: int = 3, max_batches: Optional[int] = None,
) -> Tuple[List[List[Tuple[str, float]]], str]:
    """Per cluster of one head's token GMM: the ``top_k`` query-side token types (seen at least
    ``min_count`` times in the split, special symbols excluded) with the highest mean posterior
    p(c | token). Returns (one list of (token, mean posterior) per cluster, module name)."""
    name, module = pick_layer(require_dma(model, attention_type), layer)
    h = check_head(module, head)
    side = query_side(attention_type)
    dictionary = side_dictionary(task, side)
    sums = torch.zeros(len(dictionary), module.num_clusters, dtype=torch.float64)
    counts = torch.zeros(len(dictionary), dtype=torch.float64)
    with record_modules([(name, module)], inputs=True) as recorder:
        for sample in iterate_batches(task, model, subset, max_batches=max_batches):
            forward_sample(model, sample)
            posteriors = dma_posteriors(module, recorder.inputs[name][0])[:, h]  # (B, T, C)
            tokens = side_tokens(sample, side).cpu()
            real = tokens.ne(dictionary.pad())
            sums.index_add_(0, tokens[real], posteriors[real].double())
            counts.index_add_(0, tokens[real], torch.ones(int(real.sum()), dtype=torch.float64))
    specials = {dictionary.bos(), dictionary.pad(), dictionary.eos(), dictionary.unk()}
    eligible = [i for i in range(len(dictionary)) if counts[i] >= min_count and i not in specials]
    if not eligible:
        raise AnalysisError(f"no token occurs {min_count} times in split {subset!r}: lower --min-count")
    scores = sums[eligible] / counts[eligible].unsqueeze(1)
    clusters = []
    for c in range(module.num_clusters):
        order = torch.argsort(scores[:, c], descending=True)[:top_k]
        clusters.append([(dictionary[eligible[i]], float(scores[i, c])) for i in order])
    return clusters, f"{describe_module(name)}, head {head}"


def sentence_clusters(
    model, task, subset: str, index: int, attention_type: str = "enc_self", layer: Optional[int] = None,
    head: int = 1,
) -> Dict:
    """One sentence through one DMA module: query tokens, key tokens, the head's cluster
    probabilities P^q (T, C) and its semantic mask M = P^q (P^k)^T (T, S)."""
    name, module = pick_layer(require_dma(model, attention_type), layer)
    h = check_head(module, head)
    sample = sentence_sample(task, model, subset, index)
    with record_modules([(name, module)], inputs=True) as recorder:
        forward_sample(model, sample)
    x_query, x_key = recorder.inputs[name]
    p_query = dma_posteriors(module, x_query)[0, h]
    p_key = dma_posteriors(module, x_key)[0, h]
    q_tokens = token_strings(side_dictionary(task, query_side(attention_type)),
                             side_tokens(sample, query_side(attention_type))[0].tolist())
    k_tokens = token_strings(side_dictionary(task, key_side(attention_type)),
                             side_tokens(sample, key_side(attention_type))[0].tolist())
    return {
        "module": f"{describe_module(name)}, head {head}",
        "tokens": q_tokens,
        "key_tokens": k_tokens,
        "posteriors": p_query.numpy(),
        "mask": dma_semantic_mask(p_query, p_key).numpy(),
    }


def layer_queries(
    model, task, subset: str, attention_type: str = "dec_self", layer: Optional[int] = None,
    max_points: int = 2000, max_batches: Optional[int] = None,
) -> Tuple[np.ndarray, np.ndarray, str]:
    """The projected queries of one layer at real positions, every head's query of a position a
    point: (points (N, d), head index (N,) 0-based, module name), at most ``max_points``."""
    name, module = pick_layer(attention_modules(model, attention_type), layer)
    pad = side_dictionary(task, query_side(attention_type)).pad()
    points, heads, total = [], [], 0
    with record_modules([(name, module)], queries=True) as recorder:
        for sample in iterate_batches(task, model, subset, max_batches=max_batches):
            forward_sample(model, sample)
            queries = recorder.queries[name]  # (B, H, T, d)
            rows = queries.permute(0, 2, 1, 3)[query_padding_mask(sample, attention_type, pad)]  # (R, H, d)
            points.append(rows.reshape(-1, rows.size(-1)))
            heads.append(torch.arange(rows.size(1)).repeat(rows.size(0)))
            total += points[-1].size(0)
            if total >= max_points:
                break
    return torch.cat(points)[:max_points].numpy(), torch.cat(heads)[:max_points].numpy(), describe_module(name)


def tim_competition(model, task, subset: str, index: int, side: str = "encoder") -> Dict:
    """One sentence's competition c (T, n_s) in each TIM layer of the encoder (or decoder)."""
    if not hasattr(model, "competition"):
        raise AnalysisError(
            f"this {model_name(model)} model has no TIM layers: competition plots need a tim_transformer checkpoint")
    sample = sentence_sample(task, model, subset, index)
    forward_sample(model, sample)
    layers = {name: c for name, c in model.competition().items() if name.startswith(side + ".")}
    if not layers:
        raise AnalysisError(f"the model has no TIM layers in its {side} (see --tim-{side}-layers)")
    if all(c is None for c in layers.values()):
        raise AnalysisError("the TIM layers were trained without competition (--tim-no-competition): nothing to show")
    token_side = STACK_SIDES[side]
    tokens = token_strings(side_dictionary(task, token_side), side_tokens(sample, token_side)[0].tolist())
    return {
        "tokens": tokens,
        "competition": {describe_module(name): c[0].float().cpu().numpy()
                        for name, c in layers.items() if c is not None},
    }


def rim_activation(model, task, subset: str, index: int) -> Dict:
    """One sentence's RIM activation per encoder layer: (T, n), the fraction of directions in
    which each RIM was active at each token (0 or 1 for a unidirectional encoder)."""
    if not hasattr(model, "rim_activations"):
        raise AnalysisError(
            f"this {model_name(model)} model has no RIM encoder: activation plots need a rim_lstm checkpoint")
    sample = sentence_sample(task, model, subset, index)
    forward_sample(model, sample)
    tokens = token_strings(task.source_dictionary, sample["net_input"]["src_tokens"][0].tolist())
    return {
        "tokens": tokens,
        "activation": {f"layer {i + 1}": a[0].float().mean(dim=1).cpu().numpy()
                       for i, a in model.rim_activations().items()},
    }
