"""Write or check the generated reference pages: `python -m spmd_train.cli.reference_docs --write|--check`.

docs/reference/config.md comes from the config schema and docs/reference/cli.md from the command's parser, so the
reference cannot drift from the code; `--check` exits 1 naming each page that has (`make docs` rewrites them).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from spmd_train.cli.command_reference import cli_reference
from spmd_train.cli.config_reference import config_reference

ROOT = Path(__file__).resolve().parents[2]
PAGES: dict[str, Callable[[], str]] = {
    "docs/reference/config.md": config_reference,
    "docs/reference/cli.md": cli_reference,
}
"""Each generated page, relative to the repository root, and the function that writes its text."""


def generated_pages() -> dict[str, str]:
    """Each generated page's path (relative to the repository root) and its text as the code now makes it."""
    return {path: make() for path, make in PAGES.items()}


def stale_pages(root: Path | None = None) -> list[str]:
    """The generated pages whose checked-in text (under `root`, default the repository) differs from the code's."""
    root = root or ROOT
    return [path for path, text in generated_pages().items()
            if not (root / path).exists() or (root / path).read_text() != text]


def write_pages(root: Path | None = None) -> list[str]:
    """Write every generated page under `root` (default the repository); returns the paths that changed."""
    root = root or ROOT
    changed = stale_pages(root)
    for path, text in generated_pages().items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return changed


def main(argv: list[str] | None = None) -> int:
    """Entry point: --write rewrites the pages, --check exits 1 naming the stale ones."""
    parser = argparse.ArgumentParser(prog="python -m spmd_train.cli.reference_docs", description=__doc__)
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--write", action="store_true", help="rewrite docs/reference/ from the code")
    how.add_argument("--check", action="store_true", help="exit 1 if a page differs from what the code makes")
    args = parser.parse_args(argv)
    if args.write:
        changed = write_pages()
        print(f"rewrote {', '.join(changed)}" if changed else "docs/reference/ is up to date")
        return 0
    stale = stale_pages()
    for path in stale:
        print(f"{path} is stale: run `make docs` (or `python -m spmd_train.cli.reference_docs --write`) and commit it",
              file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
