#!/usr/bin/env python3
"""Checks that every C++ code block in the docs is marked and still the text of the source it
quotes, so that every block compiles (fragments are quoted from docs/snippets.cc).

A block is marked by a line `<!-- snippet: PATH [TAG] -->` right before it (indented as the block
is, inside a list item); the source's text is what lies between two `// [TAG]` lines in PATH,
compared with the block's text less its indentation. A ```cpp block without a mark fails. A source may also hold variants of a snippet, a
line `// snippet-variant: [B] is [A] with "x" -> "y", "u" -> "v"` saying that the text between
its `// [B]` lines is [A]'s with those replacements (the README's quick start on the CPU).
Usage: tools/check_doc_snippets.py README.md docs/*.md
Exits 1 and says which snippet differs.
"""
import pathlib
import re
import sys

MARK = re.compile(r"^([ \t]*)<!-- snippet: (\S+) \[(\w+)\] -->\n\1```cpp\n(.*?)```", re.S | re.M)
# Any C++ block: ``` or ~~~ fences, cpp, c++, cc or cxx, inside a list or a quote too.
BLOCK = re.compile(r"^[ \t>]*(```|~~~)[ \t]*(cpp|c\+\+|cc|cxx)\b", re.M)
VARIANT = re.compile(r"// snippet-variant: \[(\w+)\] is \[(\w+)\] with (.*)\n")
REPLACEMENT = re.compile(r'"([^"]*)" -> "([^"]*)"')


def tagged(source_text, tag):
    """The text after a `// [tag]` line up to the next `// [tag]` (the indentation before that
    one included, as a Markdown block indented alike ends), or None."""
    found = re.search(r"// \[%s\]\n(.*?)// \[%s\]\n" % (tag, tag), source_text, re.S)
    return found.group(1) if found else None


def variants_differing(source, source_text):
    """The variants declared in `source` that are not their snippet with its replacements."""
    bad = []
    for variant, base, replacements in VARIANT.findall(source_text):
        text = tagged(source_text, base)
        pairs = REPLACEMENT.findall(replacements)
        if text is None or not pairs:
            bad.append(f"{source}: variant [{variant}] names [{base}], which is not there, or no "
                       f"replacements")
            continue
        for old, new in pairs:
            text = text.replace(old, new)
        if tagged(source_text, variant) != text:
            bad.append(f"{source}: [{variant}] is not [{base}] with {replacements}")
    return bad


def main(paths):
    root = pathlib.Path(__file__).resolve().parent.parent
    bad = 0
    checked = 0
    sources = set()
    for path in paths:
        text = pathlib.Path(path).read_text()
        marked = len(MARK.findall(text))
        blocks = len(BLOCK.findall(text))
        if blocks != marked:
            print(f"{path}: {blocks - marked} C++ block(s) without a `<!-- snippet: PATH [TAG] -->` "
                  f"line: quote each from a compiled source (fragments: docs/snippets.cc)")
            bad += blocks - marked
        for indent, source, tag, block in MARK.findall(text):
            block = "".join(line[len(indent):] if line.startswith(indent) else line
                            for line in block.splitlines(keepends=True))
            source_text = (root / source).read_text()
            sources.add(source)
            checked += 1
            if tagged(source_text, tag) != block:
                print(f"{path}: snippet [{tag}] is not the text of {source}")
                bad += 1
    for source in sorted(sources):
        source_text = (root / source).read_text()
        checked += len(VARIANT.findall(source_text))
        for message in variants_differing(source, source_text):
            print(message)
            bad += 1
    print(f"doc snippets: {checked} checked, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
