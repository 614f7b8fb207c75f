"""``fairseq-modattn``: helpers around fairseq's own commands for this plugin.

    fairseq-modattn flags                    # the plugin's architectures
    fairseq-modattn flags --arch ARCH        # ARCH's plugin flags with ARCH's defaults
    fairseq-modattn flags --arch ARCH --all  # every model flag of ARCH
    fairseq-modattn prepare CORPUS --raw-dir DIR --dest data-bin/NAME [...]
                                             # raw corpus -> data-bin (see prepare -h)
    fairseq-modattn average --inputs DIR --num-epoch-checkpoints N --output FILE
                                             # fairseq's average_checkpoints.py (see average -h)
    fairseq-modattn evaluate DATA --checkpoint-dir DIR [...] [-- fairseq-generate args]
                                             # average + fairseq-generate + BLEU/sacreBLEU JSON
    fairseq-modattn compare --system NAME FILE [FILE ...] --system NAME FILE [FILE ...] [--json OUT]
                                             # paired bootstrap of BLEU, chrF, TER against the first
                                             # system (evaluate JSONs or hypothesis files; see compare -h)
    fairseq-modattn redundancy DATA --path CKPT [--attention enc_self] [--output R.json]
                                             # attention redundancy LR / HR over a split
    fairseq-modattn plot KIND DATA --path CKPT --output FIG.png
                                             # KIND: redundancy clusters sentence queries
                                             #       competition rim (see plot -h)
    fairseq-modattn ablate DATA --output-dir DIR --max-epoch N [--clusters 4 8 12] [-- train args]
                                             # DMA cluster-count ablation: train, evaluate, table
    fairseq-modattn quickstart [--output-dir quickstart] [--raw-dir raw/multi30k] [--models transformer dma]
                                             # Multi30k: prepare, train, evaluate, compare (CPU, ~10 min)
    fairseq-modattn serve --path CKPT --data DATA-BIN [--port 8000]
                                             # translation demo page + JSON API with attention views
    fairseq-modattn score -s SYS -r REF [--sacrebleu | --sentence-bleu]
                                             # fairseq-score (its flags and output), working with
                                             # sacrebleu 2.x (fairseq_modattn/compat/fairseq_score.py, fix 10)

Why ``flags`` exists: ``fairseq-train --arch ARCH -h`` prints its help during its first parsing
pass, before it adds the model's arguments (fairseq 0.12 ``options.parse_args_and_arch``), so
model flags such as ``--dma-clusters`` never appear there. This command builds the same model
argument group and fills in the defaults the named architecture sets.
"""

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional


def plugin_architectures():
    """{arch name: model class} for the architectures this package registers."""
    from fairseq.models import ARCH_MODEL_REGISTRY

    import fairseq_modattn  # noqa: F401  (registers the models)

    return {
        name: cls
        for name, cls in sorted(ARCH_MODEL_REGISTRY.items())
        if cls.__module__.startswith("fairseq_modattn.")
    }


def arch_flags_parser(arch: str, show_all: bool) -> argparse.ArgumentParser:
    """A parser holding ARCH's model flags, its defaults those the architecture sets."""
    from fairseq.models import ARCH_CONFIG_REGISTRY

    from ..help_format import ArchDefaultsHelpFormatter

    model_cls = plugin_architectures()[arch]
    full = argparse.ArgumentParser(add_help=False)
    model_cls.add_args(full)
    defaults = argparse.Namespace()
    ARCH_CONFIG_REGISTRY[arch](defaults)

    parser = argparse.ArgumentParser(
        prog=f"fairseq-train DATA --user-dir fairseq_modattn --arch {arch}",
        formatter_class=ArchDefaultsHelpFormatter,
        add_help=False,
        description=f"Model flags of --arch {arch} (defaults are the architecture's).",
    )
    for group in full._action_groups:
        own = group.title not in ("positional arguments", "options", "optional arguments")
        if not group._group_actions or not (show_all or own):
            continue
        target = parser.add_argument_group(group.title if own else "model options")
        for action in group._group_actions:
            target._add_action(action)
            if hasattr(defaults, action.dest):
                action.default = getattr(defaults, action.dest)
    return parser


def flags(argv: List[str]) -> int:
    p = argparse.ArgumentParser(prog="fairseq-modattn flags", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", help="an architecture of this package; without it, list them")
    p.add_argument("--all", action="store_true", help="also show the fairseq transformer flags of ARCH")
    args = p.parse_args(argv)
    archs = plugin_architectures()
    if args.arch is None:
        print("architectures registered by fairseq_modattn (use with --user-dir):")
        for name, cls in archs.items():
            print(f"  {name:40s} model {cls.__name__}")
        print("\nfairseq-modattn flags --arch ARCH   shows ARCH's flags and defaults")
        return 0
    if args.arch not in archs:
        p.error(f"unknown architecture {args.arch!r}; choose from: {', '.join(archs)}")
    arch_flags_parser(args.arch, args.all).print_help()
    return 0


def prepare(argv: List[str]) -> int:
    """``fairseq-modattn prepare CORPUS [flags]``: run the data recipe CORPUS (fairseq_modattn.data)."""
    from fairseq_modattn import data

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: fairseq-modattn prepare CORPUS --raw-dir DIR --dest data-bin/NAME [...]\n")
        print("corpora (fairseq-modattn prepare CORPUS -h shows a corpus' flags):")
        for name in sorted(data.RECIPES):
            print(f"  {name:12s} {data.recipe_module(name).DESCRIPTION}")
        return 0 if argv else 2
    if argv[0] not in data.RECIPES:
        print(f"fairseq-modattn prepare: unknown corpus {argv[0]!r}; choose from: "
              f"{', '.join(sorted(data.RECIPES))}", file=sys.stderr)
        return 2
    from fairseq_modattn.child_processes import stopping_on_sigterm
    from fairseq_modattn.data.errors import DataError

    try:
        with stopping_on_sigterm():  # SIGTERM ends it as Ctrl-C does, with the reminder below
            data.prepare(argv[0], argv[1:])
    except DataError as e:
        print(f"fairseq-modattn prepare {argv[0]}: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a disk that fills up, a folder made read-only while running...
        from fairseq_modattn.disk_space import describe_disk_full

        # a full disk: the folder, what the failing step needs and the space free there
        print(f"fairseq-modattn prepare {argv[0]}: error: {describe_disk_full(e) or e}; finished steps are kept, "
              "fix it and rerun the same command to continue", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fairseq-modattn prepare {argv[0]}: interrupted; finished steps are kept, "
              "rerun the same command to continue", file=sys.stderr)
        return 130
    return 0


@dataclass(frozen=True)
class Subcommand:
    """A ``fairseq-modattn`` subcommand: ``function(argv) -> exit status`` of ``module``.

    The module is imported when the subcommand runs, not when this table is built, so
    ``fairseq-modattn --help`` and each command load only the modules they use, not those of
    every command (analysis/, demo/, the corpus recipes...)."""

    module: str
    function: str
    help: str  # one line, listed when the command name is unknown

    def __call__(self, argv: List[str]) -> int:
        return getattr(importlib.import_module(self.module), self.function)(argv)


# flags and prepare are defined above. ``__name__`` is this module's name also when it runs as
# ``python -m fairseq_modattn.cli.main`` ("__main__"), so it is not imported a second time.
COMMANDS: Dict[str, Subcommand] = {
    "flags": Subcommand(__name__, "flags", "the plugin's architectures; an architecture's model flags"),
    "prepare": Subcommand(__name__, "prepare", "raw corpus -> data-bin"),
    "average": Subcommand("fairseq_modattn.cli.average", "average", "fairseq's average_checkpoints.py"),
    "evaluate": Subcommand("fairseq_modattn.cli.evaluate", "evaluate", "average + fairseq-generate + BLEU JSON"),
    "compare": Subcommand("fairseq_modattn.cli.compare", "compare",
                          "paired bootstrap of BLEU, chrF and TER between systems"),
    "redundancy": Subcommand("fairseq_modattn.cli.analyze", "redundancy", "attention redundancy LR / HR"),
    "plot": Subcommand("fairseq_modattn.cli.analyze", "plot", "the paper's figures of a checkpoint"),
    "ablate": Subcommand("fairseq_modattn.cli.ablate", "ablate", "DMA cluster-count ablation"),
    "quickstart": Subcommand("fairseq_modattn.cli.quickstart", "quickstart", "Multi30k: prepare, train, compare"),
    "serve": Subcommand("fairseq_modattn.cli.serve", "serve", "translation demo page + JSON API"),
    # fairseq-score never imports a plugin (it has no --user-dir), so its fixes run from here
    "score": Subcommand("fairseq_modattn.compat.fairseq_score", "fairseq_score",
                        "fairseq-score, working with sacrebleu 2.x"),
}


def configure_logging():
    """INFO-level logs on stderr in fairseq's format, replacing (``force``) whatever configuration
    the root logger had. fairseq's import-time logging is dealt with in compat/ before fairseq is
    imported, which this function runs too late to do: fix 1 drops the 'Please install
    tensorboardX' notice and fix 2 undoes ``wav2vec2_classification.py``'s root logger at DEBUG."""
    import logging

    class CurrentStderr(logging.StreamHandler):
        """Writes to ``sys.stderr`` as it is when a record is emitted, so a caller that swaps it
        (pytest's capture, a notebook) never leaves the handler on a closed stream."""

        @property
        def stream(self):
            return sys.stderr

        @stream.setter
        def stream(self, value):
            pass

    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", level=logging.INFO, handlers=[CurrentStderr()], force=True)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip().replace("``", ""))  # the docstring's reST literals, as plain text
        if argv and argv[0] not in ("-h", "--help"):
            listing = "\n".join(f"  {name:<11} {command.help}" for name, command in COMMANDS.items())
            print(f"\nunknown command {argv[0]!r}; commands:\n{listing}", file=sys.stderr)
            return 2
        return 0
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
