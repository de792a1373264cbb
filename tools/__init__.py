"""Developer tools (coverage reports); not part of the zerojax package and never imported by it."""
