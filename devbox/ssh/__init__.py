"""Client side of SSH: keys, pinned host keys, the ProxyCommand bridge, attach."""
