#!/usr/bin/env bash
# Helm post-renderer for Kueue's chart (reads the rendered manifests on stdin,
# writes them back on stdout):
# - The chart runs `/manager` (the path in Kueue's own image); the image
#   e2e/images/build.sh makes from the same binary has it at
#   /usr/local/bin/kueue, as every image of this project.
# - The chart always registers the visibility API (APIServices
#   v1beta1/v1beta2.visibility.kueue.x-k8s.io), whatever the VisibilityOnDemand
#   gate says. The single-node cluster's kube-apiserver has no aggregation
#   layer configured (no front-proxy certificates), so those APIServices stay
#   unavailable, and while any APIService is unavailable no namespace can finish
#   deleting (NamespaceDeletionDiscoveryFailure): every test namespace stayed
#   Terminating. Headroom never reads the visibility API, and values.yaml
#   turns the gate off, so the APIServices are dropped here.
set -euo pipefail
awk '
  function flush() {
    if (doc != "" && doc !~ /\nkind: APIService\n/) printf "%s", doc
    doc = ""
  }
  /^---/ { flush(); doc = $0 "\n"; next }
  { doc = doc $0 "\n" }
  END { flush() }
' | sed 's#^\([[:space:]]*- \)/manager$#\1/usr/local/bin/kueue#'
