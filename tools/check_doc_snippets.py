#!/usr/bin/env python3
"""Checks that every code block marked in the docs is still the text of the source it quotes.

A block is marked by a line `<!-- snippet: PATH [TAG] -->` right before it; the source's text is
what lies between two `// [TAG]` lines in PATH. Usage: tools/check_doc_snippets.py docs/*.md
Exits 1 and says which snippet differs.
"""
import pathlib
import re
import sys

MARK = re.compile(r"<!-- snippet: (\S+) \[(\w+)\] -->\n```cpp\n(.*?)```", re.S)


def main(paths):
    root = pathlib.Path(__file__).resolve().parent.parent
    bad = 0
    checked = 0
    for path in paths:
        text = pathlib.Path(path).read_text()
        for source, tag, block in MARK.findall(text):
            source_text = (root / source).read_text()
            found = re.search(r"// \[%s\]\n(.*?)// \[%s\]\n" % (tag, tag), source_text, re.S)
            checked += 1
            if not found or found.group(1) != block:
                print(f"{path}: snippet [{tag}] is not the text of {source}")
                bad += 1
    print(f"doc snippets: {checked} checked, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
