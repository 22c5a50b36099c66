"""Writes zerofn/data/corpus.txt, the small English corpus the main training job learns.

The text is the docstrings of a fixed list of Python standard library modules (module,
class, function and method docstrings, dedented by ``inspect.getdoc``), in a deterministic
order. It is part of CPython's source and distributed under the Python Software Foundation
License (PSF-2.0), which allows copying it with this notice: Copyright (c) 2001 Python
Software Foundation; All Rights Reserved.

No network is needed: the text comes from the interpreter running this script, so the
corpus is reproducible for a given Python version (the committed file came from 3.11).

    python3 tools/make_corpus.py            # rewrites zerofn/data/corpus.txt
"""
from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

# Modules chosen for long, prose-heavy docstrings; listed, not discovered, so the order
# and content never depend on what else is installed.
MODULES = (
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message", "enum",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib",
    "heapq", "hmac", "html.parser", "http.client", "http.server", "imaplib", "inspect",
    "io", "ipaddress", "itertools", "json", "logging", "mailbox", "multiprocessing",
    "numbers", "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pkgutil",
    "platform", "poplib", "pprint", "queue", "random", "re", "sched", "secrets", "shelve",
    "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize",
    "trace", "traceback", "typing", "unittest", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile",
)
OUT = Path(__file__).resolve().parent.parent / "zerofn" / "data" / "corpus.txt"


def _members(obj) -> list:
    """Public classes and functions defined by ``obj`` itself, in name order."""
    owner = getattr(obj, "__name__", "")
    out = []
    for name, member in sorted(vars(obj).items()):
        if name.startswith("_") or not (inspect.isclass(member) or inspect.isroutine(member)):
            continue
        if inspect.isclass(obj) or getattr(member, "__module__", None) == owner:
            out.append(member)
    return out


def _docs(module) -> list[str]:
    docs = [inspect.getdoc(module)]
    for member in _members(module):
        docs.append(inspect.getdoc(member))
        if inspect.isclass(member):
            docs += [inspect.getdoc(m) for m in _members(member)]
    return docs


def build(modules=MODULES) -> str:
    seen, parts = set(), []
    for name in modules:
        for doc in _docs(importlib.import_module(name)):
            # Inherited docstrings repeat; one copy teaches as much.
            if doc and len(doc) > 40 and doc not in seen:
                seen.add(doc)
                parts.append(doc.strip())
    return "\n\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write the corpus")
    args = parser.parse_args()
    text = build()
    args.out.write_text(text, encoding="utf-8")
    print(f"wrote {len(text.encode()):,} bytes to {args.out}")


if __name__ == "__main__":
    main()
