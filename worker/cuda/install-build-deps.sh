#!/usr/bin/env bash
# Build prerequisites for the CUDA worker (`make worker-cuda`), offline: only
# the Debian mirror and crates.io are reached.
#
# Why this is needed (evidence in docs/gpu.md):
# cubecl-cuda 0.11.x (burn 0.22's CUDA backend) always compiles two kernel
# compilers, NVRTC C++ and LLVM/NVPTX, and so depends unconditionally on
# cubecl-llvm. Its build dependency tracel-llvm-bundler downloads a prebuilt
# LLVM 23.1 from GitHub releases (unreachable here) unless it finds the
# sentinel file
#   ${XDG_DATA_HOME:-$HOME/.local/share}/tracel/tracel-llvm-23.1.0-4/.tracel-llvm-installed
# and then only runs `<that dir>/bin/llvm-config --link-static ...`.
# Debian has no LLVM 23 (bookworm-security has 22.1.x), so this script builds
# a stand-in prefix whose llvm-config forwards to Debian's llvm-22 one.
# llvm-sys 231 (LLVM 23.1's C API) is then linked against LLVM 22.1: not a
# combination upstream supports. The parts of the C API that changed between
# them are used only by pliron-llvm's IR importer, which cubecl-llvm does not
# call; cubecl-llvm's GPU-free NVPTX tests pass 10 of 11 (the 11th checks an
# optimisation LLVM 22 does not make). Where the official bundle can be
# copied in (linux-x64.tar.xz of tracel-llvm v23.1.0-4 in ~/.cache/tracel/),
# use it instead.
set -euo pipefail

LLVM_MAJOR=22
SHIM_HOME=${HEADROOM_LLVM_SHIM_HOME:-/opt/headroom/llvm-shim}   # used as XDG_DATA_HOME for cargo
BUNDLE_ID=tracel-llvm-23.1.0-4                                   # tracel-llvm-bundler 23.1.0-4

export DEBIAN_FRONTEND=noninteractive
# llvm-22-dev pulls llvm-22, llvm-22-tools, libllvm22, libz3-dev, libxml2-dev, libffi-dev;
# the static libs and headers come from llvm-22-dev. libzstd-dev for `-lzstd`, g++ for the C++ shims.
packages=("llvm-${LLVM_MAJOR}-dev" libzstd-dev zlib1g-dev g++)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
  apt-get update
  apt-get install -y --no-install-recommends "${packages[@]}"
fi

prefix="$SHIM_HOME/tracel/$BUNDLE_ID"
mkdir -p "$prefix/bin"
# Written only when it changes, and the sentinel created only once: the
# bundler's build script reruns when the sentinel's mtime changes
# (rerun-if-changed), and with it cubecl-llvm and every crate above it
# (about 10 minutes of release build on 2 cores).
cat > "$prefix/bin/llvm-config.new" <<SH
#!/bin/sh
# Forwards to Debian's llvm-config; rewrites absolute library paths (e.g. libz3.so),
# which tracel-llvm-bundler would otherwise turn into a bogus -llibz3.
# Also drops Polly/PollyISL: Debian's llvm-config lists them but ships no libPolly*.a
# (only the LLVMPolly.so plugin), and nothing outside Polly's own plugin needs them.
/usr/lib/llvm-${LLVM_MAJOR}/bin/llvm-config "\$@" \\
  | sed -E -e 's#(^| )/[^ ]*/lib([A-Za-z0-9_+-]+)\.so[.0-9]*#\1-l\2#g' \\
           -e 's#(^| )-lPolly(ISL)?( |\$)#\1#g; s#(^| )-lPolly(ISL)?( |\$)#\1#g'
SH
chmod +x "$prefix/bin/llvm-config.new"
if cmp -s "$prefix/bin/llvm-config.new" "$prefix/bin/llvm-config"; then
  rm -f "$prefix/bin/llvm-config.new"
else
  mv -f "$prefix/bin/llvm-config.new" "$prefix/bin/llvm-config"
fi
[[ -e "$prefix/.tracel-llvm-installed" ]] || touch "$prefix/.tracel-llvm-installed"

echo "LLVM stand-in ready at $prefix ($("$prefix/bin/llvm-config" --version))"
echo "Build with:"
echo "  XDG_DATA_HOME=$SHIM_HOME cargo build --release -p headroom-worker --features cuda"
echo "(a target dir that built cubecl-llvm without the stand-in first needs: cargo clean --release -p cubecl-llvm)"
