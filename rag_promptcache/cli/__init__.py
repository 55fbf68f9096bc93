"""The `rag-promptcache` command line. `main` is the console entry point."""

from rag_promptcache.cli.app import app, main

__all__ = ["app", "main"]
