"""Data-parallel training of every architecture through the real fairseq-train, on CPU (gloo).

fairseq's contract for data parallelism: N ranks of one batch each take the same step as one
process accumulating the same N batches (``--update-freq N``). Rank r trains on batches
r, r + N, ... of the epoch's shuffled batch list (``ShardedIterator``) and ``--update-freq N``
groups batches kN .. kN + N - 1 into update k (``GroupedIterator``), so both see the same
batches per update; a rank left without a batch at the end of the epoch trains on a dummy batch
whose gradient fairseq ignores, like the missing last member of a short group. Gradients
are summed across ranks and divided by the summed sample size in both cases. The tests compare
2 gloo ranks against 1 process with ``--update-freq 2``: every logged value of every update and
every parameter at the end of an epoch of SGD.

Exactness needs the two runs to draw the same random numbers, which they do not: fairseq
reseeds every rank with ``seed + num_updates`` at each update, so rank 1 draws what rank 0
draws while the second micro-batch of ``--update-freq`` continues rank 0's stream. The
comparison therefore turns off what is random: dropout, DMA's training noise (its variance
must stay positive for the KL, so ``--dma-noise-var 1e-12``: a standard deviation of 1e-6,
far below the comparison's tolerance) and the two mutual-information bounds (their negatives
are sampled; weight 0), whose values are still computed and logged. Everything else of DMA (GMM KL, the
diversity penalty, the annealed mask) is on.

Also here: every rank hands fairseq's stats sync the same keys in the same order with the same
value kinds, in training, on the dummy batch and in validation (``train_recording_sync.py``);
a resumed distributed run reproduces the uninterrupted one; and ``torchrun --nnodes 2`` on
loopback (compat fix 6) trains the same model as explicitly initialised ranks.
"""

import json
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import fairseq_modattn  # noqa: F401  (compat's allow-list for loading checkpoints)
from cli_checks import logged
from conftest import cli_environment, fairseq_cli
from inprocess import batches, build_trainer, train_args

HERE = Path(__file__).resolve().parent
RECORDING_TRAIN = HERE / "train_recording_sync.py"

DETERMINISTIC = {
    "dma": ["--dma-noise-var", "1e-12", "--dma-qq-weight", "0", "--dma-xq-weight", "0"],
    "rim": ["--rim-attention-dropout", "0"],
}
SAMPLED = ("dqq", "dxq")  # the MI bounds' values depend on the sampled negatives
FAMILIES = ("dma", "talking_heads", "tim", "rim")
# An SGD epoch of the 500 training sentences: 27 batches, so rank 1 ends on a dummy batch.
EPOCH = ["--optimizer", "sgd", "--lr", "0.05", "--dropout", "0", "--max-tokens", "650", "--max-epoch", "1",
         "--log-interval", "1", "--no-epoch-checkpoints"]
DISTRIBUTED = ["--distributed-world-size", "2", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]


def family_args(family):
    return [*train_args(family), *EPOCH, *DETERMINISTIC.get(family, [])]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(record_dir=None):
    return cli_environment() if record_dir is None else cli_environment(SYNC_RECORD_DIR=str(record_dir))


def run_together(commands, env, timeout=600):
    """Start every command at once (the ranks of one job); return their combined outputs."""
    procs = [subprocess.Popen([str(a) for a in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env) for cmd in commands]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    failed = [f"process {i} exited {p.returncode}:\n{out[-4000:]}" for i, (p, out) in enumerate(zip(procs, outputs))
              if p.returncode != 0 and not aborted_in_teardown(i, procs, out)]
    assert not failed, f"{commands[0][:3]}\n" + "\n".join(failed)
    return outputs


TEARDOWN_ABORT = "terminate called without an active exception"


def aborted_in_teardown(index, procs, output):
    """Whether process INDEX, a rank other than 0, died of the gloo teardown abort of compat
    fix 8 after its work was done. fairseq ends every rank with a barrier, so rank 0 exiting 0
    means this rank had reached that barrier too: its training, records and checkpoints are
    complete, and what the tests compare is there. The fix makes the abort rare (it destroys the
    process group first), not impossible: on 2026-11-26 it happened to rank 1 of one job in each of
    two fresh-clone suite runs (a RIM job, then a DMA job), and in none of 52 two-rank jobs run in
    a loop in an existing environment. It is reported as a warning, not hidden."""
    if index == 0 or procs[0].returncode != 0 or procs[index].returncode not in (-6, 134):
        return False
    if TEARDOWN_ABORT not in output[-300:]:
        return False
    warnings.warn(f"rank {index} aborted in the gloo teardown after fairseq's closing barrier "
                  f"({TEARDOWN_ABORT!r}; compat fix 8); its work is complete", stacklevel=2)
    return True


def test_only_a_late_teardown_abort_of_another_rank_is_tolerated():
    class Finished:
        def __init__(self, returncode):
            self.returncode = returncode

    late = "... training done\n" + TEARDOWN_ABORT + "\n"
    with pytest.warns(UserWarning, match="aborted in the gloo teardown"):
        assert aborted_in_teardown(1, [Finished(0), Finished(-6)], late)
    assert not aborted_in_teardown(1, [Finished(1), Finished(-6)], late)  # rank 0 did not finish
    assert not aborted_in_teardown(0, [Finished(-6), Finished(0)], late)  # rank 0 itself
    assert not aborted_in_teardown(1, [Finished(0), Finished(1)], late)  # not an abort
    assert not aborted_in_teardown(1, [Finished(0), Finished(-6)], "Segmentation fault\n")


def gloo_ranks(data, save_dir, args, record_dir, world_size=2):
    """One process per rank on an explicit TCP address (docs/design.md, "Hooking into fairseq")."""
    init = ["--distributed-init-method", f"tcp://127.0.0.1:{free_port()}", "--distributed-no-spawn"]
    commands = [[sys.executable, RECORDING_TRAIN, data, *args, *DISTRIBUTED, *init, "--save-dir", save_dir,
                 "--distributed-rank", str(rank)] for rank in range(world_size)]
    return run_together(commands, environment(record_dir))


def single_process(data, save_dir, args):
    cmd = [fairseq_cli("fairseq-train"), data, *args, "--update-freq", "2", "--save-dir", save_dir]
    return run_together([cmd], environment())[0]


def parameters(checkpoint):
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]


def sync_records(record_dir, rank):
    with open(Path(record_dir) / f"rank{rank}.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module", params=FAMILIES)
def epoch_runs(request, multi30k_bin, tmp_path_factory):
    """An SGD epoch of FAMILY on 2 gloo ranks and on 1 process with --update-freq 2."""
    family = request.param
    root = tmp_path_factory.mktemp(f"ddp_{family}")
    args = family_args(family)
    ranks = gloo_ranks(multi30k_bin, root / "ranks", args, record_dir=root)
    single = single_process(multi30k_bin, root / "single", args)
    return {"family": family, "root": root, "args": args, "ranks": ranks, "single": single}


def assert_same_training(output, checkpoint, reference_output, reference_checkpoint):
    """Every logged value of every update, and every parameter afterwards, agree."""
    got, want = logged(output, "train_inner"), logged(reference_output, "train_inner")
    assert sorted(got) == sorted(want) and len(want) >= 8, (sorted(got), sorted(want))
    for update, row in want.items():
        for key, value in row.items():
            if key in ("wps", "ups", "train_wall", "wall") or key in SAMPLED:
                continue
            assert got[update][key] == pytest.approx(value, rel=2e-3, abs=2e-3), (update, key)
    got_valid, want_valid = logged(output, "valid"), logged(reference_output, "valid")
    assert got_valid.keys() == want_valid.keys() and want_valid, reference_output[-2000:]
    for update, row in want_valid.items():
        assert got_valid[update]["loss"] == pytest.approx(row["loss"], rel=1e-4), update
    params, reference = parameters(checkpoint), parameters(reference_checkpoint)
    assert params.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(params[name], tensor, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def test_two_ranks_take_the_steps_of_update_freq_two(epoch_runs):
    """2 ranks x B tokens == 1 process x 2B tokens (--update-freq 2), update by update."""
    root = epoch_runs["root"]
    assert "distributed init (rank 1)" in "".join(epoch_runs["ranks"])
    assert_same_training(epoch_runs["ranks"][0], root / "ranks" / "checkpoint_last.pt",
                         epoch_runs["single"], root / "single" / "checkpoint_last.pt")


def test_every_rank_syncs_the_same_keys(epoch_runs):
    records = [sync_records(epoch_runs["root"], rank) for rank in (0, 1)]
    assert len(records[0]) == len(records[1]) > 0
    for mine, theirs in zip(*records):
        assert mine["update"] == theirs["update"] and mine["training"] == theirs["training"]
        keys = {tuple(map(tuple, output)) for record in (mine, theirs) for output in record["outputs"]}
        assert len(keys) == 1, (mine, theirs)  # one key list: same keys, order and kinds everywhere
    training = [r for r in records[1] if r["training"]]
    assert any(r["ignore"] for r in training), "no dummy batch: the epoch no longer has an odd batch count"
    assert any(not r["training"] for r in records[0]), "validation was not synchronised"
    if epoch_runs["family"] == "dma":
        names = {key for key, _ in records[0][0]["outputs"][0]}
        assert {"ce_loss", "kl", "dqq", "dxq", "div", "gamma"} <= names, names


@pytest.mark.parametrize("epoch_runs", ["dma"], indirect=True)  # the family with the most state
def test_resumed_distributed_run_matches_the_uninterrupted_one(epoch_runs, multi30k_bin, tmp_path):
    """Stop 2 ranks after 4 updates and restart the same command: rank 0 reloads the checkpoint
    and sends it to rank 1 (compat fix 7), and the epoch ends as the uninterrupted one did."""
    save = tmp_path / "ranks"
    gloo_ranks(multi30k_bin, save, [*epoch_runs["args"], "--max-update", "4"], record_dir=tmp_path)
    resumed = gloo_ranks(multi30k_bin, save, epoch_runs["args"], record_dir=tmp_path)
    assert "Loaded checkpoint" in resumed[0] and "@ 4 updates" in resumed[0], resumed[0][-3000:]
    reference = logged(epoch_runs["ranks"][0], "train_inner")
    rows = logged(resumed[0], "train_inner")
    assert sorted(rows) == [u for u in sorted(reference) if u > 4]
    for update, row in rows.items():
        for key in ("loss", "nll_loss", "kl", "div", "gamma", "gnorm"):
            assert row[key] == pytest.approx(reference[update][key], rel=2e-3, abs=2e-3), (update, key)
    root = epoch_runs["root"]
    for name, tensor in parameters(root / "ranks" / "checkpoint_last.pt").items():
        torch.testing.assert_close(parameters(save / "checkpoint_last.pt")[name], tensor, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("epoch_runs", ["tim"], indirect=True)
def test_torchrun_two_nodes_on_loopback(epoch_runs, multi30k_bin, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1`` on 127.0.0.1, without --distributed-world-size
    (one-GPU nodes leave it at 1): both processes join one job (compat fix 6) and train the
    model the explicitly initialised ranks trained."""
    torchrun = Path(sys.executable).parent / "torchrun"
    port = free_port()
    commands = [[torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
                 "--master-addr", "127.0.0.1", "--master-port", str(port), RECORDING_TRAIN, multi30k_bin,
                 *epoch_runs["args"], "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp",
                 "--save-dir", tmp_path / "ck"] for node in (0, 1)]
    outputs = run_together(commands, environment(tmp_path))
    assert "distributed world size 2 from WORLD_SIZE" in outputs[0], outputs[0][-3000:]
    assert "distributed init (rank 1): env://" in outputs[1], outputs[1][-3000:]
    root = epoch_runs["root"]
    assert_same_training(outputs[0], tmp_path / "ck" / "checkpoint_last.pt",
                         epoch_runs["ranks"][0], root / "ranks" / "checkpoint_last.pt")
    assert len(sync_records(tmp_path, 0)) == len(sync_records(tmp_path, 1)) > 0


@pytest.fixture(scope="module")
def one_rank_gloo_group():
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    yield
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_gets_a_gradient_under_pytorch_ddp(family, multi30k_bin, tmp_path, one_rank_gloo_group):
    """fairseq's default on GPUs, ``--ddp-backend pytorch_ddp``, is torch's
    DistributedDataParallel with ``find_unused_parameters=False``: a trainable parameter left
    without a gradient in a step makes the next step fail. fairseq's wrapper passes a GPU id,
    so on CPU the test wraps the model the same way by hand (DDP behind fairseq's
    ModuleProxyWrapper) on a one-rank gloo group, whose reducer checks the same, and trains
    three steps with the family's real criterion and default flags."""
    from fairseq.distributed import ModuleProxyWrapper
    from torch.nn.parallel import DistributedDataParallel

    trainer = build_trainer(multi30k_bin, family, tmp_path)
    model = ModuleProxyWrapper(DistributedDataParallel(trainer.get_model(), find_unused_parameters=False))
    criterion = trainer.get_criterion()
    model.train()
    for _, sample in zip(range(3), batches(trainer)):
        loss, _, _ = criterion(model, sample)
        loss.backward()
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused, unused
