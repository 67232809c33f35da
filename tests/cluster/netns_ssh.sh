#!/bin/sh
# `ssh HOST COMMAND` for the namespace harness (tests/cluster/netns.py), as `--ssh "sh netns_ssh.sh TAG"`:
# COMMAND runs through `sh -c`, as a remote login shell runs it, in HOST's namespace TAG-HOST, with this
# process's stdin; a HOST without a namespace fails as ssh does for a host it cannot reach (exit 255).
tag=$1 host=$2 command=$3
if [ ! -e "/run/netns/$tag-$host" ]; then
    echo "ssh: Could not resolve hostname $host: Name or service not known" >&2
    exit 255
fi
exec ip netns exec "$tag-$host" sh -c "$command"
