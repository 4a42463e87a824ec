"""Regenerate `sentences.txt`: real English prose from the Python standard library's docstrings.

Run once with any CPython 3.11 (`python -m tritonkit.data.make_corpus`); the output is committed, so builds never
depend on the interpreter that happens to be installed. Docstrings are parsed with `ast` (nothing is imported),
split into sentences and short paragraphs, filtered to prose (no code, no tables), deduplicated and shuffled
with a fixed seed. The text is © Python Software Foundation, PSF License v2 (see the data README).
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
from pathlib import Path

OUT = Path(__file__).with_name("sentences.txt")
_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_CODE = re.compile(r"(>>>|::|\(\)|[{}\[\]=<>_#\\|@$`*]|\.\.\.|https?:|\w\.\w+\(|\s{2,}|--)")


def docstrings(root: Path):
    skip = ("test", "idlelib", "lib2to3", "site-packages", "turtledemo", "ensurepip", "tkinter")
    for path in sorted(root.rglob("*.py")):
        if any(part in skip or part.startswith("test") for part in path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def prose(text: str) -> bool:
    words = text.split()
    if not 4 <= len(words) <= 160 or _CODE.search(text):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return letters / len(text) > 0.93 and text[0].isupper() and text[-1] in ".!?"


def main() -> None:
    seen, texts = set(), []
    for doc in docstrings(Path(sysconfig.get_paths()["stdlib"])):
        for para in re.split(r"\n\s*\n", doc):
            para = " ".join(para.split())
            candidates = _SENT.split(para)
            # Whole paragraphs give the long texts; single sentences the short ones.
            if len(candidates) > 2:
                candidates.append(para)
            for text in candidates:
                key = text.lower()
                if prose(text) and key not in seen:
                    seen.add(key)
                    texts.append(text)
    random.Random(0).shuffle(texts)
    OUT.write_text("\n".join(texts) + "\n", encoding="utf-8")
    print(f"{len(texts)} texts -> {OUT}")


if __name__ == "__main__":
    main()
