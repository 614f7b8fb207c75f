"""``fairseq-train``, recording what each rank hands to fairseq's cross-rank stats sync.

Test instrumentation for tests/test_distributed.py, not part of the package. fairseq sums the
logging outputs of all ranks with a single all-reduce of flat buffers built from each rank's
OWN keys (``Trainer._fast_stat_sync_sum`` -> ``distributed_utils.all_reduce_dict``, fairseq
0.12), splitting values into a CPU buffer (Python numbers) and a device buffer (tensors). Ranks
whose keys, key order or value kinds differ would add unrelated numbers or fail, so the
criterion must emit the same keys on every rank, also for the dummy batch a rank trains on
when it has run out of data. Before each sync this wrapper appends one JSON line to
``$SYNC_RECORD_DIR/rank{R}.jsonl``: the update number, whether fairseq ignores this rank's
outputs (dummy batch), and the ordered ``[key, "tensor"|"number"]`` pairs of every logging
output; then it runs fairseq's own training entry point unchanged.
"""

import json
import os
import sys

# Not sorted: fairseq_cli.train must come first, since importing it sets up fairseq-train's log
# format, which an earlier `import fairseq` would pre-empt (sorted, rank 0 logged no train_inner lines).
# isort: off
from fairseq_cli.train import cli_main

import torch
from fairseq.trainer import Trainer
# isort: on

_aggregate = Trainer._aggregate_logging_outputs


def _kind(value) -> str:
    return "tensor" if torch.is_tensor(value) else "number"


def recording_aggregate(self, logging_outputs, *extra_stats_to_sum, ignore=False):
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    record = {
        "update": self.get_num_updates(),
        "training": self.model.training,
        "ignore": bool(ignore),
        "outputs": [[[key, _kind(value)] for key, value in log.items()] for log in logging_outputs],
    }
    with open(os.path.join(os.environ["SYNC_RECORD_DIR"], f"rank{rank}.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return _aggregate(self, logging_outputs, *extra_stats_to_sum, ignore=ignore)


Trainer._aggregate_logging_outputs = recording_aggregate

if __name__ == "__main__":
    sys.exit(cli_main())
