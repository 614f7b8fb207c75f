"""Shared fixtures: the real Multi30k corpus (from ../shared/data, or --shared-data=PATH),
cut to a few hundred lines, tokenised, BPE'd and binarised by the real fairseq-preprocess."""

import fcntl
import gzip
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiers

# Triton's interpreter runs the Triton kernels' tests on CPU tensors where torch sees no CUDA
# device (tests/test_triton_attention.py). Triton reads TRITON_INTERPRET when each @triton.jit
# function is defined, its own helpers included (tl.random.philox), and importing torch's
# inductor imports triton: so it is set here, before any test module is imported, for every
# worker of the run, or kernels and helpers would be defined in different modes.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
PLUGIN = REPO / "fairseq_modattn"
BIN = Path(sys.executable).parent

# (split name in the data-bin, Multi30k file stem, number of lines)
SPLITS = {"train": ("train", 500), "valid": ("val", 100), "test": ("test_2016_flickr", 300)}


def pytest_addoption(parser):
    parser.addoption(
        "--shared-data",
        default=os.environ.get("FAIRSEQ_MODATTN_SHARED_DATA", str(REPO.parent / "shared" / "data")),
        help="folder holding multi30k/ and iwslt16-de-en-dev/ (default: ../shared/data)",
    )
    parser.addoption(
        "--require-shared-data", action="store_true",
        help="fail, instead of skipping, the tests whose shared corpus is missing (CI passes it)",
    )
    parser.addoption(
        "--torch-device", default="cpu",
        help="torch device of the tests that take one (the compiled DMA path against eager, "
             "tests/test_dma_compiled.py), e.g. cuda on a GPU machine (default: cpu)",
    )


def pytest_sessionstart(session):
    # DMA's CPU noise generator and GMM kernels are compiled on first use (modules/native_build.py):
    # built here, before the fast tier's tests, which may not start a process (the compiler)
    from fairseq_modattn.modules import native_mixture, native_normal

    native_normal.library()
    native_mixture.library()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one worker per core (pyproject's -n): torch's default of a thread per core in every
        # worker puts two spinning OpenMP teams on each core, and the fast tier then took 1.5 x
        # longer on 2 workers than on one process
        import torch

        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before -m selects by the tier markers given here
def pytest_collection_modifyitems(config, items):
    config.stash[TIER_COUNTS] = tiers.assign(items)
    if hasattr(config, "workeroutput"):  # an xdist worker: its controller prints the counts
        config.workeroutput["tier_counts"] = config.stash[TIER_COUNTS]


def _tier_line(counts) -> str:
    return "tiers of the collected tests: " + ", ".join(f"{tier} {n}" for tier, n in counts.items())


def pytest_report_collectionfinish(config, items):
    counts = config.stash.get(TIER_COUNTS, None)
    if counts:
        return _tier_line(counts)


def pytest_testnodedown(node, error):
    """Under xdist the controller collects nothing: a worker sends its counts when it ends."""
    counts = getattr(node, "workeroutput", {}).get("tier_counts")
    if counts:
        node.config.stash[TIER_COUNTS] = counts


def pytest_terminal_summary(terminalreporter, config):
    counts = config.stash.get(TIER_COUNTS, None)
    if counts and not hasattr(config, "workeroutput") and config.pluginmanager.hasplugin("dsession"):
        terminalreporter.write_line(_tier_line(counts))


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request, monkeypatch):
    """A fast test that starts a process fails: its helper belongs to the e2e tier (tiers.py).
    It fails even where the code under test caught the refusal and went on."""
    if not request.node.get_closest_marker(tiers.FAST):
        yield
        return
    refused = tiers.forbid_processes(monkeypatch)
    yield
    if refused:
        pytest.fail(tiers.refused_starts_message(refused), pytrace=False)


TIER_COUNTS = pytest.StashKey[dict]()


def fairseq_cli(name: str) -> str:
    """Path of a fairseq console script of the running interpreter's environment."""
    return str(BIN / name)


#: the package's own console script
MODATTN = fairseq_cli("fairseq-modattn")

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple:
    """(width, height) of a PNG file, read from its IHDR chunk."""
    head = Path(path).read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR", f"{path} has no IHDR chunk first"
    return struct.unpack(">II", head[16:24])


def cli_environment(**extra) -> dict:
    """The environment the tests run fairseq commands in: unbuffered, one thread each."""
    return dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)


@tiers.starts_processes
def run_cli(args, cwd=None, input_text=None, timeout=600, check=True):
    """Run a real fairseq-* command; return its combined output (raise with it on failure)."""
    env = cli_environment()
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, input=input_text, capture_output=True, text=True,
        timeout=timeout, env=env,
    )
    output = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} exited {proc.returncode}:\n{output[-6000:]}")
    return proc.returncode, output


#: the console script function of ``fairseq-modattn``, for :func:`run_commands`
MODATTN_MAIN = "fairseq_modattn.cli.main:main"


@tiers.starts_processes
def run_commands(calls, cwd=None, timeout=600) -> list:
    """[(exit status, stdout, stderr)] of each ``(target, argv)`` of CALLS, run one after another
    in ONE child process (tests/commands_in_one_process.py: each called as its console script
    calls it). For tests of how commands refuse bad input, which need a process of their own but
    not one each (a process start costs ~6 s of imports here). A target is ``MODATTN_MAIN`` or
    ``"path/to/script.py:main"``."""
    import json

    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve().parent / "commands_in_one_process.py")], cwd=cwd,
        input=json.dumps([[target, [str(a) for a in argv]] for target, argv in calls]), capture_output=True,
        text=True, timeout=timeout, env=cli_environment(),
    )
    if proc.returncode != 0:
        raise AssertionError(f"commands_in_one_process.py exited {proc.returncode}:\n{proc.stderr[-6000:]}")
    return [(r["code"], r["stdout"], r["stderr"]) for r in json.loads(proc.stdout)]


def once_per_run(tmp_path_factory, name: str, build) -> Path:
    """The folder NAME, filled by ``build(folder)`` once per test run and shared by all its tests.

    Under pytest-xdist every worker is a process of its own with its own session fixtures, so a
    session fixture would build its data-bin or train its models once per worker. The workers'
    temporary folders lie in the run's one base folder: the first worker to get here builds there
    under a file lock, and the others wait for it and reuse what it built. A build that failed
    leaves no marker, so the next worker tries again and reports its own failure."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    run_root = tmp_path_factory.getbasetemp().parent
    folder, done = run_root / name, run_root / f"{name}.done"
    with open(run_root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@tiers.needs_shared_corpus
def shared_corpus(pytestconfig, name: str, probe: str, what: str) -> Path:
    """The folder NAME of the shared data. When its file PROBE is absent the test is skipped, or
    fails under --require-shared-data (so that CI cannot pass by skipping)."""
    path = Path(pytestconfig.getoption("--shared-data")) / name
    if not (path / probe).exists():
        message = f"{what} not found at {path} (pass --shared-data=PATH)"
        if pytestconfig.getoption("--require-shared-data"):
            pytest.fail(f"{message}; --require-shared-data makes this a failure", pytrace=False)
        pytest.skip(message)
    return path


@pytest.fixture(scope="session")
def torch_device(pytestconfig):
    """The ``--torch-device`` the device-taking tests run on; an unusable one is an error."""
    import torch

    device = torch.device(pytestconfig.getoption("--torch-device"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError("--torch-device cuda: torch sees no CUDA device here")
    return device


@pytest.fixture(scope="session")
def kernel_calls():
    """``benchmarks/kernel_calls.py``, the kernel-launch counter (benchmarks/ is a folder of
    scripts, not a package: it is on the path only while the module is imported)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import kernel_calls
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return kernel_calls


@pytest.fixture(scope="session")
def multi30k_dir(pytestconfig) -> Path:
    return shared_corpus(pytestconfig, "multi30k", "train.de.gz", "Multi30k")


@pytest.fixture(scope="session")
def iwslt_dir(pytestconfig) -> Path:
    """Real IWSLT16 de-en TED/TEDX dev XML files (the IWSLT14 archive's <seg> format)."""
    return shared_corpus(pytestconfig, "iwslt16-de-en-dev", "IWSLT16.TED.dev2010.de-en.de.xml", "IWSLT dev XML")


def bpe_codes(data_bin) -> Path:
    """The subword-nmt codes ``multi30k_bin`` learned, beside the data-bin (the tests' data-bin
    holds no subword model of its own)."""
    return Path(data_bin).parent / "codes"


@pytest.fixture(scope="session")
def multi30k_bin(multi30k_dir, tmp_path_factory) -> Path:
    """A de-en data-bin of 500/100/300 real Multi30k sentence pairs with an 800-merge BPE."""

    def build(work: Path):
        from sacremoses import MosesTokenizer
        from subword_nmt.apply_bpe import BPE
        from subword_nmt.learn_bpe import learn_bpe

        tokenized = {}
        for split, (stem, count) in SPLITS.items():
            for lang in ("de", "en"):
                tok = MosesTokenizer(lang=lang)
                with gzip.open(multi30k_dir / f"{stem}.{lang}.gz", "rt", encoding="utf-8") as f:
                    lines = [next(f).strip() for _ in range(count)]
                tokenized[split, lang] = [tok.tokenize(s.lower(), return_str=True, escape=False) for s in lines]
        codes = work / "codes"
        with open(codes, "w", encoding="utf-8") as out:
            learn_bpe(tokenized["train", "de"] + tokenized["train", "en"], out, 800)
        with open(codes, encoding="utf-8") as f:
            bpe = BPE(f)
        for (split, lang), lines in tokenized.items():
            (work / f"{split}.bpe.{lang}").write_text("".join(bpe.process_line(s) + "\n" for s in lines))
        run_cli([
            fairseq_cli("fairseq-preprocess"), "--source-lang", "de", "--target-lang", "en",
            "--trainpref", work / "train.bpe", "--validpref", work / "valid.bpe", "--testpref", work / "test.bpe",
            "--destdir", work / "bin", "--joined-dictionary", "--workers", "1",
        ])

    return once_per_run(tmp_path_factory, "multi30k", build) / "bin"


# Tiny models of every family, for the analysis tests: 2+2 layers (TIM: 4+2) of width 64 with
# 4 heads, each trained for a few updates by the real fairseq-train.
_TINY_TRANSFORMER = [
    "--encoder-layers", "2", "--decoder-layers", "2", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
    "--encoder-ffn-embed-dim", "128", "--decoder-ffn-embed-dim", "128",
    "--encoder-attention-heads", "4", "--decoder-attention-heads", "4",
]
TINY_MODELS = {
    "transformer": ["--arch", "transformer", *_TINY_TRANSFORMER],
    "dma": ["--arch", "dma_transformer_iwslt_de_en_tiny", *_TINY_TRANSFORMER, "--dma-anneal-rate", "0.05",
            "--criterion", "label_smoothed_cross_entropy_with_aux"],
    "tim": ["--arch", "tim_transformer_iwslt_de_en", *_TINY_TRANSFORMER, "--encoder-layers", "4",
            "--tim-decoder-layers", "1"],
    "rim": ["--arch", "rim_lstm_iwslt_de_en", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64",
            "--decoder-hidden-size", "64", "--decoder-out-embed-dim", "64", "--rim-size", "16",
            "--rim-input-key-size", "16", "--rim-input-value-size", "64", "--rim-comm-key-size", "16",
            "--rim-comm-value-size", "16"],
}


def tiny_train_args(family: str, epoch_checkpoints: bool = False):
    """fairseq-train flags (without data and --save-dir) of the tiny model of FAMILY."""
    args = [
        "--user-dir", PLUGIN, "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
        "--optimizer", "adam", "--lr", "5e-4", "--dropout", "0.1", "--max-tokens", "1000",
        "--log-format", "simple", "--no-progress-bar", "--cpu", "--seed", "7", "--num-workers", "0",
    ]
    if not epoch_checkpoints:
        args.append("--no-epoch-checkpoints")
    return args + TINY_MODELS[family]  # a later --criterion overrides the first


@pytest.fixture(scope="session")
def tiny_checkpoints(multi30k_bin, tmp_path_factory):
    """{family: checkpoint_last.pt} of tiny transformer, DMA, TIM and RIM-LSTM models (12 updates)."""

    def build(root: Path):
        for family in TINY_MODELS:
            run_cli([fairseq_cli("fairseq-train"), multi30k_bin, *tiny_train_args(family), "--max-update", "12",
                     "--save-dir", root / family])

    root = once_per_run(tmp_path_factory, "tiny_checkpoints", build)
    return {family: root / family / "checkpoint_last.pt" for family in TINY_MODELS}


@pytest.fixture(scope="session")
def tiny_model():
    """Factory of small models built as fairseq-train builds them: ``tiny_model(arch, *flags,
    dictionary=20, seed=0)`` -> (model, dictionary, task, args), see tests/tiny_models.py."""
    from tiny_models import tiny_model as build

    return build
