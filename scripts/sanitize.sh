#!/usr/bin/env bash
# Sanitizer runs of the native code (README, "Reliability"):
#   scripts/sanitize.sh asan   ASan + UBSan build; op tests, kernel twins and a fuzz slice run against it
#   scripts/sanitize.sh tsan   TSan build; the concurrency tests (threads x Run() on one session)
# The sanitized library and _kernels module are built under build/sanitize-<kind> and loaded through
# ORTSPARSE_LIBRARY / ORTSPARSE_KERNELS_MODULE into the normal Python (its runtime is preloaded).
# Extra arguments go to pytest. Needs the package installed (scripts/test.sh does that).
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-asan}"; shift || true
case "$kind" in
  asan) flags="address,undefined"
        # libstdc++ preloaded too: ASan's __cxa_throw interceptor needs it resolved at start-up.
        runtime="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
        tests=(tests/ops tests/fuzz)
        export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:symbolize=1"
        export UBSAN_OPTIONS="halt_on_error=1:abort_on_error=1:print_stacktrace=1" ;;
  tsan) flags="thread"
        runtime="$(gcc -print-file-name=libtsan.so) $(gcc -print-file-name=libstdc++.so.6)"
        # Run() concurrency on the caller threads; ORT's own pool is uninstrumented (see tsan.supp)
        tests=(-m "concurrency" -k "not pool" tests/ops)
        export TSAN_OPTIONS="halt_on_error=1:abort_on_error=1:report_signal_unsafe=0:suppressions=$PWD/scripts/tsan.supp" ;;
  *) echo "usage: $0 asan|tsan [pytest args]" >&2; exit 2 ;;
esac
build="build/sanitize-$kind"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DORTSPARSE_SANITIZE="$flags" \
      -DPython_EXECUTABLE="$(command -v python)" > "$build.configure.log"
cmake --build "$build" -j 2 --target ortsparse_ops _kernels > "$build.build.log"
export ORTSPARSE_LIBRARY="$PWD/$build/libortsparse_ops.so"
export ORTSPARSE_KERNELS_MODULE="$(ls "$PWD/$build"/_kernels*.so)"
# Python and onnxruntime are not instrumented; the runtime must come first in the process.
LD_PRELOAD="$runtime" python -m pytest -q -p no:cacheprovider "${tests[@]}" "$@"
