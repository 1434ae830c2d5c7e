"""How kvserve is launched: the command line (and, later, Serve apps and batch jobs)."""
