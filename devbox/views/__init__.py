"""Pure text renderers of what the commands print: no I/O, no backend, no session."""
