#!/usr/bin/env bash
# Type-check a Grafana dashboard JSON against Grafana's own dashboard schema: the TypeScript types
# of @grafana/schema (generated from Grafana's CUE schema), compiled with `tsc --strict`. The
# dashboard is embedded as an object literal, so enum fields keep their literal types and
# unknown keys are errors. "__requires" (the import envelope of shared dashboards, not part of
# the dashboard model) is left out.
#
#   bash deploy/grafana/check_schema.sh [dashboard.json]     # default: deploy/grafana/turnscope.json
#
# Needs node and npm (the npm registry) the first time; packages are cached in
# $TURNSCOPE_GRAFANA_SCHEMA_CACHE (default ~/.cache/turnscope/grafana-schema).
# Exit status: 0 valid, 1 schema errors (printed), 3 the packages could not be installed.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dashboard=$(realpath "${1:-$here/turnscope.json}")
cache=${TURNSCOPE_GRAFANA_SCHEMA_CACHE:-$HOME/.cache/turnscope/grafana-schema}
schema_version=13.2.3
typescript_version=5.9.3
mkdir -p "$cache"
cd "$cache"
installed() {
    node -e "process.exit(require('./node_modules/@grafana/schema/package.json').version === '$schema_version' &&
                          require('./node_modules/typescript/package.json').version === '$typescript_version' ? 0 : 1)" 2>/dev/null
}
if ! installed; then
    [ -f package.json ] || echo '{"name": "turnscope-grafana-schema-check", "private": true}' > package.json
    if ! npm install --silent --no-audit --no-fund "@grafana/schema@$schema_version" "typescript@$typescript_version" \
            > install.log 2>&1; then
        cat install.log >&2
        echo "could not install @grafana/schema@$schema_version and typescript@$typescript_version" >&2
        exit 3
    fi
fi
node -e '
const fs = require("fs");
const d = JSON.parse(fs.readFileSync(process.argv[1], "utf8"));
delete d.__requires;
fs.writeFileSync("check.ts", "import type { Dashboard } from \"@grafana/schema\";\n" +
                 "export const dashboard: Dashboard = " + JSON.stringify(d, null, 1) + ";\n");
' "$dashboard"
if ! node node_modules/typescript/bin/tsc --noEmit --strict --skipLibCheck --moduleResolution bundler --module esnext \
        --target es2020 check.ts; then
    echo "$dashboard does not match @grafana/schema@$schema_version's Dashboard (line numbers refer to $cache/check.ts)" >&2
    exit 1
fi
echo "$dashboard matches @grafana/schema@$schema_version's Dashboard"
