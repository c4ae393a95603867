#!/usr/bin/env bash
# The API reference: Doxygen (Debian's `doxygen`, which tools/setup.sh installs) over the public
# headers listed in gpipe/public_headers.txt, with docs/Doxyfile, into OUT (default build/api; its
# HTML in OUT/html). Also pages for the Notes and docs/design.md (tools/api_docs.py).
# Prints Doxygen's warnings and exits 1 if there are any: an undocumented public class, function,
# member or option is one, as are a broken reference, a Note that docs/design.md names but no
# source holds, a header outside the internal/ folders that the list leaves out, and an include
# circle among gpipe's headers.
#
#   tools/api_docs.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/api}
command -v doxygen > /dev/null || { echo "tools/api_docs.sh: no doxygen (tools/setup.sh installs it)" >&2; exit 1; }

# Only what an earlier run made there goes (OUT may be a folder of other things).
mkdir -p "$out"
rm -rf "${out:?}/html" "$out/src" "$out/pages" "$out/warnings.log"
out_abs=$(cd "$out" && pwd)
log="$out/warnings.log"
# The headers as Doxygen reads them, and the pages (tools/api_docs.py); its warnings first.
prepare_rc=0
python3 tools/api_docs.py "$out" 2> "$log" || prepare_rc=$?
mapfile -t headers < <(cd "$out/src" && find . -name "*.h" | sed 's|^\./||' | sort)
doxygen_rc=0
{
  cat docs/Doxyfile
  echo "OUTPUT_DIRECTORY = $out"
  echo "INPUT = ${headers[*]/#/$out/src/} $out/pages"
  echo "STRIP_FROM_PATH = $out/src $out/pages"
  echo "STRIP_FROM_INC_PATH = $out/src"
  echo "WARN_LOGFILE = $log.doxygen"
} | doxygen - || doxygen_rc=$?
# Warnings name the headers as gpipe/gpipe.h (the copies keep the headers' lines); Doxygen says
# some twice (a function in its file and in its namespace).
sed -e "s|$out_abs/src/||" -e "s|$PWD/||" "$log.doxygen" 2> /dev/null | awk '!seen[$0]++' >> "$log"
rm -f "$log.doxygen"

# A message may go on for several lines; count the lines that start one.
warnings=$(grep -cE "(warning|error): " "$log" || true)
cat "$log"
echo "api_docs: $warnings warnings in ${#headers[@]} public headers and the pages; the reference is $out/html/index.html"
if ((warnings > 0 || doxygen_rc != 0 || prepare_rc != 0)); then
  exit 1
fi
