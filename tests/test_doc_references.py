"""Every document names only things that exist (what was checked for docs/fidelity.md alone), and
the documents cite one another correctly.

For each Markdown document of the repository (README.md, docs/*.md, examples/**/README.md,
benchmarks/README.md):

* paths: every path into the repository (``fairseq_modattn/...``, ``docs/...``, ``examples/...``,
  ``tests/...``, ``benchmarks/...``, ``scripts/...``), every file name in backticks
  (``mi_bounds.py``, ``models/tim_transformer.py``) and every relative Markdown link exists;
* flags: every ``--flag`` of a command line (a fenced shell block, or an inline code span that
  starts with a program) is accepted by that command's own parser: fairseq-train / -generate /
  -interactive / -preprocess / -score (with the components the line names: ``--arch``,
  ``--criterion``, ``--optimizer``, ...), each ``fairseq-modattn`` subcommand, the benchmark
  scripts, torchrun, pytest with this suite's options; other tools' flags come from
  OTHER_TOOLS. A flag in prose, where no command says whose it is, must be one of those;
* architectures: every ``--arch NAME`` is registered with fairseq, and the README's table of
  architectures lists exactly the ones this package registers.

Everything runs in-process: the parsers are built once per session (the ``fairseq-modattn``
subcommands' and the benchmarks' by calling their entry points with ``parse_args`` intercepted,
so the test follows the code wherever a command's parser is defined).
"""

import argparse
import contextlib
import functools
import importlib.util
import itertools
import re
import shlex
import sys
from pathlib import Path

import pytest

from conftest import REPO

PLUGIN = str(REPO / "fairseq_modattn")

DOCS = sorted({REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("examples/**/README.md"),
               REPO / "benchmarks" / "README.md"})

#: top-level folders of this repository: a path starting with one must exist
OUR_ROOTS = ("fairseq_modattn", "docs", "examples", "tests", "benchmarks", "scripts")

#: files of other repositories that the documents name (fairseq's, the authors' and the RIMs'
#: reference code), which look like ours
EXTERNAL_PATHS = {
    "scripts/average_checkpoints.py",                   # fairseq's, not shipped by its pip package
    "wav2vec2_classification.py",                       # fairseq's module that sets the root logger
    "examples/translation/prepare-iwslt14.sh",          # fairseq's data scripts
    "examples/translation/prepare-wmt14en2de.sh",
    "modules/disentangled_attention.py", "criterions/disentangled_label_smoothed_cross_entropy.py",
    "train_disentangled_transformer.sh", "train_transformer.sh",  # the DMA authors' repository
    "train_disentangled_transformer_wmt14.sh", "train_transformer_wmt14.sh",
    "evaluate_disentangled_transformer.sh", "evaluate_transformer.sh",
    "fairseq/modules/transformer_layer.py", "multihead_attention.py", "fairseq/options.py",
    "fairseq/models/__init__.py",                       # fairseq's own files
    "ctranslate2/converters/fairseq.py",                # CTranslate2's fairseq converter
    "event_based/blocks_core.py", "attention.py", "BlockLSTM.py",  # the RIMs' reference code
    "MT/Fairseq/examples/translation/train_disentangled_transformer.sh",
    "average_checkpoints.py", "compound_split_bleu.sh", "scripts/compound_split_bleu.sh",
    "prepare-wmt14en2de.sh",
}
#: where the commands write their outputs (not in the repository; benchmarks/results/ is ignored
#: by git but for the converged comparison's results)
OUTPUT_PREFIXES = ("benchmarks/results/",)
#: flags of the DMA authors' code that the documents quote (theirs, never ours)
REFERENCE_FLAGS = {
    "--clusters", "--mi_loss_weight", "--grad_multiplier", "--cluster_loss_weight",
    "--regular-attn", "--num_modules", "--unk-augmentation-rate",
}
#: flags of tools this package has no parser of, by tool
OTHER_TOOLS = {
    "pip": {"--upgrade", "--quiet"},                         # pip install ...
    "apt-get": set(),
    "tensorboard": {"--logdir"},                             # tensorboard --logdir runs
    # sacreBLEU's own command line
    "sacrebleu": {"--tokenize", "--metrics", "--force", "--echo", "--input", "--paired-bs"},
    "git": {"--stat"},                                       # git diff --stat
    "prepare-wmt14en2de.sh": {"--icml17"},                   # fairseq's WMT14 data script
    "curl": set(),
    "srun": {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task"},  # SLURM
    "wandb": set(),
    "ct2-fairseq-converter": {"--model_path", "--data_dir", "--source_lang", "--target_lang", "--user_dir",
                              "--output_dir", "--unsafe_deserialization"},  # CTranslate2's (docs/python_api.md)
}
#: pytest's own flags the documents use (the suite's own options come from tests/conftest.py)
PYTEST_FLAGS = {"--durations", "--collect-only"}
#: programs that run the command after their own single-dash options
WRAPPERS = {"sudo", "time", "/usr/bin/time", "nice", "nohup", "env"}
#: shell words that are no programs
SHELL_WORDS = {"for", "do", "done", "wait", "then", "fi", "if", "else", "cd", "export", "source",
               "echo", "ls", "cat", "mkdir", "kill"}
#: options of fairseq's parsers that pull in a component's own arguments
COMPONENT_OPTIONS = ("--arch", "--criterion", "--optimizer", "--lr-scheduler", "--task",
                     "--tokenizer", "--bpe", "--scoring")


# ------------------------------------------------------------------------ reading a document
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)(\*?)")
INLINE = re.compile(r"`([^`\n]+(?:\n[^`\n]+)?)`")


def doc_name(path: Path) -> str:
    return str(path.relative_to(REPO))


def fenced_blocks(text):
    """(language, body) of every fenced block."""
    return FENCE.findall(text)


def prose(text):
    """The text outside fenced blocks."""
    return FENCE.sub("", text)


def shell_lines(body):
    """The simple commands of a shell block: continuations joined, comments dropped, split at
    ``&&``, ``||``, ``;``, ``|`` and ``&``."""
    lines = []
    for line in body.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            words = list(lexer)
        except ValueError:  # an unbalanced quote: no command of ours
            continue
        for is_separator, group in itertools.groupby(words, lambda w: w in (";", "&", "&&", "|", "||")):
            if not is_separator:
                lines.append(list(group))
    return lines


def commands_of(text):
    """Every command (a list of words) of the document: its shell blocks' lines and its inline
    code spans that start with a program."""
    found = []
    for language, body in fenced_blocks(text):
        if language in ("bash", "sh", "shell", "console"):
            found.extend(shell_lines(body))
    for span in INLINE.findall(prose(text)):
        words = span.split()
        if words and (words[0].startswith("fairseq-") or words[0] in ("python", "torchrun")):
            found.extend(shell_lines(span.replace("\n", " ")))
    return found


def long_flags(words):
    """The ``--flags`` of WORDS (``--flag=value`` counts as ``--flag``)."""
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2 and w[2].isalpha()]


# ------------------------------------------------------------------------------------ parsers
class Captured(BaseException):
    """Raised by an intercepted ``parse_args``: carries the parser it was called on."""

    def __init__(self, parser):
        super().__init__()
        self.parser = parser


@contextlib.contextmanager
def intercepted_parsing():
    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args

    def capture(self, *args, **kwargs):
        raise Captured(self)

    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


def captured_parser(entry_point, argv):
    """The parser ENTRY_POINT(ARGV) parses its arguments with (it is stopped there)."""
    with intercepted_parsing():
        try:
            entry_point(argv)
        except Captured as captured:
            return captured.parser
    raise AssertionError(f"{entry_point} parsed no arguments")


def option_strings(parser):
    return {s for s in parser._option_string_actions if s.startswith("--")}


def subparsers(parser):
    """{name: subparser} of PARSER's subcommands (``plot KIND``)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


@functools.lru_cache(maxsize=None)
def modattn_flags(command, sub=None):
    """The flags of ``fairseq-modattn COMMAND [SUB]`` (SUB: a plot kind or a corpus)."""
    from fairseq_modattn.cli import main

    if command == "prepare":
        from fairseq_modattn import data

        corpora = [sub] if sub in data.RECIPES else sorted(data.RECIPES)
        return frozenset().union(*(option_strings(captured_parser(main.COMMANDS["prepare"], [c]))
                                   for c in corpora))
    parser = captured_parser(main.COMMANDS[command], ["-h"])
    flags = option_strings(parser)
    kinds = subparsers(parser)
    for name, kind in kinds.items():
        if sub not in kinds or sub == name:  # a placeholder (KIND): any kind's
            flags |= option_strings(kind)
    return frozenset(flags)


def registered(option, value):
    """Whether VALUE names a registered fairseq component for OPTION."""
    from fairseq.models import ARCH_MODEL_REGISTRY
    from fairseq.registry import REGISTRIES
    from fairseq.tasks import TASK_REGISTRY

    name = option[2:].replace("-", "_")
    if name == "arch":
        return value in ARCH_MODEL_REGISTRY
    if name == "task":
        return value in TASK_REGISTRY
    return name in REGISTRIES and value in REGISTRIES[name]["registry"]


def components(words):
    """The (option, value) pairs of WORDS that add a registered component's arguments."""
    found = []
    for option, value in zip(words, words[1:]):
        if option in COMPONENT_OPTIONS and registered(option, value):
            found.append((option, value))
    return tuple(sorted(found))


@functools.lru_cache(maxsize=None)
def fairseq_flags(program, parts=()):
    """The flags fairseq's PROGRAM accepts with the components PARTS ((option, value) pairs)."""
    from fairseq import options

    if program == "fairseq-score":
        from fairseq_cli import score

        return frozenset(option_strings(score.get_parser()))
    if program == "fairseq-preprocess":
        return frozenset(option_strings(options.get_preprocessing_parser()))
    parser = {"fairseq-train": options.get_training_parser,
              "fairseq-generate": options.get_generation_parser,
              "fairseq-interactive": options.get_interactive_generation_parser}[program]()
    argv = ["data-bin/x", "--user-dir", PLUGIN, *itertools.chain.from_iterable(parts)]
    # parse_args_and_arch adds the named components' arguments to PARSER
    options.parse_args_and_arch(parser, input_args=argv, parse_known=True)
    return frozenset(option_strings(parser))


@functools.lru_cache(maxsize=None)
def benchmark_flags(script):
    """The flags of ``python benchmarks/SCRIPT``, from the parser its ``main`` builds."""
    path = REPO / script
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"doc_references_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return frozenset(option_strings(captured_parser(module.main, ["-h"])))


@functools.lru_cache(maxsize=None)
def torchrun_flags():
    from torch.distributed.run import get_args_parser

    return frozenset(option_strings(get_args_parser()))


@functools.lru_cache(maxsize=None)
def pytest_flags():
    """The suite's own options (tests/conftest.py) and the pytest flags of PYTEST_FLAGS."""
    import conftest

    class Recorder:
        def __init__(self):
            self.flags = set()

        def addoption(self, *names, **kwargs):
            self.flags.update(n for n in names if n.startswith("--"))

    recorder = Recorder()
    conftest.pytest_addoption(recorder)
    return frozenset(recorder.flags | PYTEST_FLAGS)


#: the fairseq-train components whose flags prose may name: every family, fairseq's
#: transformer and LSTM baselines, and the optimisers, schedulers and text tools the docs use
PROSE_TRAINING = [
    (("--arch", arch), ("--criterion", "label_smoothed_cross_entropy_with_aux"), ("--optimizer", "adam"),
     ("--lr-scheduler", scheduler), ("--tokenizer", "moses"), ("--bpe", "subword_nmt"))
    for arch in ("dma_transformer", "talking_heads_transformer", "tim_transformer", "rim_lstm",
                 "transformer", "lstm")
    for scheduler in ("inverse_sqrt", "reduce_lr_on_plateau")
]


@functools.lru_cache(maxsize=None)
def every_known_flag():
    """The flags a sentence may name without saying whose they are."""
    from fairseq_modattn.cli import main

    flags = set(REFERENCE_FLAGS) | set(torchrun_flags()) | set(pytest_flags())
    for parts in PROSE_TRAINING:
        flags |= fairseq_flags("fairseq-train", tuple(sorted(parts)))
    for program in ("fairseq-generate", "fairseq-interactive", "fairseq-preprocess", "fairseq-score"):
        flags |= fairseq_flags(program)
    flags |= fairseq_flags("fairseq-interactive", (("--bpe", "subword_nmt"), ("--tokenizer", "moses")))
    for command in main.COMMANDS:
        flags |= modattn_flags(command)
    for script in sorted(REPO.glob("benchmarks/*.py")):
        if re.search(r"^def main\(", script.read_text(), re.M):
            flags |= benchmark_flags(str(script.relative_to(REPO)))
    for tool_flags in OTHER_TOOLS.values():
        flags |= tool_flags
    return frozenset(flags)


# ------------------------------------------------------------------------------- the checks
def flag_problems(words):
    """The flags of one command line that its program does not accept."""
    program, rest = words[0], words[1:]
    if program in WRAPPERS:  # `/usr/bin/time -v COMMAND`: the wrapped command's
        rest = list(itertools.dropwhile(lambda w: w.startswith("-"), rest))
        return flag_problems(rest) if rest else []
    own, after = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) if "--" in rest else (rest, [])
    if program == "torchrun":
        at = next((i for i, w in enumerate(rest) if "fairseq-" in w), None)
        launcher, launched = (rest, []) if at is None else (rest[:at], rest[at:])
        problems = [f for f in long_flags(launcher) if f not in torchrun_flags()]
        if launched:
            program_word = re.search(r"fairseq-\w+", launched[0]).group(0)
            problems += flag_problems([program_word, *launched[1:]])
        return problems
    if program == "srun":
        at = next((i for i, w in enumerate(rest) if w.startswith("fairseq-")), len(rest))
        problems = [f for f in long_flags(rest[:at]) if f not in OTHER_TOOLS["srun"]]
        return problems + (flag_problems(rest[at:]) if at < len(rest) else [])
    if program in ("fairseq-train", "fairseq-generate", "fairseq-interactive", "fairseq-preprocess",
                   "fairseq-score"):
        parts = components(words)
        if program == "fairseq-train" and not any(option == "--arch" for option, _ in parts):
            parts = tuple(sorted((*parts, ("--arch", "transformer"))))  # a placeholder: fairseq's default
        accepted = fairseq_flags(program, parts)
        return [f for f in long_flags(words) if f not in accepted]
    if program == "fairseq-modattn":
        from fairseq_modattn.cli import main

        if not own or own[0].startswith("-") or own[0].isupper():
            return []  # `fairseq-modattn -h`, `fairseq-modattn COMMAND: error: ...`
        command = own[0]
        if command not in main.COMMANDS:
            return [f"unknown command {command}"]
        sub = own[1] if len(own) > 1 and not own[1].startswith(("-", "$")) else None
        problems = [f for f in long_flags(own[1:]) if f not in modattn_flags(command, sub)]
        if after:  # evaluate passes them to fairseq-generate, ablate and quickstart to fairseq-train
            target = "fairseq-generate" if command == "evaluate" else "fairseq-train"
            problems += flag_problems([target, *after])
        return problems
    if program.startswith("python"):
        if rest[:2] == ["-m", "pytest"]:
            return [f for f in long_flags(rest) if f not in pytest_flags()]
        if rest and rest[0].startswith("benchmarks/") and rest[0].endswith(".py"):
            return [f for f in long_flags(rest[1:]) if f not in benchmark_flags(rest[0])]
        return []  # python -c ...
    if program in OTHER_TOOLS:
        return [f for f in long_flags(rest) if f not in OTHER_TOOLS[program]]
    if program in SHELL_WORDS or re.fullmatch(r"[A-Za-z_]+=.*", program):
        if re.fullmatch(r"[A-Za-z_]+=.*", program) and rest:
            return flag_problems(rest)  # VAR=value program ...
        return []
    flags = long_flags(rest)
    return [f"{program} (add its flags to OTHER_TOOLS): {flags}"] if flags else []


@pytest.mark.parametrize("doc", DOCS, ids=doc_name)
def test_command_flags_are_accepted(doc):
    problems = []
    for words in commands_of(doc.read_text()):
        for problem in flag_problems(words):
            problems.append(f"{problem}  in: {' '.join(words)[:120]}")
    assert not problems, f"{doc_name(doc)} names flags their commands do not accept:\n" + "\n".join(problems)


@pytest.mark.parametrize("doc", DOCS, ids=doc_name)
def test_flags_in_prose_exist(doc):
    text = prose(doc.read_text())
    known = every_known_flag()
    unknown = set()
    for flag, star in FLAG.findall(text):
        if star or flag.endswith("-"):  # `--decoder-*`: some flag has that prefix
            if not any(k.startswith(flag) for k in known):
                unknown.add(flag + "*")
        elif flag not in known:
            unknown.add(flag)
    assert not unknown, f"{doc_name(doc)} names flags no parser accepts: {sorted(unknown)}"


def expand_braces(word):
    """``a_{b,c}`` -> [``a_b``, ``a_c``] (one level)."""
    match = re.search(r"\{([^{}]*)\}", word)
    if not match:
        return [word]
    return [word[:match.start()] + part + word[match.end():] for part in match.group(1).split(",")]


@pytest.mark.parametrize("doc", DOCS, ids=doc_name)
def test_architectures_are_registered(doc):
    from fairseq.models import ARCH_MODEL_REGISTRY

    import fairseq_modattn  # noqa: F401  (registers the plugin's architectures)

    named = re.findall(r"--arch[ =]`?([\w{},]+)", doc.read_text())
    names = {n for word in named for n in expand_braces(word)}
    # placeholders (ARCH, NAME) are no names
    unknown = sorted(n for n in names if not n.isupper() and n not in ARCH_MODEL_REGISTRY)
    assert not unknown, f"{doc_name(doc)} names architectures fairseq does not know: {unknown}"


def test_readme_lists_every_architecture():
    from fairseq_modattn.cli.main import plugin_architectures

    text = (REPO / "README.md").read_text()
    table = text[text.index("\n## Architectures\n"):]
    table = table[:table.index("\n## ", 1)]
    listed = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert listed, "the README's table of architectures was not found"
    assert len(listed) == len(set(listed)), "an architecture is listed twice"
    assert set(listed) == set(plugin_architectures()), (
        f"README lists {sorted(set(listed) - set(plugin_architectures()))} that are not registered "
        f"and misses {sorted(set(plugin_architectures()) - set(listed))}")


def test_readme_starts_with_a_first_run_that_says_what_it_shows():
    """A reader meets the one-command first run within the README's first 60 lines, with what its
    table is (a smoke run; the comparison is docs/results.md), how to run it from a local copy of
    the corpus, and, for fairseq-interactive, what its input must be."""
    readme = (REPO / "README.md").read_text()
    lines = readme.splitlines()
    start = lines.index("## First run: one command")
    assert start < 60 and lines.index("## Install") < start
    section = "\n".join(lines[start:lines.index(next(line for line in lines[start + 1:] if line.startswith("## ")))])
    runs = [words for words in commands_of(section) if words[:2] == ["fairseq-modattn", "quickstart"]]
    assert any("--no-download" in words and "--raw-dir" in words for words in runs), runs
    smoke = section[section.index("smoke run, not a comparison"):]
    assert "docs/results.md" in smoke[:smoke.index("\n\n")]
    interactive = readme[readme.index("fairseq-interactive data-bin/"):]
    note = interactive[interactive.index("```\n\n") + 5:]
    note = " ".join(note[:note.index("\n\n")].split())
    assert "tokenised and BPE'd" in note and "(#python-api)" in note, note


def path_exists(path: str) -> bool:
    pattern = re.sub(r"<[^>]*>|\bCORPUS\b|\bNAME\b|\{[^}]*\}", "*", path)
    if "*" in pattern:
        return any(REPO.glob(pattern.rstrip("/")))
    return (REPO / path).exists()


@pytest.mark.parametrize("doc", DOCS, ids=doc_name)
def test_named_paths_exist(doc):
    text = doc.read_text()
    roots = "|".join(OUR_ROOTS)
    missing = set()
    # paths into the repository, anywhere in the text
    for path in re.findall(rf"(?<![\w./$-])((?:{roots})/[\w./<>*{{}},-]*)", text):
        path = path.rstrip(".,")
        if path not in EXTERNAL_PATHS and not path.startswith(OUTPUT_PREFIXES) and not path_exists(path):
            missing.add(path)
    # a file name in backticks: found somewhere in the repository, or someone else's
    for name in re.findall(r"`([\w./-]+\.(?:py|sh))`", text):
        if name.startswith(tuple(r + "/" for r in OUR_ROOTS)) or name in EXTERNAL_PATHS:
            continue
        if (doc.parent / name).exists() or (REPO / name).exists() or path_exists(f"fairseq_modattn/{name}"):
            continue
        if not any(REPO.glob(f"**/{name}")):
            missing.add(name)
    # relative Markdown links and images
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+:", target) or target.startswith("#"):
            continue
        if not (doc.parent / target.split("#")[0]).exists():
            missing.add(f"link {target}")
    assert not missing, f"{doc_name(doc)} names paths that do not exist: {sorted(missing)}"


def test_the_checks_see_what_they_check():
    """The patterns find what they are meant to (a broken pattern would pass everything)."""
    readme = (REPO / "README.md").read_text()
    programs = {words[0] for words in commands_of(readme)}
    assert {"fairseq-train", "fairseq-generate", "fairseq-modattn", "pip"} <= programs, programs
    assert "--dma-clusters" in modattn_flags("flags") | every_known_flag()
    assert "--dma-objective" in fairseq_flags("fairseq-train", (("--arch", "dma_transformer"),))
    assert "--dma-objective" not in fairseq_flags("fairseq-train", (("--arch", "transformer"),))
    assert {"--sentence", "--layer"} <= modattn_flags("plot", "clusters") | modattn_flags("plot", "sentence")
    # the authors' flags are quoted as theirs: none of them may be ours under the same name
    assert not REFERENCE_FLAGS & fairseq_flags("fairseq-train", (("--arch", "dma_transformer"),))
    fidelity = (REPO / "docs" / "fidelity.md").read_text()
    assert {"--dma-objective", "--rim-input-heads"} <= {f for f, _ in FLAG.findall(fidelity)}


def test_module_docstrings_link_the_document():
    for path in ("modules/dma_attention.py", "modules/talking_heads_attention.py", "modules/rim.py"):
        source = (REPO / "fairseq_modattn" / path).read_text()
        docstring = source.split('"""')[1]
        assert "docs/fidelity.md" in docstring, path


# ------------------------------------------------------------- references to the documentation
#: files whose text may cite the documentation under docs/
CITING = ("fairseq_modattn/**/*.py", "README.md", "docs/*.md", "examples/**/*.md", "benchmarks/*.md")
#: every text file of the repository that might name the design document
ALL_TEXT = CITING + ("tests/*.py", "benchmarks/*.py", "scripts/*.sh", "pyproject.toml", "examples/**/*")
DESIGN = REPO / "docs" / "design.md"
#: the project-internal notes users do not have (spelled in two parts so that this file passes)
INTERNAL_DESIGN = "DESIGN" + ".md"


def files_matching(patterns):
    return sorted({p for pattern in patterns for p in REPO.glob(pattern) if p.is_file()})


def design_sections():
    """The headings of docs/design.md (fenced code blocks left out), whitespace collapsed."""
    text = re.sub(r"^```.*?^```", "", DESIGN.read_text(), flags=re.M | re.S)
    return {" ".join(h.split()) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.M)}


def test_cited_docs_exist():
    cited = {}
    for path in files_matching(CITING):
        for name in re.findall(r"docs/[\w./-]*\w\.md", path.read_text()):
            cited.setdefault(name, set()).add(str(path.relative_to(REPO)))
    assert "docs/design.md" in cited and "docs/fidelity.md" in cited, "the path pattern is wrong"
    missing = {name: sorted(where) for name, where in cited.items() if not (REPO / name).is_file()}
    assert not missing, f"documents cited but absent (document: citing files): {missing}"


def test_cited_design_sections_exist():
    sections = design_sections()
    assert {"Evaluation definitions", "fairseq pitfalls", "DMA"} <= sections, sections
    # docs/design.md, "Section" (the quote may follow a backtick, a comma and a line break)
    citation = re.compile(r"docs/design\.md`?,?\s+[\"']([^\"']+)[\"']")
    cited, unknown = 0, []
    for path in files_matching(CITING):
        for name in citation.findall(path.read_text()):
            cited += 1
            name = " ".join(name.split())
            if name not in sections:
                unknown.append(f"{path.relative_to(REPO)}: {name!r}")
    assert cited >= 5, "the citation pattern is wrong"
    assert not unknown, f"docs/design.md has no such section: {unknown}; it has {sorted(sections)}"


def test_no_file_cites_the_internal_design_notes():
    citing = [str(p.relative_to(REPO)) for p in files_matching(ALL_TEXT)
              if INTERNAL_DESIGN in p.read_text(errors="replace")]
    assert not citing, f"{citing} cite {INTERNAL_DESIGN}, which users do not have: cite docs/design.md"


def test_design_layout_is_complete_and_current():
    """docs/design.md's "Layout" names every module of the package and only files that exist."""
    text = DESIGN.read_text()
    layout = text[text.index("\n## Layout\n"):]
    layout = layout[:layout.index("\n## ", 1)]
    named = set(re.findall(r"\b(\w+\.py)\b", layout))
    missing = sorted(n for n in named if not any(REPO.glob(f"**/{n}")))
    assert not missing, f"docs/design.md's layout names files that do not exist: {missing}"
    # the layout names compat/ as one folder; its fixes are listed, module by module, in
    # "fairseq pitfalls"
    compat = REPO / "fairseq_modattn" / "compat"
    modules = {p.name for p in REPO.glob("fairseq_modattn/**/*.py")
               if p.name != "__init__.py" and p.parent != compat}
    unnamed = sorted(modules - named)
    assert not unnamed, f"docs/design.md's layout does not name {unnamed}"
    fixes = {p.name for p in compat.glob("[!_]*.py")}
    unlisted = sorted(name for name in fixes if f"compat/{name}" not in text)
    assert fixes and not unlisted, f"docs/design.md does not list the compat fixes {unlisted}"
