#!/usr/bin/env bash
# Make `import dsflash` work from a checkout without installing (no network on the GPU machine):
# a folder holding a dsflash package whose subpackages point at the repo's top-level folders.
set -euo pipefail
site=${1:?folder}
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$site" && mkdir -p "$site/dsflash"
cp "$root/dsflash/__init__.py" "$site/dsflash/__init__.py"
for sub in model export plugins runtime; do ln -s "$root/$sub" "$site/dsflash/$sub"; done
