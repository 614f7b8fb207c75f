"""The commands in examples/*/README.md are real: fairseq parses every one, and every training
command builds its model and criterion.

Each fenced ``bash`` block is read as a shell script (backslash continuations joined); every
``fairseq-train`` / ``fairseq-generate`` line is split with ``shlex`` and parsed by fairseq's own
parser for that command (``options.get_training_parser`` / ``get_generation_parser`` +
``parse_args_and_arch``, which also loads ``--user-dir`` and fills the architecture's defaults);
``fairseq-modattn prepare CORPUS ...`` lines are parsed by that corpus' own argument parser.
Training commands then build the model and criterion on a small synthetic joined dictionary
(the data directory is not needed for that), which runs the family's flag validation.
"""

import argparse
import re
import shlex
from pathlib import Path

import pytest
from fairseq import options

from conftest import REPO
from tiny_models import build, parse_training_command, tiny_dictionary

EXAMPLES = sorted((REPO / "examples").glob("*/README.md"))
PLUGIN = str(REPO / "fairseq_modattn")


LAUNCHERS = ("torchrun", "srun")
# shell variables of the documents' loops, replaced by a value they take
SAMPLE_VALUES = {"$rank": "0"}


def split_command(line: str):
    """(launcher words, program, argv) of a shell line running a fairseq command, else None.

    Leading ``VAR=value`` assignments and a trailing ``&`` are dropped; under a launcher
    (``torchrun``, ``srun``) the program is the word naming a fairseq script, also as
    ``"$(which fairseq-train)"``."""
    words = [SAMPLE_VALUES.get(w, w) for w in shlex.split(line, comments=True)]
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if words and words[-1] == "&":
        words = words[:-1]
    launcher = []
    if words and words[0] in LAUNCHERS:
        at = next((i for i, w in enumerate(words) if re.search(r"fairseq-\w+\)?$", w)), None)
        if at is None:
            return None
        launcher, words = words[:at], [re.search(r"fairseq-\w+", words[at]).group(0), *words[at + 1:]]
    if not words or not words[0].startswith("fairseq-"):
        return None
    return launcher, words[0], [PLUGIN if w == "fairseq_modattn" else w for w in words[1:]]


def commands(path: Path, launched: bool = False):
    """(program, argv) of every fairseq command in the file's bash blocks; with ``launched``,
    (launcher words, program, argv)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = split_command(line)
            if command is not None:
                found.append(command if launched else command[1:])
    return found


def test_every_family_has_examples():
    assert {p.parent.name for p in EXAMPLES} >= {"dma", "talking_heads", "tim"}
    for path in EXAMPLES:
        programs = [program for program, _ in commands(path)]
        assert programs.count("fairseq-train") >= 3, path  # IWSLT, WMT, an ablation
        assert programs.count("fairseq-generate") >= 2, path


def check_modattn_command(path: Path, argv):
    """Parse a ``fairseq-modattn`` line with the subcommand's own parser (argparse exits on an
    unknown flag); nothing is run."""
    from fairseq_modattn import data
    from fairseq_modattn.cli import ablate, analyze, average, compare, evaluate, quickstart, serve

    command, rest = argv[0], argv[1:]
    own, extra = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    if rest in (["-h"], ["--help"]):
        return
    if command == "prepare":
        assert rest[0] in data.RECIPES, (path, argv)
        args = data.parse_args(rest[0], rest[1:])
        assert str(args.dest).startswith("data-bin/"), (path, argv)
    elif command == "evaluate":
        evaluate.evaluate_parser().parse_args(own)
        options.parse_args_and_arch(options.get_generation_parser(), input_args=["data-bin/x", *extra])
    elif command == "average":
        average.average_parser().parse_args(own)
    elif command == "redundancy":
        analyze.redundancy_parser().parse_args(own)
    elif command == "plot":
        analyze.plot_parser().parse_args(own)
    elif command == "ablate":
        args = ablate.parser().parse_args(own)
        ablate.validate(argparse.Namespace(**{**vars(args), "data": str(REPO)}), extra)
    elif command == "quickstart":
        args = quickstart.parser().parse_args(own)
        quickstart.validate(args, extra)
    elif command == "serve":
        serve.parser().parse_args(own)
    elif command == "compare":
        compare.compare_parser().parse_args(own)
    else:
        pytest.fail(f"{path}: unexpected fairseq-modattn command {command}")


#: the documents outside examples/*/ whose fairseq-modattn commands are parsed
COMMAND_DOCS = ("README.md", "docs/analysis.md", "examples/README.md")


def test_documented_analysis_commands_parse():
    found = [(doc, argv) for doc in COMMAND_DOCS
             for program, argv in commands(REPO / doc) if program == "fairseq-modattn"]
    assert {argv[0] for _, argv in found} >= {"prepare", "average", "evaluate", "redundancy", "plot", "ablate"}
    for doc, argv in found:
        check_modattn_command(REPO / doc, argv)


def check_training_command(argv):
    """fairseq-train's parser accepts ARGV, and the model and criterion it names build."""
    args = parse_training_command(argv)
    assert args.user_dir == PLUGIN
    built = build(args, tiny_dictionary(100, padding_factor=8))
    built.criterion()
    model = built.model
    assert type(model).__module__.startswith("fairseq_modattn."), (argv, type(model))
    return args


def test_scaling_out_commands_parse_and_build():
    """docs/distributed.md: every launcher line parses (torchrun's own parser), and every
    training command parses and builds; the CPU recipe names gloo and legacy_ddp."""
    from torch.distributed.run import get_args_parser

    found = [c for c in commands(REPO / "docs" / "distributed.md", launched=True) if c[1] == "fairseq-train"]
    launchers = [launcher[0] for launcher, _, _ in found if launcher]
    assert launchers.count("torchrun") >= 2 and "srun" in launchers, launchers
    for launcher, _, argv in found:
        if launcher and launcher[0] == "torchrun":
            get_args_parser().parse_args([*launcher[1:], "fairseq-train"])
        args = check_training_command(argv)
        if args.cpu and args.distributed_world_size > 1:
            assert (args.distributed_backend, args.ddp_backend) == ("gloo", "legacy_ddp"), argv
    assert any("--fp16" in argv for _, _, argv in found)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.parent.name)
def test_example_commands_parse_and_build(path):
    for program, argv in commands(path):
        if program == "fairseq-train":
            check_training_command(argv)
        elif program == "fairseq-modattn":
            check_modattn_command(path, argv)
        elif program == "fairseq-generate":
            args = options.parse_args_and_arch(options.get_generation_parser(), input_args=argv)
            assert args.path.endswith("checkpoint_best.pt") and args.beam >= 4
        else:
            pytest.fail(f"{path}: unexpected command {program}")
