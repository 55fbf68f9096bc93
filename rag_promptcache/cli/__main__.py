"""`python -m rag_promptcache.cli`: the same as the `rag-promptcache` command."""

from rag_promptcache.cli import main

main()
