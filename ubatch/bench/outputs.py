"""Output paths a run checks before it starts: a long measurement must never end unable to write
what it measured."""

from __future__ import annotations

import argparse
import os


def file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot take a report (None: it can). A file this check creates is removed."""
    if os.path.isdir(path):
        return "is a directory, not a file"
    existed = os.path.exists(path)
    try:
        open(path, "a").close()
    except OSError as exc:
        return f"cannot be written: {exc.strerror}"
    if not existed:
        os.remove(path)
    return None


def folder_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot hold a run's files (None: it can); it is made where missing."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"cannot be made: {exc.strerror}"
    if not os.access(path, os.W_OK):
        return "cannot be written"
    return None


def check_outputs(
    parser: argparse.ArgumentParser,
    files: dict[str, str | os.PathLike[str] | None] | None = None,
    folders: dict[str, str | os.PathLike[str] | None] | None = None,
) -> None:
    """``parser.error`` naming the first flag whose path (files: a report; folders: a place for
    several) cannot be written; paths that are None were not asked for."""
    for kind, paths in ((file_problem, files or {}), (folder_problem, folders or {})):
        for flag, path in paths.items():
            problem = None if path is None else kind(path)
            if problem:
                parser.error(f"{flag} {str(path)!r} {problem}")
