#!/usr/bin/env python3
"""What tools/api_docs.sh gives Doxygen, written into OUT (run from the repository root):

  tools/api_docs.py OUT

- OUT/src: the public headers (gpipe/public_headers.txt) as Doxygen should read them, line for
  line (so that warnings name the header's own lines): the opening `//` comment as the file's
  description, `///   ` lines (the examples) as code, and each "Note [...]" of a `///` comment
  as a link to that Note. (One process for every header: an INPUT_FILTER starts one per header
  and pass, which takes most of the run.)
- OUT/pages: the main page; the Notes, every `// Note [...]` block of the sources (plain
  comments, which Doxygen does not show); and docs/design.md with its Notes linked.

Exits 1, saying why, when the list names a missing header or docs/design.md names a Note that no
source holds.
"""
import os
import re
import sys

# Where Notes are written: the sources, and the build files (CMakeLists.txt: `# Note [...]`).
LIST = "gpipe/public_headers.txt"

NOTE_ROOTS = ["gpipe", "balancing", "benchmarks", "examples", "tests", "tools", "third_party"]
NOTE_FILES = ["CMakeLists.txt"]
NOTE_EXTENSIONS = (".h", ".cc", ".bzl", ".sh", ".txt")

HEADING = re.compile(r"^\s*(//|#) Note \[(.+)\]\s*$")
UNDERLINE = re.compile(r"^\s*(//|#) ~+\s*$")
INLINE = re.compile(r"^\s*(//|#) Note \[([^\]]+)\]: (.*)$")


def slug(name):
    return "note_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


# --- the headers ---------------------------------------------------------------------------------

def link_notes(lines):
    """Each "Note [name]" in a `///` line becomes \\ref to the Note; a name that goes on to the
    next `///` line gets the link on "Note" alone, so that every line stays where it was."""
    out = list(lines)
    for i, line in enumerate(lines):
        start = line.find("///")
        if start < 0:
            continue
        text = line[start:]
        pieces = []
        pos = 0
        for m in re.finditer(r"Note \[", text):
            if m.start() < pos:
                continue
            end = text.find("]", m.end())
            if end >= 0:
                name = text[m.end():end]
                pieces.append(text[pos:m.start()])
                pieces.append('\\ref %s "Note [%s]"' % (slug(name), name))
                pos = end + 1
                continue
            # The name ends on a following `///` line.
            name = text[m.end():]
            for nxt in lines[i + 1:i + 4]:
                rest = nxt.strip()
                if not rest.startswith("///"):
                    break
                rest = rest[3:].strip()
                if "]" in rest:
                    name += " " + rest[:rest.index("]")]
                    pieces.append(text[pos:m.start()])
                    pieces.append('\\ref %s "Note" [' % slug(" ".join(name.split())))
                    pos = m.end()
                    break
                name += " " + rest
        pieces.append(text[pos:])
        out[i] = line[:start] + "".join(pieces)
    return out


def public_headers():
    with open(LIST) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def include_circles():
    """Circles of `#include "..."` among gpipe's own headers (public and internal), each as the
    list of headers around it, the first repeated at the end."""
    folders = ("gpipe", "gpipe/internal", "gpipe/distributed", "gpipe/distributed/internal",
               "balancing", "balancing/internal")
    headers = set()
    for folder in folders:
        if os.path.isdir(folder):
            headers.update(folder + "/" + n for n in os.listdir(folder) if n.endswith(".h"))
    includes = {}
    for h in headers:
        with open(h) as f:
            found = re.findall(r'^#include "([^"]+)"', f.read(), re.M)
        includes[h] = sorted(i for i in found if i in headers)
    state, circles = {}, []

    def visit(h, path):
        state[h] = "open"
        path.append(h)
        for i in includes[h]:
            if state.get(i) == "open":
                circles.append(path[path.index(i):] + [i])
            elif i not in state:
                visit(i, path)
        path.pop()
        state[h] = "done"

    for h in sorted(headers):
        if h not in state:
            visit(h, [])
    return circles


NAMESPACE_OPEN = re.compile(r"^\s*namespace\s+([\w:]*)\s*\{")
NAMESPACE_CLOSE = re.compile(r"^\s*\}\s*//\s*namespace\s*([\w:]*)")
# checkpoint_state.h defines a member of the public CheckpointFrame (docs/design.md).
OUTSIDE_ALLOWED = {"gpipe/internal/checkpoint_state.h"}


def names_outside_internal():
    """(header, line number, line) for each declaration of an internal header that is in a named
    namespace but not in an `internal` one (clang-format's `}  // namespace x` closing comments
    mark the namespaces' ends)."""
    out = []
    for folder in ("gpipe/internal", "gpipe/distributed/internal", "balancing/internal"):
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            h = folder + "/" + name
            if not h.endswith(".h") or h in OUTSIDE_ALLOWED:
                continue
            stack = []
            with open(h) as f:
                for number, line in enumerate(f, 1):
                    m = NAMESPACE_OPEN.match(line)
                    if m:
                        stack += (m.group(1) or "<anonymous>").split("::")
                        continue
                    m = NAMESPACE_CLOSE.match(line)
                    if m:
                        del stack[len(stack) - len((m.group(1) or "<anonymous>").split("::")):]
                        continue
                    if (stack and stack[0] == "gpipe" and "internal" not in stack
                            and re.match(r"[A-Za-z]", line)):
                        out.append((h, number, line.strip()))
    return out


def filter_header(path):
    with open(path) as f:
        lines = f.read().split("\n")
    # The opening `//` comment, right before `#pragma once`, describes the file.
    k = 0
    while k < len(lines) and lines[k].startswith("// "):
        k += 1
    if 0 < k < len(lines) and lines[k].strip() == "#pragma once":
        for j in range(k):
            lines[j] = "/" + lines[j]
        lines[k] = "/// \\file"
    # `///   code`: two spaces more make it a Markdown code block (four past the text's one).
    # In the text, a flag's "--" stays two dashes (Markdown would make it one).
    for i, line in enumerate(lines):
        if re.match(r"^\s*///   ", line):
            lines[i] = re.sub(r"^(\s*///)   ", r"\1     ", line)
        elif "///" in line:
            lines[i] = re.sub(r"(?<![-\\])--(?=\w)", r"\\--", line)
    return "\n".join(link_notes(lines))


# --- the pages ----------------------------------------------------------------------------------

def source_files():
    for root in NOTE_ROOTS:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(NOTE_EXTENSIONS) or name == "BUILD":
                    yield os.path.join(folder, name)
    for path in NOTE_FILES:
        if os.path.exists(path):
            yield path


def comment_body(lines, start, marker):
    """The comment lines from `start` on that begin with `marker`, without it."""
    body = []
    for line in lines[start:]:
        stripped = line.strip()
        if not stripped.startswith(marker) or stripped.startswith("///"):
            break
        text = stripped[len(marker):]
        body.append(text[1:] if text.startswith(" ") else text)
    return body


def find_notes():
    """{name: (path, line, body lines)}: each Note's heading block (`// Note [name]`, a `~~~`
    line, the text), or, for a name without one, its first `// Note [name]: text` block."""
    notes, inline = {}, {}
    for path in source_files():
        try:
            with open(path) as f:
                lines = f.read().split("\n")
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(lines):
            m = HEADING.match(line)
            if m:
                first = i + 1
                if first < len(lines) and UNDERLINE.match(lines[first]):
                    first += 1
                notes.setdefault(m.group(2), (path, i + 1, comment_body(lines, first, m.group(1))))
                continue
            m = INLINE.match(line)
            if m and m.group(2) not in inline:
                body = [m.group(3)] + comment_body(lines, i + 1, m.group(1))
                inline[m.group(2)] = (path, i + 1, body)
    for name, note in inline.items():
        notes.setdefault(name, note)
    return notes


MAIN_PAGE = """\
/** \\mainpage gpipe API reference

The classes, functions and options of gpipe's public headers (`gpipe/public_headers.txt`), from
their `///` comments. Start with gpipe::GPipeImpl (the module, held as gpipe::GPipe) and
gpipe::GPipeOptions; across processes, gpipe::distributed::PipelineStageImpl and
gpipe::distributed::DataParallelImpl.

- **Files**: each public header and what it is for; **Namespaces**: gpipe and
  gpipe::distributed, every function by name; **Classes**: every class, struct and option set.
- An option written as a variable with a default (`std::vector<c10::Device> devices = {}`) is
  LibTorch's `TORCH_ARG`: set it with `.devices({...})` (which returns the options, for
  chaining), read it with `.devices()`. The options GPipe and PipelineStage share are setter and
  getter functions of gpipe::PipelineOptions and gpipe::PipelineOptionsCore.
- \\ref design "How gpipe works" (`docs/design.md`): the engine file by file, each concept with
  its Notes.
- \\ref notes "The Notes": every design decision, as the `// Note [...]` comment beside the code
  it explains. A "Note [...]" in this reference links there.

The guides are the Markdown files of `docs/`, starting with
<a href="{to_docs}/getting-started.md">docs/getting-started.md</a>.
*/

/** \\namespace gpipe
Pipeline parallelism for LibTorch in one process: gpipe::GPipe, its schedules, skips, ties,
balancers and planner (`//gpipe`, `//balancing`).
*/

/** \\namespace gpipe::distributed
Pipelines and replicas across processes on c10d: gpipe::distributed::PipelineStage,
gpipe::distributed::DataParallel, process groups (`//gpipe/distributed`).
*/
"""


def notes_page(notes):
    """The Notes in the order docs/design.md names them first, then the others by file."""
    with open("docs/design.md") as f:
        design = " ".join(f.read().split())
    def order(item):
        name, (path, line, _) = item
        at = design.find("[%s]" % name)
        return (at if at >= 0 else len(design), path, line)
    out = ["Notes {#notes}", "=====", "",
           "The Notes of gpipe's sources: each design decision, as the `// Note [...]` comment "
           "beside the code it explains, in the order \\ref design \"How gpipe works\" names "
           "them (then the others, by file).", ""]
    for name, (path, line, body) in sorted(notes.items(), key=order):
        out.append("\\section %s Note [%s]" % (slug(name), name))
        out.append("`%s:%d`" % (path, line))
        out.append("")
        out.append("\\verbatim")
        out.extend(body)
        out.append("\\endverbatim")
        out.append("")
    return "\n".join(out)


def design_page(notes, html_dir):
    with open("docs/design.md") as f:
        text = f.read()
    to_docs = os.path.relpath("docs", html_dir)
    missing = set()
    # "Note [a]" and "Notes [a], [b]": each name a link to its Note.
    def link_list(m):
        def link(n):
            name = " ".join(n.group(1).split())
            if name == "...":
                return n.group(0)
            if name not in notes:
                missing.add(name)
                return n.group(0)
            return '\\ref %s "[%s]"' % (slug(name), name)
        return re.sub(r"\[([^\]]+)\]", link, m.group(0))
    text = re.sub(r"Notes? \[[^\]]+\](?:, \[[^\]]+\])*", link_list, text)
    # Images and the other guides, from where the HTML lands.
    text = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)",
                  lambda m: '<img src="%s/%s" alt="%s">' % (to_docs, m.group(2), m.group(1)), text)
    text = re.sub(r"\[([^\]]+)\]\(([a-z_-]+\.md)\)",
                  lambda m: '<a href="%s/%s">%s</a>' % (to_docs, m.group(2), m.group(1)), text)
    title, rest = text.split("\n", 1)
    return title + " {#design}\n" + rest, sorted(missing)


def main(out_dir):
    headers = public_headers()
    absent = [h for h in headers if not os.path.isfile(h)]
    for h in absent:
        print("%s: warning: %s lists it, but it does not exist" % (h, LIST), file=sys.stderr)
    # A header outside the internal/ folders is public: Bazel's public targets export every one
    # (hdrs = glob(["*.h"])), so each must be listed, documented and installed.
    for folder in ("gpipe", "gpipe/distributed", "balancing"):
        for name in sorted(os.listdir(folder)):
            h = folder + "/" + name
            if h.endswith(".h") and h not in headers:
                print("%s: warning: a public header (outside internal/) that %s does not list; "
                      "list it, or move it to %s/internal/" % (h, LIST, folder), file=sys.stderr)
    # A public header that includes an internal one would make it API by accident (a program
    # compiles it, CMake must install it): declare the type instead, or make it public.
    for h in headers:
        if h in absent:
            continue
        with open(h) as f:
            for number, line in enumerate(f, 1):
                m = re.match(r'#include "([^"]+/internal/[^"]+)"', line)
                if m:
                    print("%s:%d: warning: a public header includes the internal header %s; "
                          "declare what it needs from it instead, or make that header public"
                          % (h, number, m.group(1)), file=sys.stderr)
    for h, number, line in names_outside_internal():
        print("%s:%d: warning: an internal header declares '%s' outside an internal namespace; "
              "put it in gpipe::internal (gpipe::distributed::internal in gpipe/distributed)"
              % (h, number, line[:60]), file=sys.stderr)
    for circle in include_circles():
        print("%s: warning: an include circle among gpipe's headers: %s; break it (the headers "
              "are layered: a header never includes, through others, one that includes it)"
              % (circle[0], " -> ".join(circle)), file=sys.stderr)
    for h in headers:
        if h in absent:
            continue
        copy = os.path.join(out_dir, "src", h)
        os.makedirs(os.path.dirname(copy), exist_ok=True)
        with open(copy, "w") as f:
            f.write(filter_header(h))
    pages = os.path.join(out_dir, "pages")
    os.makedirs(pages, exist_ok=True)
    notes = find_notes()
    design, missing = design_page(notes, os.path.join(out_dir, "html"))
    with open(os.path.join(pages, "mainpage.dox"), "w") as f:
        f.write(MAIN_PAGE.replace("{to_docs}", os.path.relpath("docs", os.path.join(out_dir, "html"))))
    with open(os.path.join(pages, "notes.md"), "w") as f:
        f.write(notes_page(notes))
    with open(os.path.join(pages, "design.md"), "w") as f:
        f.write(design)
    for name in missing:
        print("docs/design.md: warning: Note [%s] is in no source file" % name, file=sys.stderr)
    print("api_docs: %d public headers, %d Notes" % (len(headers), len(notes)))
    return 1 if missing or absent else 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
