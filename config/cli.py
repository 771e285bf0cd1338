"""Command-line pieces the entry points share: one --config file, negative numbers as option values.

`--config` is read once: given twice, argparse keeps the last file and the first one's settings vanish
without a word. Merging files in order would be a second override mechanism beside `section.key=value`,
so a second --config is refused, naming both files.

argparse reads `-1e9`, `-inf` or `-nan` after an option as another option (only `-5` and `-0.5` look like
numbers to it) and answers with a usage message that never mentions the value. `numbers_as_values` joins
such a value to its option (`--tokens=-1e9`) so the tool itself can refuse it in one line.
"""

from __future__ import annotations

from collections.abc import Sequence

from config.schema import ConfigError


def one_config_file(paths: list[str] | None, default: str | None) -> str | None:
    """The --config path of an `action="append"` option (`default` when not given); two or more: ConfigError."""
    if not paths:
        return default
    if len(paths) > 1:
        raise ConfigError(
            f"--config is given {len(paths)} times ({', '.join(paths)}): give one file, and the changes to "
            f"it as section.key=value overrides"
        )
    return paths[0]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def numbers_as_values(argv: Sequence[str], number_options: Sequence[str]) -> list[str]:
    """`argv` with each of `number_options` followed by a negative-looking number joined to it
    (`--tokens -1e9` -> `--tokens=-1e9`), so argparse takes the number as the option's value."""
    joined: list[str] = []
    k = 0
    while k < len(argv):
        arg = argv[k]
        if arg in number_options and k + 1 < len(argv) and argv[k + 1].startswith("-") and _is_number(argv[k + 1]):
            joined.append(f"{arg}={argv[k + 1]}")
            k += 2
            continue
        joined.append(arg)
        k += 1
    return joined
