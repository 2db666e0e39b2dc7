#!/usr/bin/env bash
# Fill a header cache with ONNX Runtime's official C/C++ API headers, taken from Debian trixie's
# libonnxruntime-dev package. Nothing is installed and nothing on the system changes: apt runs
# against a temporary sources list and lists dir, `apt-get download` fetches the .deb and
# `dpkg -x` unpacks it into a scratch dir, from which only usr/include/onnxruntime is kept.
#
# usage: fetch_ort_headers.sh CACHE_DIR      (headers end up in CACHE_DIR/onnxruntime_cxx_api.h ...)
# env:   ORTSPARSE_DEBIAN_SUITE (default trixie), ORTSPARSE_DEBIAN_MIRROR (default: the machine's own)
set -euo pipefail

cache_dir=${1:?usage: fetch_ort_headers.sh CACHE_DIR}
suite=${ORTSPARSE_DEBIAN_SUITE:-trixie}

if [ -f "$cache_dir/onnxruntime_cxx_api.h" ]; then
  echo "ortsparse: ORT headers already in $cache_dir"
  exit 0
fi
for tool in apt-get dpkg; do
  command -v "$tool" >/dev/null || { echo "ortsparse: '$tool' not found: not a Debian-family machine" >&2; exit 1; }
done

# The machine's configured Debian mirror: deb822 "URIs:" lines first, then one-line "deb URI ..." entries.
mirror=${ORTSPARSE_DEBIAN_MIRROR:-}
if [ -z "$mirror" ]; then
  mirror=$( { cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ {for (i = 2; i <= NF; i++) print $i}';
              cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null |
                awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $i !~ /\]$/) {print $i; break}}'; } |
            grep -E '/debian/?$' | head -n 1 || true)
fi
[ -n "$mirror" ] || { echo "ortsparse: no Debian mirror found in /etc/apt/sources.list*; set ORTSPARSE_DEBIAN_MIRROR" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/deb"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
if [ -f "$keyring" ]; then
  echo "deb [signed-by=$keyring] $mirror $suite main" > "$work/sources.list"
else
  echo "deb $mirror $suite main" > "$work/sources.list"
fi
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=$work/none"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")

echo "ortsparse: fetching libonnxruntime-dev ($suite) from $mirror for its headers (nothing is installed)"
apt-get -q "${apt_opts[@]}" update >"$work/apt.log" 2>&1 || { cat "$work/apt.log" >&2; exit 1; }
(cd "$work/deb" && apt-get -q "${apt_opts[@]}" download libonnxruntime-dev >>"$work/apt.log" 2>&1) ||
  { cat "$work/apt.log" >&2; exit 1; }
dpkg -x "$work"/deb/libonnxruntime-dev_*.deb "$work/x"
[ -f "$work/x/usr/include/onnxruntime/onnxruntime_cxx_api.h" ] ||
  { echo "ortsparse: the package holds no onnxruntime_cxx_api.h" >&2; exit 1; }

mkdir -p "$(dirname "$cache_dir")"
tmp_dest=$(mktemp -d "$(dirname "$cache_dir")/.ort-headers.XXXXXX")
cp -r "$work/x/usr/include/onnxruntime/." "$tmp_dest/"
ls "$work"/deb/*.deb | xargs -n1 basename > "$tmp_dest/SOURCE_PACKAGE"
rm -rf "$cache_dir" && mv "$tmp_dest" "$cache_dir"
echo "ortsparse: ORT headers ready in $cache_dir ($(cat "$cache_dir/SOURCE_PACKAGE"))"
