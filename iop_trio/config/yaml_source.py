"""node.yaml's YAML, read strictly: a key given twice in one mapping is refused rather
than silently replaced, and a YAML mistake is one line naming the line and column where
it is, in plain words (:func:`parse_yaml`).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .errors import ConfigError


class _Loader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader, but a key given twice in one mapping is an error: the
    second would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in lines:
                    problem = f"{key!r} @{lines[key]}"  # the line of the first, for the words
                    raise yaml.constructor.ConstructorError(
                        "duplicate key", None, problem, key_node.start_mark
                    )
                lines[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


#: YAML syntax errors in plain words: (a pattern searched in the parser's "context:
#: problem", the place to name, the words, with {0}... the pattern's groups). The place
#: is the parser's ``problem`` mark or its ``context`` mark (where the open quote,
#: bracket or key began), or is worked out from the text (:func:`_yaml_problem`):
#: ``colon``, a ':' after a value began (the line is indented too far, or the line
#: above has no ':', or a value holds ': '); ``block``, something else where the next
#: key should be (a line that does not line up, or text after a value).
_YAML_PROBLEMS: tuple[tuple[str, str, str], ...] = (
    (r"found character '\\t'", "problem", "a tab is not allowed for indenting; use spaces"),
    (r"character '(.)' that cannot start", "problem", "a value cannot start with '{0}'; quote it"),
    (r"quoted scalar: found unexpected end", "context", "an unclosed quote starts here"),
    (r"unknown escape character '(.*)'", "problem", "'\\{0}' is no escape; use '...' quotes"),
    (r"could not find expected ':'", "context", "a ':' is missing after the key"),
    (r"mapping values are not allowed", "colon", ""),
    (r"flow sequence: expected ','", "context", "this '[' is not closed, or an item has no ','"),
    (r"flow mapping: expected ','", "context", "this '{{' is not closed, or an item has no ','"),
    (r"<block end>, but found '-'", "problem", "a '- ' item where a key should be"),
    (r"expected <block end>", "block", ""),
    (r"undefined alias '(.*)'", "problem", "'*{0}' names no anchor; quote a value with '*'"),
    (r"^duplicate key: (.*) @(\d+)", "problem", "{0} is given twice (first on line {1})"),
    (r"found another document", "problem", "a second document ('---'); a config is one"),
    (r"for the tag '(.*)'", "problem", "unknown tag '{0}'; quote a value that starts with '!'"),
    (r"found '<stream end>'", "problem", "the text ends inside a '[' or '{{' that is not closed"),
    (r"sequence entries are not", "problem", "a '- ' item cannot follow a key on its line"),
    (r"node content, but found '(.*)'", "problem", "'{0}' where a value should be"),
)


def parse_yaml(text: str, source: str) -> Any:
    """``text`` parsed as YAML; a syntax error is one line naming the line and column
    where the mistake is, in plain words (:data:`_YAML_PROBLEMS`); a key given twice in
    one mapping is an error too."""
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        line, column, words = _yaml_problem(exc, text.splitlines())
        raise ConfigError(f"{source}, line {line + 1}, column {column + 1}: {words}") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise ConfigError(f"{source}, line {line}: a character YAML does not allow") from None


def _content(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _yaml_problem(exc: yaml.MarkedYAMLError, lines: list[str]) -> tuple[int, int, str]:
    """(line, column, words) for ``exc``, the line and column from 0."""
    said = f"{exc.context or ''}: {exc.problem or ''}"
    place, words = "problem", f"not valid YAML: {exc.problem}"  # one we have no words for
    for pattern, where, says in _YAML_PROBLEMS:
        if found := re.search(pattern, said):
            place, words = where, says.format(*found.groups())
            break
    mark = (exc.context_mark if place == "context" else None) or exc.problem_mark
    assert mark is not None  # PyYAML marks every problem it raises, as _Loader does
    line, column = mark.line, mark.column

    def text(at: int) -> str:
        return lines[at] if 0 <= at < len(lines) else ""

    def indent(at: int) -> int:
        return len(text(at)) - len(text(at).lstrip())

    if place == "colon" and ": " in text(line)[:column]:
        words = "a value holds ': '; put the value in quotes"
    elif place == "block" and column != indent(line):
        words = "unexpected text after the value; put the whole value in quotes"
    elif place in ("colon", "block"):  # this line is not where a key may be: say why
        above = next((i for i in range(line - 1, -1, -1) if _content(text(i))), -1)
        column = indent(line)
        if above >= 0 and not re.search(r":(\s|$)|^\s*- ", text(above)):
            line, column, words = above, indent(above), "a ':' is missing after the key"
        elif above >= 0 and column > len(text(above)) - len(text(above).lstrip(" -")):
            words = "this line is indented more than the one above it"
        else:
            words = "this line does not line up with the lines above it; check the indentation"
    return line, column, words


#: The settings that name files: a relative one is relative to the config file's folder.
