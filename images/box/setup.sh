#!/bin/sh
# The box image's build steps, in one place: images/box/Dockerfile runs them on the CUDA
# (Ubuntu) base, tests/cluster/boximage/ on a Debian root for the test node, so the two
# cannot drift. Each step can run again: it skips what is already there where that is cheap.
#
#   setup.sh system   OS packages, the en_US.UTF-8 locale, the non-root user (uid 1000)
#   setup.sh python   /opt/devbox/venv with devbox's dependencies and build requirements
#                     (needs only /opt/devbox/src/pyproject.toml, so a layer cache keeps it
#                     while the code changes)
#   setup.sh devbox   devbox itself from /opt/devbox/src, offline, and /usr/local/bin/devbox
set -eu

SRC=/opt/devbox/src
VENV=/opt/devbox/venv
# What editors' remote servers and git need too: VS Code, Cursor and JetBrains Gateway
# download their server with curl or wget (over TLS: ca-certificates) and unpack it with
# tar and gzip; VS Code's scripts look for a running server with ps (procps); git fetches
# over https and ssh, and ssh/scp out of the box (an editor's fallback copy) need
# openssh-client.
PACKAGES="python3 python3-venv python3-pip screen tmux openssh-client rsync git ca-certificates
curl wget tar gzip procps locales less vim-tiny"
LOCALE=en_US.UTF-8
# A non-root login for a look inside the image (docker run --user 1000). Boxes run as
# their owner's own uid, which the agent makes when a claim names the owner.
USER_NAME=dev
USER_ID=1000

step_system() {
    missing=""
    for package in $PACKAGES; do
        dpkg-query -W -f '${Status}\n' "$package" 2>/dev/null | grep -q ' installed$' \
            || missing="$missing $package"
    done
    if [ -n "$missing" ]; then
        apt-get update
        # shellcheck disable=SC2086  # one word per package
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing
        rm -rf /var/lib/apt/lists/*
    fi
    make_locale
    make_user
}

make_locale() {
    locale -a | grep -qix 'en_US\.utf-\{0,1\}8' && return 0
    # Debian's locale-gen builds what /etc/locale.gen lists and ignores its arguments;
    # Ubuntu's takes the locale as an argument. Doing both works on either.
    if [ -f /etc/locale.gen ]; then
        if grep -q "^# *$LOCALE UTF-8" /etc/locale.gen; then
            sed -i "s/^# *\($LOCALE UTF-8\)/\1/" /etc/locale.gen
        elif ! grep -q "^$LOCALE UTF-8" /etc/locale.gen; then
            echo "$LOCALE UTF-8" >>/etc/locale.gen
        fi
    fi
    locale-gen "$LOCALE"
}

make_user() {
    [ "$(id -u "$USER_NAME" 2>/dev/null)" = "$USER_ID" ] && return 0
    # Ubuntu's images ship a user "ubuntu" with uid 1000.
    other=$(getent passwd "$USER_ID" | cut -d: -f1)
    if [ -n "$other" ]; then
        userdel -r "$other" 2>/dev/null || userdel "$other"
    fi
    useradd --uid "$USER_ID" --user-group --create-home --shell /bin/bash "$USER_NAME"
}

step_python() {
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # tomllib: Python 3.11+, which both bases have (Ubuntu 24.04: 3.12, Debian 12: 3.11).
    # Build requirements too, because the devbox step builds without isolation (offline).
    requirements=$("$VENV/bin/python" - "$SRC/pyproject.toml" <<'EOF'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)
# The pq extra too: the box's agent offers sntrup761x25519, OpenSSH 9.0-9.8's preferred
# key exchange, from it (both bases have the glibc its wheels need).
extra = project["project"]["optional-dependencies"]["pq"]
for requirement in project["build-system"]["requires"] + project["project"]["dependencies"] + extra:
    print(requirement)
EOF
)
    # One argument a line: a specifier may hold spaces, and "[" must not glob.
    set -f
    old_ifs=$IFS
    IFS='
'
    # shellcheck disable=SC2086  # split at newlines only
    set -- $requirements
    IFS=$old_ifs
    set +f
    "$VENV/bin/pip" install --no-cache-dir --disable-pip-version-check "$@"
}

step_devbox() {
    "$VENV/bin/pip" install --no-cache-dir --disable-pip-version-check \
        --no-deps --no-build-isolation --no-index "$SRC"
    # pip builds in the source tree; the image needs only what it installed.
    rm -rf "$SRC/build" "$SRC"/*.egg-info
    ln -sf "$VENV/bin/devbox" /usr/local/bin/devbox
}

case "${1:-}" in
system | python | devbox) "step_$1" ;;
*)
    echo "usage: setup.sh system|python|devbox" >&2
    exit 2
    ;;
esac
