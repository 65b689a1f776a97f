#!/bin/sh
# Trims the image's virtualenv (the Containerfile's build stages run it): pip and setuptools
# go (nothing is installed at run time), botocore keeps the models of S3 and of the services
# credentials come from (STS for web identity, SSO), and the bytecode is compiled once, since
# the image's user cannot write it next to the sources.
set -eu
# Usage: slim-venv VENV [MODULE …]: the modules are imported once trimmed.
venv="$1"
"$venv/bin/python" -m pip uninstall -q -y pip setuptools
for data in "$venv"/lib/python3*/site-packages/botocore/data; do
  find "$data" -mindepth 1 -maxdepth 1 -type d \
    ! -name s3 ! -name sts ! -name sso ! -name sso-oidc -exec rm -rf {} +
done
find "$venv" -name '__pycache__' -prune -exec rm -rf {} +
"$venv/bin/python" -m compileall -q "$venv/lib"

# Wheels ship their C extensions with symbols: stripped, they are a third of the size. Not
# the libraries auditwheel vendored and rewrote with patchelf (in *.libs folders, or with an
# $ORIGIN run path): strip moves what patchelf placed, and they no longer load.
if command -v strip >/dev/null && command -v readelf >/dev/null; then
  find "$venv" -name '*.so*' -type f ! -path '*.libs/*' | while read -r lib; do
    if ! readelf -d "$lib" 2>/dev/null | grep -q 'ORIGIN'; then
      strip --strip-unneeded "$lib"
    fi
  done
fi
# Every module that loads a library must still import (the Containerfile names them).
if [ "$#" -gt 1 ]; then
  shift
  "$venv/bin/python" -c "import importlib, sys; [importlib.import_module(m) for m in sys.argv[1:]]" "$@"
fi
