#!/usr/bin/env bash
# Helm post-renderer for Kueue's chart: the chart runs `/manager` (the path
# in Kueue's own image); the image e2e/images/build.sh makes from the same
# binary has it at /usr/local/bin/kueue, as every image of this project.
set -euo pipefail
sed 's#^\([[:space:]]*- \)/manager$#\1/usr/local/bin/kueue#'
