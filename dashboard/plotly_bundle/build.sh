#!/usr/bin/env bash
# Rebuild dashboard/assets/plotly-scatter-heatmap-<version>.min.js and its LICENSE from entry.js:
#
#     bash dashboard/plotly_bundle/build.sh [plotly.js version, default 4.1.1]
#
# Needs node and npm. The version should be the plotly.js the installed Python plotly ships
# (python -c "import plotly.offline as o; print(o.get_plotlyjs_version())"); after a new one, change
# the file name in dashboard/assets/gradwatch.js and remove the old bundle and LICENSE.
#
# Why a bundle of our own: the cartesian dist (1.5 MB) also registers bar, box, contour, histograms,
# image, pie, ternary and violin; compiling and running it was most of a cold run page's main-thread
# wait before the first chart. This one is 1.15 MB (docs/performance.md, "Dashboard page load").
set -euo pipefail
version="${1:-4.1.1}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
assets="$here/../assets"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm init -y >/dev/null
npm install --no-audit --no-fund --silent "plotly.js@$version" "esbuild@0.28"
cp "$here/entry.js" .
# The options of plotly.js's own esbuild-config.js (iife, global Plotly, global=window, es2016); CSS is
# only maplibre's (map traces, not in this bundle).
npx esbuild entry.js --bundle --minify --format=iife --global-name=Plotly --target=es2016 \
    --define:global=window --define:define.amd=false --alias:stream=stream-browserify --loader:.css=empty \
    "--banner:js=/* plotly.js v$version (core: scatter, and heatmap) - Copyright 2012-2026, Plotly, Inc. - MIT license */" \
    "--footer:js=window.Plotly=Plotly;" \
    --outfile="$assets/plotly-scatter-heatmap-$version.min.js"
cp node_modules/plotly.js/LICENSE "$assets/plotly-scatter-heatmap-$version.LICENSE.txt"
echo "wrote $assets/plotly-scatter-heatmap-$version.min.js"
