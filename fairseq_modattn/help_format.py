"""The help formatter of the ``fairseq-modattn`` commands: each option's default shown once.

argparse's ``ArgumentDefaultsHelpFormatter`` appends ``(default: X)`` to every option. That
doubles the note of a help text that states its default itself ("(default: the last)
(default: None)"), and adds noise where there is nothing to tell: ``(default: None)`` of an
option that is simply unset, ``(default: False)`` of an on/off flag, ``(default: )`` of an
empty string, ``(default: ['a', 'b'])`` of a list. ``DefaultsHelpFormatter`` appends the note
only where it tells something, lists written as they are typed (``a b``). It also wraps lines
without breaking at hyphens, so a flag named in a help text ('--max-len-b') stays whole.
"""

import argparse
import re
import textwrap

_OWN_NOTE = re.compile(r"\(default\b[^)]*\)")
_WHITESPACE = re.compile(r"\s+")


def shown_default(action: argparse.Action):
    """ACTION's default as its help should show it, or None where no note should be added:
    unset (None), suppressed, a flag (takes no value), an empty string or list, a positional
    argument that must be given."""
    default = action.default
    if default is None or default is argparse.SUPPRESS or action.nargs == 0:
        return None
    if not action.option_strings and action.nargs not in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
        return None
    shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
    return shown or None


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help once, and only where it tells something:
    never to a help that states its default itself (its own "(default ...)" note), nor where
    ``shown_default`` is None."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = shown_default(action)
        if shown is None or "%(default)" in text:
            return text
        note = _OWN_NOTE.search(text)
        if note:
            return self._own_note(text, note.group(0), shown)
        return f"{text} (default: {_escaped(shown)})"

    def _own_note(self, text: str, note: str, shown: str) -> str:
        """The help of an option whose text states its default itself: left as it is."""
        return text

    def _split_lines(self, text, width):
        return textwrap.wrap(_WHITESPACE.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _fill_text(self, text, width, indent):
        return textwrap.fill(_WHITESPACE.sub(" ", text).strip(), width, initial_indent=indent,
                             subsequent_indent=indent, break_on_hyphens=False)


class ArchDefaultsHelpFormatter(DefaultsHelpFormatter):
    """For ``fairseq-modattn flags --arch ARCH``, whose option defaults are ARCH's values: a help
    with its own default note that does not name ARCH's value also gets "(ARCH: X)", so the
    value in force shows without a second "(default ...)"."""

    arch = "this architecture"

    def _own_note(self, text: str, note: str, shown: str) -> str:
        if shown in note or f"'{shown}' (default" in text:
            return text
        return f"{text} ({self.arch}: {_escaped(shown)})"


def _escaped(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help strings
