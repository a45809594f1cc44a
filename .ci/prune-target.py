#!/usr/bin/env python3
"""Removes what earlier CI runs left in the shared cargo target.

Each run builds a fresh clone, and cargo keys the workspace's own crates
by the clone's path, so every run adds its own copy of each test binary,
worker and operator executable and headroom library (about 8 GB across
the debug, wgpu and release trees); nothing ever removed them, and the
disk filled (containerd's image import and the linker then failed with
"no space left on device"). Of each such artifact only the newest is
kept; cargo rebuilds anything else it needs. Dependencies' libraries are
left alone (several versions of one crate may be live at once).
"""
import collections
import os
import re
import sys

target = sys.argv[1]
name = re.compile(r"^(.*)-([0-9a-f]{16})(\.rlib|\.rmeta|\.d|\.so)?$")
freed = 0
for tree in ("debug", "release", "wgpu/debug", "wgpu/release", "cuda/debug", "cuda/release"):
    deps = os.path.join(target, tree, "deps")
    if not os.path.isdir(deps):
        continue
    groups = collections.defaultdict(list)
    for f in os.listdir(deps):
        m = name.match(f)
        path = os.path.join(deps, f)
        if not m or not os.path.isfile(path):
            continue
        stem, ext = m.group(1), m.group(3) or ""
        # Executables (no extension: test binaries, bins) are the workspace's;
        # libraries only where they are headroom's own crates.
        if ext and not stem.startswith(("libheadroom", "headroom")):
            continue
        groups[(stem, ext)].append((os.path.getmtime(path), path))
    for versions in groups.values():
        versions.sort()
        for _, path in versions[:-1]:
            freed += os.path.getsize(path)
            os.remove(path)
print(f"pruned {freed / 2**30:.1f} GiB of earlier runs' artifacts from {target}")
