"""The command-line tools beside the runtime: ``calc`` (pure Python), ``simulate`` (the core, no torch) and what
they share (argument types, console output). ``hisparse.cli`` imports each only when it is chosen."""
